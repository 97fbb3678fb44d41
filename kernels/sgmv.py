"""SGMV: segmented gather matrix-vector products for multi-LoRA prefill (punica's design).

Tokens of a step come in contiguous segments; every token of a segment uses the same adapter
slot (`-1` = no adapter: its rows are left untouched). Adapter weights live in stacked slot
buffers so that one launch serves every adapter of the batch:

    a_stack: [num_slots, r_max, H]    lora_A of each resident adapter
    b_stack: [num_slots, N, r_max]    lora_B of each resident adapter

Mixed ranks are padded to `r_max` with zeros: A's extra rows give zero columns of `t`, and B's
extra columns multiply them, so padding never changes the result. One stride for every slot
keeps the kernels shape-static (one compile, CUDA-graph friendly) and `t` a dense
`[T, r_max]` tensor; the cost is reading the zero rows, bounded by `--max-lora-rank`.

Fused projections (`qkv_proj` rows `[q|k|v]`, `gate_up_proj` rows `[gate|up]`): stack the
slices' A along the rank axis (`[num_slots, 3 * r_max, H]`) so one shrink gives `t` for all
slices, then expand each slice's columns of `t` into its output columns with `slice_offset`
(see `lora.batch.lora_expand_slices`).

Shrink and expand are the same product `out[rows] (+)= scale * in[rows] @ W[slot]^T`, so one
Triton kernel serves both. The torch path (CPU) is one matmul per segment.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def sgmv_shrink(
    x: torch.Tensor,
    a_stack: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
) -> torch.Tensor:
    """t = x @ A[slot]^T per segment. Triton on CUDA, grouped torch matmuls elsewhere."""
    if x.is_cuda:
        return sgmv_shrink_triton(x, a_stack, seg_indptr, seg_slots, max_seg_len)
    return sgmv_shrink_torch(x, a_stack, seg_indptr, seg_slots, max_seg_len)


def sgmv_expand(
    y: torch.Tensor,
    t: torch.Tensor,
    b_stack: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    scales: torch.Tensor,
    max_seg_len: int,
    slice_offset: int = 0,
) -> None:
    """y[:, slice] += (t @ B[slot]^T) * scale[slot] per segment, in place."""
    if y.is_cuda:
        sgmv_expand_triton(y, t, b_stack, seg_indptr, seg_slots, scales, max_seg_len, slice_offset)
    else:
        sgmv_expand_torch(y, t, b_stack, seg_indptr, seg_slots, scales, max_seg_len, slice_offset)


# --- torch reference / CPU path ------------------------------------------------------------


def sgmv_shrink_torch(
    x: torch.Tensor,
    a_stack: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
) -> torch.Tensor:
    """Shrink every segment with its adapter's A.

    Args:
        x: [T, H] activations; a_stack: [num_slots, R, H].
        seg_indptr: [S + 1] int, segment s is tokens `seg_indptr[s]:seg_indptr[s + 1]`.
        seg_slots: [S] int, adapter slot of each segment, -1 = none.
        max_seg_len: longest segment (sizes the Triton grid; unused here).
    Returns:
        t: [T, R], zero on rows without an adapter.

    Semantics:
        t = zeros(T, R)
        for s in range(S):
            if seg_slots[s] >= 0:
                for i in range(seg_indptr[s], seg_indptr[s + 1]):
                    t[i] = a_stack[seg_slots[s]] @ x[i]
    """
    t = x.new_zeros(x.shape[0], a_stack.shape[1])  # (num_tokens, rank)
    bounds = seg_indptr.tolist()
    for s, slot in enumerate(seg_slots.tolist()):
        start, end = bounds[s], bounds[s + 1]
        if slot >= 0 and end > start:
            torch.mm(x[start:end], a_stack[slot].t(), out=t[start:end])
    return t


def sgmv_expand_torch(
    y: torch.Tensor,
    t: torch.Tensor,
    b_stack: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    scales: torch.Tensor,
    max_seg_len: int,
    slice_offset: int = 0,
) -> None:
    """Expand every segment with its adapter's B, added into a column slice of y.

    Args:
        y: [T, N_total], updated in place in columns `slice_offset : slice_offset + N`.
        t: [T, R] (may be a column view of a fused shrink output); b_stack: [num_slots, N, R].
        scales: [num_slots] float, each adapter's `alpha / r` (or `alpha / sqrt(r)`).
        seg_indptr, seg_slots, max_seg_len: as in `sgmv_shrink_torch`.

    Semantics:
        for s in range(S):
            slot = seg_slots[s]
            if slot >= 0:
                for i in range(seg_indptr[s], seg_indptr[s + 1]):
                    y[i, slice_offset : slice_offset + N] += scales[slot] * (b_stack[slot] @ t[i])
    """
    out = y.narrow(1, slice_offset, b_stack.shape[1])  # (num_tokens, N) view
    bounds = seg_indptr.tolist()
    scale_of = scales.tolist()
    for s, slot in enumerate(seg_slots.tolist()):
        start, end = bounds[s], bounds[s + 1]
        if slot >= 0 and end > start:
            out[start:end].addmm_(t[start:end], b_stack[slot].t(), alpha=scale_of[slot])


# --- Triton ---------------------------------------------------------------------------------


def sgmv_shrink_triton(
    x: torch.Tensor,
    a_stack: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
) -> torch.Tensor:
    """Same contract as `sgmv_shrink_torch`."""
    t = x.new_zeros(x.shape[0], a_stack.shape[1])  # (num_tokens, rank)
    _launch(x, a_stack, t, seg_indptr, seg_slots, None, max_seg_len, _SHRINK_BLOCKS)
    return t


def sgmv_expand_triton(
    y: torch.Tensor,
    t: torch.Tensor,
    b_stack: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    scales: torch.Tensor,
    max_seg_len: int,
    slice_offset: int = 0,
) -> None:
    """Same contract as `sgmv_expand_torch`."""
    out = y.narrow(1, slice_offset, b_stack.shape[1])  # (num_tokens, N) view
    _launch(t, b_stack, out, seg_indptr, seg_slots, scales, max_seg_len, _EXPAND_BLOCKS)


def _launch(
    inp: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    scales: torch.Tensor | None,
    max_seg_len: int,
    blocks: tuple[int, int, int, int],
) -> None:
    """out[rows] (+)= scale * inp[rows] @ w[slot]^T for every segment. inp: [T, K],
    w: [num_slots, N, K], out: [T, N] (strided views allowed)."""
    block_m, block_n, block_k, num_stages = blocks
    num_segments = seg_slots.shape[0]
    n, k = w.shape[1], w.shape[2]
    if num_segments == 0 or max_seg_len == 0:
        return
    block_n = min(block_n, max(16, triton.next_power_of_2(n)))
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    grid = (triton.cdiv(max_seg_len, block_m), triton.cdiv(n, block_n), num_segments)
    _sgmv_kernel[grid](
        inp,
        w,
        out,
        seg_indptr,
        seg_slots,
        scales if scales is not None else inp,
        n,
        k,
        inp.stride(0),
        inp.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        out.stride(1),
        ACCUMULATE=scales is not None,
        PRECISION="ieee" if inp.dtype == torch.float32 else "tf32",
        UPCAST=_INTERPRETED,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_stages=num_stages,
    )


# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages), from a sweep on an H100 (bf16, H=4096, out=6144,
# r=16, 2048 tokens in 4 segments, CUDA graphs): shrink 13.3 -> 7.4 us, expand 16.2 -> 9.7 us.
# Shrink is a long-K, narrow-N product (K = hidden): wide K tiles, deep pipelining.
_SHRINK_BLOCKS = (16, 64, 256, 4)
_EXPAND_BLOCKS = (64, 64, 16, 2)


@triton.jit
def _sgmv_kernel(
    in_ptr,
    w_ptr,
    out_ptr,
    indptr_ptr,
    slots_ptr,
    scales_ptr,
    N,
    K,
    s_in_t,
    s_in_k,
    s_w_slot,
    s_w_n,
    s_w_k,
    s_out_t,
    s_out_n,
    ACCUMULATE: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # One program: BLOCK_M rows of one segment x BLOCK_N output columns.
    pid_m, pid_n, seg = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slots_ptr + seg)
    start = tl.load(indptr_ptr + seg)
    end = tl.load(indptr_ptr + seg + 1)
    row0 = start + pid_m * BLOCK_M
    if (slot < 0) | (row0 >= end):
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < end
    col_ok = cols < N
    w_base = w_ptr + slot.to(tl.int64) * s_w_slot
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        a = tl.load(
            in_ptr + rows[:, None] * s_in_t + (k0 + ks)[None, :] * s_in_k,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # (BLOCK_M, BLOCK_K)
        b = tl.load(
            w_base + cols[None, :] * s_w_n + (k0 + ks)[:, None] * s_w_k,
            mask=col_ok[None, :] & k_ok[:, None],
            other=0.0,
        )  # (BLOCK_K, BLOCK_N): W[slot]^T tile
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=PRECISION)
    out_ptrs = out_ptr + rows[:, None] * s_out_t + cols[None, :] * s_out_n
    mask = row_ok[:, None] & col_ok[None, :]
    if ACCUMULATE:
        scale = tl.load(scales_ptr + slot)
        acc = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32) + acc * scale
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# Triton 3.9's interpreter multiplies bf16 tiles in `tl.dot` as their raw uint16 bits, so under
# TRITON_INTERPRET the tiles are upcast first. bf16 x bf16 products are exact in fp32, so this
# matches a tensor-core dot with fp32 accumulation.
_INTERPRETED = type(_sgmv_kernel).__name__ == "InterpretedFunction"
