"""BGMV: batched gather matrix-vector products for multi-LoRA decode (punica's design).

Each token names its own adapter slot (`-1` = no adapter: its row is left untouched), so a
decode batch whose requests use many different adapters is one launch. Weight layout, rank
padding and fused projections are as in `kernels.sgmv`:

    a_stack: [num_slots, r_max, H]    b_stack: [num_slots, N, r_max]

One Triton kernel serves shrink and expand (`out[i] (+)= scale * W[slot_i] @ in[i]`); each
program is one token x one tile of output columns. A fused projection's expand (`[q|k|v]`,
`[gate|up]`) is one launch over all its output columns, each column reading its own slice of
`t` (`bgmv_expand_slices`). The torch path (CPU) sorts the tokens by slot once and does one
matmul per adapter present, never a Python loop per token.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl


def bgmv_shrink(x: torch.Tensor, a_stack: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """t[i] = A[indices[i]] @ x[i]. Triton on CUDA, grouped torch matmuls elsewhere."""
    if x.is_cuda:
        return bgmv_shrink_triton(x, a_stack, indices)
    return bgmv_shrink_torch(x, a_stack, indices)


def bgmv_expand(
    y: torch.Tensor,
    t: torch.Tensor,
    b_stack: torch.Tensor,
    indices: torch.Tensor,
    scales: torch.Tensor,
    slice_offset: int = 0,
) -> None:
    """y[i, slice] += scale[slot] * B[indices[i]] @ t[i], in place."""
    if y.is_cuda:
        bgmv_expand_triton(y, t, b_stack, indices, scales, slice_offset)
    else:
        bgmv_expand_torch(y, t, b_stack, indices, scales, slice_offset)


def bgmv_expand_slices(
    y: torch.Tensor,
    t: torch.Tensor,
    b_stack: torch.Tensor,
    sizes: Sequence[int],
    indices: torch.Tensor,
    scales: torch.Tensor,
) -> None:
    """`bgmv_expand` of every slice of a fused projection; one launch on CUDA."""
    if y.is_cuda:
        bgmv_expand_slices_triton(y, t, b_stack, sizes, indices, scales)
    else:
        bgmv_expand_slices_torch(y, t, b_stack, sizes, indices, scales)


# --- torch reference / CPU path ------------------------------------------------------------


def bgmv_shrink_torch(
    x: torch.Tensor, a_stack: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """Shrink every token with its own adapter's A.

    Args:
        x: [T, H] activations; a_stack: [num_slots, R, H].
        indices: [T] int, adapter slot of each token, -1 = none.
    Returns:
        t: [T, R], zero on rows without an adapter.

    Semantics:
        t = zeros(T, R)
        for i in range(T):
            if indices[i] >= 0:
                t[i] = a_stack[indices[i]] @ x[i]
    """
    t = x.new_zeros(x.shape[0], a_stack.shape[1])  # (num_tokens, rank)
    order, runs = group_by_slot(indices)
    if runs:
        xs = x.index_select(0, order)  # (num_lora_tokens, H), grouped by slot
        ts = t.new_empty(order.shape[0], t.shape[1])  # (num_lora_tokens, rank)
        for slot, start, end in runs:
            torch.mm(xs[start:end], a_stack[slot].t(), out=ts[start:end])
        t.index_copy_(0, order, ts)
    return t


def bgmv_expand_torch(
    y: torch.Tensor,
    t: torch.Tensor,
    b_stack: torch.Tensor,
    indices: torch.Tensor,
    scales: torch.Tensor,
    slice_offset: int = 0,
) -> None:
    """Expand every token with its own adapter's B, added into a column slice of y.

    Args:
        y: [T, N_total], updated in place in columns `slice_offset : slice_offset + N`.
        t: [T, R] (may be a column view of a fused shrink output); b_stack: [num_slots, N, R].
        indices: [T] int, -1 = none. scales: [num_slots] float, each adapter's scaling.

    Semantics:
        for i in range(T):
            slot = indices[i]
            if slot >= 0:
                y[i, slice_offset : slice_offset + N] += scales[slot] * (b_stack[slot] @ t[i])
    """
    order, runs = group_by_slot(indices)
    if not runs:
        return
    out = y.narrow(1, slice_offset, b_stack.shape[1])  # (num_tokens, N) view
    ts = t.index_select(0, order)  # (num_lora_tokens, rank), grouped by slot
    delta = out.new_empty(order.shape[0], out.shape[1])  # (num_lora_tokens, N)
    scale_of = scales.tolist()
    for slot, start, end in runs:
        d = delta[start:end]
        torch.addmm(d, ts[start:end], b_stack[slot].t(), beta=0, alpha=scale_of[slot], out=d)
    out.index_add_(0, order, delta)


def bgmv_expand_slices_torch(
    y: torch.Tensor,
    t: torch.Tensor,
    b_stack: torch.Tensor,
    sizes: Sequence[int],
    indices: torch.Tensor,
    scales: torch.Tensor,
) -> None:
    """Expand the slices of a fused projection, each into its own columns of y.

    Args:
        y: [T, sum(sizes)]; t: [T, len(sizes) * R]; b_stack: [num_slots, sum(sizes), R].

    Semantics:
        offset = 0
        for j, n in enumerate(sizes):
            bgmv_expand(y, t[:, j * R : (j + 1) * R], b_stack[:, offset : offset + n],
                        indices, scales, slice_offset=offset)
            offset += n
    """
    offset, rank = 0, b_stack.shape[2]
    for j, n in enumerate(sizes):
        b = b_stack.narrow(1, offset, n)
        bgmv_expand_torch(y, t[:, j * rank : (j + 1) * rank], b, indices, scales, offset)
        offset += n


def group_by_slot(indices: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """Rows of the tokens that have an adapter, sorted by slot, and each slot's run in them.

    Returns:
        order: [num_lora_tokens] int64 token rows; runs: (slot, start, end) into `order`.
    """
    order = torch.argsort(indices, stable=True)
    counts = torch.bincount(indices.long() + 1, minlength=1).tolist()  # bin 0: slot -1
    runs, start = [], 0
    for slot, count in enumerate(counts[1:]):
        if count:
            runs.append((slot, start, start + count))
            start += count
    return order[counts[0] :], runs


# --- Triton ---------------------------------------------------------------------------------


def bgmv_shrink_triton(
    x: torch.Tensor, a_stack: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """Same contract as `bgmv_shrink_torch`."""
    t = x.new_empty(x.shape[0], a_stack.shape[1])  # (num_tokens, rank); base rows get zeros
    _launch(x, a_stack, t, indices, None, SHRINK_CONFIG)
    return t


def bgmv_expand_triton(
    y: torch.Tensor,
    t: torch.Tensor,
    b_stack: torch.Tensor,
    indices: torch.Tensor,
    scales: torch.Tensor,
    slice_offset: int = 0,
) -> None:
    """Same contract as `bgmv_expand_torch`."""
    out = y.narrow(1, slice_offset, b_stack.shape[1])  # (num_tokens, N) view
    _launch(t, b_stack, out, indices, scales, EXPAND_CONFIG)


def bgmv_expand_slices_triton(
    y: torch.Tensor,
    t: torch.Tensor,
    b_stack: torch.Tensor,
    sizes: Sequence[int],
    indices: torch.Tensor,
    scales: torch.Tensor,
) -> None:
    """Same contract as `bgmv_expand_slices_torch` (up to three slices)."""
    _launch(t, b_stack, y, indices, scales, EXPAND_CONFIG, sizes)


# (BLOCK_N, BLOCK_K, num_warps, num_stages). Shrink is a long-K, narrow-N product (K = hidden
# or intermediate, N = slices x rank): one output row per program gives the most programs, and
# wide, double-buffered K tiles keep each one's loads in flight. Expand is short-K (K = rank).
# Timed as the engine runs them, in a CUDA graph of 8 layers (H100, bf16, batch 64, a distinct
# rank-16 adapter per token), as fractions of the copy bandwidth, against the earlier
# (4, 1024, 8, 1) / (256, 16, 4, 1): shrink qkv 0.75 (0.74), gate_up 0.65 (0.64), o 0.50
# (0.42), down 0.78 (0.63); expand qkv 0.54 (0.51), gate_up 0.84 (0.77), o / down 0.50 / 0.48
# (0.51 / 0.49). Single-kernel timings with L2 flushed (`kernel_tune.py`) had ranked them apart.
SHRINK_CONFIG = (1, 4096, 8, 2)
EXPAND_CONFIG = (256, 16, 2, 1)


def _launch(
    inp: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    indices: torch.Tensor,
    scales: torch.Tensor | None,
    config: tuple[int, int, int, int],
    sizes: Sequence[int] = (),
) -> None:
    """out[i] (+)= scale * w[indices[i]] @ inp[i]. inp: [T, K], w: [num_slots, N, K],
    out: [T, N] (strided views allowed). Without scales (shrink) base rows are set to 0.
    With `sizes` (output slices, summing to N), slice j reads inp[:, j * K : (j + 1) * K]."""
    num_tokens, (n, k) = inp.shape[0], w.shape[1:]
    if num_tokens == 0:
        return
    assert len(sizes) <= 3, "at most three slices ([q|k|v])"
    bounds = list(itertools.accumulate(sizes))[:-1] + [n] * (3 - len(sizes))  # slice ends
    block_n, block_k, num_warps, num_stages = config
    block_n = min(block_n, triton.next_power_of_2(n))
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    grid = (num_tokens, triton.cdiv(n, block_n))
    _bgmv_kernel[grid](
        inp,
        w,
        out,
        indices,
        scales if scales is not None else inp,
        n,
        k,
        bounds[0],
        bounds[1],
        inp.stride(0),
        inp.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        out.stride(1),
        ACCUMULATE=scales is not None,
        SLICED=len(sizes) > 1,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )


@triton.jit
def _bgmv_kernel(
    in_ptr,
    w_ptr,
    out_ptr,
    idx_ptr,
    scales_ptr,
    N,
    K,
    END0,
    END1,
    s_in_t,
    s_in_k,
    s_w_slot,
    s_w_n,
    s_w_k,
    s_out_t,
    s_out_n,
    ACCUMULATE: tl.constexpr,
    SLICED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # One program: one token x BLOCK_N output columns; a matrix-vector product, so no tl.dot.
    tok, pid_n = tl.program_id(0), tl.program_id(1)
    slot = tl.load(idx_ptr + tok)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < N
    out_ptrs = out_ptr + tok * s_out_t + cols * s_out_n
    if slot < 0:  # base row: expand leaves it alone, shrink writes zeros
        if not ACCUMULATE:
            tl.store(out_ptrs, tl.zeros((BLOCK_N,), out_ptr.dtype.element_ty), mask=col_ok)
        return
    w_base = w_ptr + slot.to(tl.int64) * s_w_slot
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    in_row = in_ptr + tok * s_in_t
    if SLICED:  # column c reads the slice of inp that its output slice owns
        slice_idx = (cols >= END0).to(tl.int32) + (cols >= END1).to(tl.int32)
        in_row += slice_idx[:, None] * K * s_in_k
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        w = tl.load(
            w_base + cols[:, None] * s_w_n + (k0 + ks)[None, :] * s_w_k,
            mask=col_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # (BLOCK_N, BLOCK_K)
        if SLICED:
            v = tl.load(in_row + (k0 + ks)[None, :] * s_in_k, mask=k_ok[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * v.to(tl.float32), axis=1)
        else:
            v = tl.load(in_row + (k0 + ks) * s_in_k, mask=k_ok, other=0.0)
            acc += tl.sum(w.to(tl.float32) * v.to(tl.float32)[None, :], axis=1)
    if ACCUMULATE:
        scale = tl.load(scales_ptr + slot)
        acc = tl.load(out_ptrs, mask=col_ok, other=0.0).to(tl.float32) + acc * scale
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=col_ok)
