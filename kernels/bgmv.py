"""BGMV: batched gather matrix-vector products for multi-LoRA decode (punica's design).

Each token names its own adapter slot (`-1` = no adapter: its row is left untouched), so a
decode batch whose requests use many different adapters is one launch. Weights live in the
unified adapter pool, each adapter at its own rank, as in `kernels.sgmv`:

    a_pool: [U, S, K]    b_pool: [U, N]    starts, ranks: [num_slots] int32

(slot s owns pool rows `starts[s] : starts[s] + ranks[s]`; rank 0 = empty slot). The shrink
output `t` is `[T, S * R]` for the launch's `max_rank` R, column `j * R + i` = `(A_j @ x)_i`,
zero at `i >= r` and on base rows. Kernels mask the rank axis at `ranks[slot]`: they read only
the adapter's own rows of the pool, so bandwidth follows its rank and other pool rows may hold
anything.

One Triton kernel serves shrink and expand (`out[i] (+)= scale * W[slot_i] @ in[i]`, the rank
axis on W's rows or columns); each program is one token x one tile of output columns. A fused
projection's expand (`[q|k|v]`, `[gate|up]`) is one launch over all its output columns, each
column reading its own slice of `t` (`bgmv_expand_slices`). The torch path (CPU) sorts the
tokens by slot once and does one matmul per adapter present (and slice), never a Python loop
per token.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.sgmv import shrink_rows


def bgmv_shrink(
    x: torch.Tensor,
    a_pool: torch.Tensor,
    starts: torch.Tensor,
    ranks: torch.Tensor,
    max_rank: int,
    indices: torch.Tensor,
) -> torch.Tensor:
    """t[i] = A[indices[i]] @ x[i]. Triton on CUDA, grouped torch matmuls elsewhere."""
    fn = bgmv_shrink_triton if x.is_cuda else bgmv_shrink_torch
    return fn(x, a_pool, starts, ranks, max_rank, indices)


def bgmv_expand(
    y: torch.Tensor,
    t: torch.Tensor,
    b_pool: torch.Tensor,
    starts: torch.Tensor,
    ranks: torch.Tensor,
    indices: torch.Tensor,
    scales: torch.Tensor,
    slice_offset: int = 0,
) -> None:
    """y[i, slice] += scale[slot] * t[i] @ B[indices[i]], in place."""
    fn = bgmv_expand_triton if y.is_cuda else bgmv_expand_torch
    fn(y, t, b_pool, starts, ranks, indices, scales, slice_offset)


def bgmv_expand_slices(
    y: torch.Tensor,
    t: torch.Tensor,
    b_pool: torch.Tensor,
    sizes: Sequence[int],
    starts: torch.Tensor,
    ranks: torch.Tensor,
    indices: torch.Tensor,
    scales: torch.Tensor,
) -> None:
    """`bgmv_expand` of every slice of a fused projection; one launch on CUDA."""
    fn = bgmv_expand_slices_triton if y.is_cuda else bgmv_expand_slices_torch
    fn(y, t, b_pool, sizes, starts, ranks, indices, scales)


# --- torch reference / CPU path ------------------------------------------------------------


def bgmv_shrink_torch(
    x: torch.Tensor,
    a_pool: torch.Tensor,
    starts: torch.Tensor,
    ranks: torch.Tensor,
    max_rank: int,
    indices: torch.Tensor,
) -> torch.Tensor:
    """Shrink every token with its own adapter's A, slice by slice.

    Args:
        x: [T, K] activations; a_pool: [U, S, K].
        starts, ranks: [num_slots] int, each slot's first pool row and rank (0 = empty).
        max_rank: R, the width of each slice's columns in t (>= every rank).
        indices: [T] int, adapter slot of each token, -1 = none.
    Returns:
        t: [T, S * R], zero at columns `j * R + i` with i >= rank and on rows without an adapter.

    Semantics:
        t = zeros(T, S * R)
        for tok in range(T):
            slot = indices[tok]
            if slot >= 0:
                u, r = starts[slot], ranks[slot]
                for j in range(S):
                    t[tok, j * R : j * R + r] = a_pool[u : u + r, j] @ x[tok]
    """
    t = x.new_zeros(x.shape[0], a_pool.shape[1] * max_rank)  # (num_tokens, slices * R)
    order, runs = group_by_slot(indices)
    if runs:
        xs = x.index_select(0, order)  # (num_lora_tokens, K), grouped by slot
        ts = t.new_zeros(order.shape[0], t.shape[1])  # (num_lora_tokens, slices * R)
        start_of, rank_of = starts.tolist(), ranks.tolist()
        for slot, lo, hi in runs:
            u, r = start_of[slot], rank_of[slot]
            shrink_rows(ts[lo:hi], xs[lo:hi], a_pool[u : u + r], max_rank)
        t.index_copy_(0, order, ts)
    return t


def bgmv_expand_torch(
    y: torch.Tensor,
    t: torch.Tensor,
    b_pool: torch.Tensor,
    starts: torch.Tensor,
    ranks: torch.Tensor,
    indices: torch.Tensor,
    scales: torch.Tensor,
    slice_offset: int = 0,
) -> None:
    """Expand every token with its own adapter's B, added into a column slice of y.

    Args:
        y: [T, N_total], updated in place in columns `slice_offset : slice_offset + N`.
        t: [T, >= max rank], one slice's columns of a shrink output (a column view is fine);
            only its first `rank` columns are read for each token.
        b_pool: [U, N], one slice's columns of the pool (a column view of a fused pool is fine).
        starts, ranks: [num_slots] int. indices: [T] int, -1 = none.
        scales: [num_slots] float, each adapter's scaling.

    Semantics:
        for tok in range(T):
            slot = indices[tok]
            if slot >= 0:
                u, r = starts[slot], ranks[slot]
                y[tok, slice_offset : slice_offset + N] += (
                    scales[slot] * (t[tok, :r] @ b_pool[u : u + r]))
    """
    order, runs = group_by_slot(indices)
    if not runs:
        return
    out = y.narrow(1, slice_offset, b_pool.shape[1])  # (num_tokens, N) view
    ts = t.index_select(0, order)  # (num_lora_tokens, >= rank), grouped by slot
    delta = out.new_empty(order.shape[0], out.shape[1])  # (num_lora_tokens, N)
    start_of, rank_of, scale_of = starts.tolist(), ranks.tolist(), scales.tolist()
    for slot, lo, hi in runs:
        u, r, d, scale = start_of[slot], rank_of[slot], delta[lo:hi], scale_of[slot]
        torch.addmm(d, ts[lo:hi, :r], b_pool[u : u + r], beta=0, alpha=scale, out=d)  # 0 at r=0
    out.index_add_(0, order, delta)


def bgmv_expand_slices_torch(
    y: torch.Tensor,
    t: torch.Tensor,
    b_pool: torch.Tensor,
    sizes: Sequence[int],
    starts: torch.Tensor,
    ranks: torch.Tensor,
    indices: torch.Tensor,
    scales: torch.Tensor,
) -> None:
    """Expand the slices of a fused projection, each into its own columns of y.

    Args:
        y: [T, sum(sizes)]; t: [T, len(sizes) * R]; b_pool: [U, sum(sizes)].

    Semantics:
        offset = 0
        for j, n in enumerate(sizes):
            bgmv_expand(y, t[:, j * R : (j + 1) * R], b_pool[:, offset : offset + n],
                        starts, ranks, indices, scales, slice_offset=offset)
            offset += n
    """
    order, runs = group_by_slot(indices)  # once for every slice
    if not runs:
        return
    max_rank, bounds = t.shape[1] // len(sizes), [0, *itertools.accumulate(sizes)]
    ts = t.index_select(0, order)  # (num_lora_tokens, S * R), grouped by slot
    delta = y.new_zeros(order.shape[0], y.shape[1])
    start_of, rank_of, scale_of = starts.tolist(), ranks.tolist(), scales.tolist()
    for slot, lo, hi in runs:
        u, r = start_of[slot], rank_of[slot]
        for j in range(len(sizes)) if r else ():
            c0, c1 = bounds[j], bounds[j + 1]
            delta[lo:hi, c0:c1].addmm_(ts[lo:hi, j * max_rank : j * max_rank + r],
                                       b_pool[u : u + r, c0:c1], alpha=scale_of[slot])
    y.index_add_(0, order, delta)


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
    x: torch.Tensor,
    a_pool: torch.Tensor,
    starts: torch.Tensor,
    ranks: torch.Tensor,
    max_rank: int,
    indices: torch.Tensor,
) -> torch.Tensor:
    """Same contract as `bgmv_shrink_torch`."""
    # every program writes its columns, zeros where there is no adapter weight
    t = x.new_empty(x.shape[0], a_pool.shape[1] * max_rank)  # (num_tokens, slices * R)
    _launch(x, a_pool, t, starts, ranks, max_rank, indices, None, SHRINK_CONFIG)
    return t


def bgmv_expand_triton(
    y: torch.Tensor,
    t: torch.Tensor,
    b_pool: torch.Tensor,
    starts: torch.Tensor,
    ranks: torch.Tensor,
    indices: torch.Tensor,
    scales: torch.Tensor,
    slice_offset: int = 0,
) -> None:
    """Same contract as `bgmv_expand_torch`."""
    out = y.narrow(1, slice_offset, b_pool.shape[1])  # (num_tokens, N) view
    _launch(t, b_pool, out, starts, ranks, t.shape[1], indices, scales, EXPAND_CONFIG)


def bgmv_expand_slices_triton(
    y: torch.Tensor,
    t: torch.Tensor,
    b_pool: torch.Tensor,
    sizes: Sequence[int],
    starts: torch.Tensor,
    ranks: torch.Tensor,
    indices: torch.Tensor,
    scales: torch.Tensor,
) -> None:
    """Same contract as `bgmv_expand_slices_torch` (up to three slices)."""
    max_rank = t.shape[1] // len(sizes)
    _launch(t, b_pool, y, starts, ranks, max_rank, indices, scales, EXPAND_CONFIG, sizes)


# (BLOCK_N, BLOCK_K, num_warps, num_stages). Shrink is a long-K, narrow-N product (K = hidden
# or intermediate, N = slices x rank): a few output rows per program and wide, double-buffered
# K tiles keep each one's loads in flight. Expand is short-K (K = rank): narrow column tiles,
# one warp each, give the most programs. Timed as the engine runs them (`kernel_tune.py
# --sweep bgmv --rank R`: padded slot stacks, a CUDA graph of 8 layers, batch 64, a distinct
# adapter per token; H200, bf16), the sum over the four projections against the best config at
# each rank 8 / 16 / 32 / 64: shrink 1.05 / 1.00 / 1.00 / 1.00 (the earlier (1, 4096, 8, 2):
# 1.00 / 1.02 / 1.09 / 1.11), expand 1.00 at every rank (the earlier (256, 16, 2, 1): 1.13 /
# 1.12 / 1.14 / 1.16). Wider expand K tiles (32, 64) lost at every rank.
SHRINK_CONFIG = (4, 4096, 4, 2)
EXPAND_CONFIG = (128, 16, 1, 1)


def _launch(
    inp: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    starts: torch.Tensor,
    ranks: torch.Tensor,
    max_rank: int,
    indices: torch.Tensor,
    scales: torch.Tensor | None,
    config: tuple[int, int, int, int],
    sizes: Sequence[int] = (),
) -> None:
    """out[i] (+)= scale * W[indices[i]] @ inp[i]; out: [T, N] (strided views allowed).

    Without scales (shrink): w is a_pool [U, S, K], inp [T, K], N = S * R and
    W[slot][n, k] = w[u + n % R, n // R, k], masked at n % R >= rank; base rows and masked
    columns are set to 0. With scales (expand): w is b_pool [U, N], inp [T, >= rank] (per
    slice), W[slot][n, k] = w[u + k, n], masked at k >= rank. With `sizes` (output slices,
    summing to N), slice j reads inp[:, j * R : j * R + rank]."""
    num_tokens, n = inp.shape[0], out.shape[1]
    if num_tokens == 0 or n == 0:
        return
    assert len(sizes) <= 3, "at most three slices ([q|k|v])"
    shrink = scales is None
    k = inp.shape[1] if shrink else max_rank
    bounds = list(itertools.accumulate(sizes))[:-1] + [n] * (3 - len(sizes))  # slice ends
    # (rank row, slice or output column, k) strides of w
    w_strides = (w.stride(0), w.stride(1), w.stride(2) if shrink else w.stride(0))
    block_n, block_k, num_warps, num_stages = config
    block_n = min(block_n, triton.next_power_of_2(n))
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    grid = (num_tokens, triton.cdiv(n, block_n))
    _bgmv_kernel[grid](
        inp,
        w,
        out,
        indices,
        starts,
        ranks,
        scales if scales is not None else inp,
        n,
        k,
        max_rank,
        bounds[0],
        bounds[1],
        inp.stride(0),
        inp.stride(1),
        *w_strides,
        out.stride(0),
        out.stride(1),
        SHRINK=shrink,
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
    starts_ptr,
    ranks_ptr,
    scales_ptr,
    N,
    K,
    R,
    END0,
    END1,
    s_in_t,
    s_in_k,
    s_w_u,
    s_w_n,
    s_w_k,
    s_out_t,
    s_out_n,
    SHRINK: tl.constexpr,
    SLICED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # One program: one token x BLOCK_N output columns; a matrix-vector product, so no tl.dot.
    tok, pid_n = tl.program_id(0), tl.program_id(1)
    slot = tl.load(idx_ptr + tok)
    rank = tl.load(ranks_ptr + slot, mask=slot >= 0, other=0)  # a base row has rank 0
    start = tl.load(starts_ptr + slot, mask=slot >= 0, other=0)  # in flight with the rank
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < N
    out_ptrs = out_ptr + tok * s_out_t + cols * s_out_n
    if SHRINK:  # column n = j * R + i is row i of slice j of A, 0 at i >= rank
        i = cols % R
        w_ok = col_ok & (i < rank)
        w_cols = i * s_w_u + (cols // R) * s_w_n
        k_end = K
        # no live column if neither the tile's first one nor the next slice's i = 0 is
        n0 = pid_n * BLOCK_N
        n1 = n0 - n0 % R + R
        dead = (rank == 0) | ((n0 % R >= rank) & ((n1 >= n0 + BLOCK_N) | (n1 >= N)))
    else:  # k = i is row i of B: read only the adapter's rank entries of t and rows of B
        w_ok = col_ok
        w_cols = cols * s_w_n
        k_end = rank
        dead = rank == 0
    if dead:  # no adapter weight in the tile
        if SHRINK:  # expand leaves the row alone, shrink writes zeros
            tl.store(out_ptrs, tl.zeros((BLOCK_N,), out_ptr.dtype.element_ty), mask=col_ok)
        return
    w_base = w_ptr + start.to(tl.int64) * s_w_u
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    in_row = in_ptr + tok * s_in_t
    if SLICED:  # column c reads the slice of inp that its output slice owns
        slice_idx = (cols >= END0).to(tl.int32) + (cols >= END1).to(tl.int32)
        in_row += slice_idx[:, None] * R * s_in_k
    for k0 in range(0, k_end, BLOCK_K):
        k_ok = (k0 + ks) < k_end
        w = tl.load(
            w_base + w_cols[:, None] + (k0 + ks)[None, :] * s_w_k,
            mask=w_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # (BLOCK_N, BLOCK_K)
        if SLICED:
            v = tl.load(in_row + (k0 + ks)[None, :] * s_in_k, mask=k_ok[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * v.to(tl.float32), axis=1)
        else:
            v = tl.load(in_row + (k0 + ks) * s_in_k, mask=k_ok, other=0.0)
            acc += tl.sum(w.to(tl.float32) * v.to(tl.float32)[None, :], axis=1)
    if not SHRINK:
        scale = tl.load(scales_ptr + slot)
        acc = tl.load(out_ptrs, mask=col_ok, other=0.0).to(tl.float32) + acc * scale
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=col_ok)
