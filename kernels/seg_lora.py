"""Segmented LoRA for CUDA graphs: shrink + expand of a (fused) projection whose launch grid
depends only on the captured batch size, never on the step's adapter mix.

A decode graph's rows are sorted by adapter slot, so tokens sharing an adapter are contiguous
runs. `segment_table` cuts the runs with an adapter into segments of at most `max_rows` rows
and pads the table to a fixed capacity (one segment per row at most) with empty segments; the
graph's static buffers hold it, refilled before each replay. Each segment's adapter tiles are
then read once per segment (tensor-core `tl.dot` over its rows), not once per token as BGMV
does, and the segments that are empty, base-only (slot -1) or of an empty slot exit at once.

Weights are the unified adapter pool of a projection: `a_pool: [U, S, K]`, `b_pool: [U, N]`
(lora_B transposed, N = sum(sizes), the S slices of a fused projection side by side). The
adapter in slot s owns pool rows `u = starts[s]` to `u + r` (r = ranks[s], 0 = empty slot):
slice j's A_j is `a_pool[u : u + r, j]` and B_j is `b_pool[u : u + r, lo_j : hi_j].T`. No other
pool row is read for it, so rows outside its own may hold anything. `max_rank` R >= every rank
is only the width of a slice of `t`: column `j * R + i` holds (A_j x)_i, for i < r alone. Loads
are masked by the slot's rank, so bandwidth follows the adapter's rank, not R.

The shrink is long-K and narrow-N (K = hidden or intermediate, N = S * R), so it splits K over
programs writing fp32 partial sums `[splits, T, S * R]`; each expand program, one segment x one
tile of output columns, adds the splits up as it loads `t` (each column reading its own slice
of `t`). Two launches per projection, no memset, no atomics. Every load of an expand program
depends only on its segment, so they are all in flight at once: these kernels are latency-bound
at decode.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # rows per segment: one tl.dot tile of M


def segment_table(
    slots: Sequence[int], capacity: int, max_rows: int = MAX_ROWS
) -> tuple[list[int], list[int]]:
    """The segments of rows whose adapter slots are `slots` (runs of equal slot; those with
    an adapter cut into pieces of at most `max_rows`), padded with empty segments of slot -1.

    Returns:
        (indptr, seg_slots): lists of `capacity + 1` and `capacity` ints; segment s is rows
        `indptr[s]:indptr[s + 1]`. `capacity >= len(slots)` always suffices.
    """
    indptr, seg_slots = [0], []
    for slot, run in itertools.groupby(slots):
        n = len(list(run))
        step = max_rows if slot >= 0 else n
        for start in range(0, n, step):
            indptr.append(indptr[-1] + min(step, n - start))
            seg_slots.append(slot)
    pad = capacity - len(seg_slots)
    assert pad >= 0, f"{len(seg_slots)} segments exceed the capacity {capacity}"
    return indptr + [indptr[-1]] * pad, seg_slots + [-1] * pad


def seg_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    a_pool: torch.Tensor,
    b_pool: torch.Tensor,
    sizes: Sequence[int],
    starts: torch.Tensor,
    ranks: torch.Tensor,
    max_rank: int,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    scales: torch.Tensor,
    max_rows: int = MAX_ROWS,
) -> None:
    """y += LoRA(x) per segment, in place (`seg_lora_torch` has the contract). Triton on CUDA,
    the torch reference elsewhere."""
    fn = seg_lora_triton if y.is_cuda else seg_lora_torch
    fn(y, x, a_pool, b_pool, sizes, starts, ranks, max_rank, seg_indptr, seg_slots, scales,
       max_rows)


def seg_lora_torch(
    y: torch.Tensor,
    x: torch.Tensor,
    a_pool: torch.Tensor,
    b_pool: torch.Tensor,
    sizes: Sequence[int],
    starts: torch.Tensor,
    ranks: torch.Tensor,
    max_rank: int,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    scales: torch.Tensor,
    max_rows: int = MAX_ROWS,
) -> None:
    """Shrink then expand a fused projection, segment by segment, at each adapter's rank.

    Args:
        y: [T, sum(sizes)], updated in place; x: [T, K].
        a_pool: [U, S, K]; b_pool: [U, sum(sizes)]; S = len(sizes).
        starts, ranks: [num_slots] int, each slot's first pool row and rank (0 = empty slot).
        max_rank: R >= every rank (the Triton path's width of a slice of `t`; unused here).
        seg_indptr: [C + 1] int, seg_slots: [C] int (-1 = no adapter), as `segment_table`
            makes them; segments with an adapter hold at most `max_rows` rows.
        scales: [num_slots] float.

    Semantics:
        for s in range(C):
            slot = seg_slots[s]
            if slot >= 0:
                u, r = starts[slot], ranks[slot]
                for i in range(seg_indptr[s], seg_indptr[s + 1]):
                    for j, (lo, hi) in enumerate(the column bounds of sizes):
                        t_j = a_pool[u : u + r, j] @ x[i]  # (r,)
                        y[i, lo:hi] += scales[slot] * (b_pool[u : u + r, lo:hi].T @ t_j)
    """
    assert a_pool.shape[1] == len(sizes) and b_pool.shape[1] == sum(sizes) == y.shape[1]
    bounds, slot_starts, slot_ranks = seg_indptr.tolist(), starts.tolist(), ranks.tolist()
    scale_of = scales.tolist()
    ends = list(itertools.accumulate(sizes))
    for s, slot in enumerate(seg_slots.tolist()):
        lo_row, hi_row = bounds[s], bounds[s + 1]
        if slot < 0 or hi_row <= lo_row or slot_ranks[slot] == 0:
            continue
        rows = slice(lo_row, hi_row)
        pool_rows = slice(slot_starts[slot], slot_starts[slot] + slot_ranks[slot])
        for j, (lo, hi) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
            t = x[rows] @ a_pool[pool_rows, j].t()  # (rows, r)
            y[rows, lo:hi].addmm_(t, b_pool[pool_rows, lo:hi], alpha=scale_of[slot])


# --- Triton ---------------------------------------------------------------------------------

# Shrink (BLOCK_N, BLOCK_K, K_SPLIT, num_warps, num_stages): each program sums K_SPLIT of K.
# Expand (BLOCK_N, num_warps): each program covers BLOCK_N output columns. From the H100 sweep
# in `kernel_tune.py` over the padded slot stacks (8 layers x 4 projections in one CUDA graph,
# batch 64, rank 16): 36.8 / 44.2 / 74.2 us a layer with 1 / 8 / 32 distinct adapters, against
# BGMV's 54.4 / 59.7 / 74.8.
SHRINK_CONFIG = (64, 256, 1024, 4, 3)
EXPAND_CONFIG = (256, 4)


def seg_lora_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    a_pool: torch.Tensor,
    b_pool: torch.Tensor,
    sizes: Sequence[int],
    starts: torch.Tensor,
    ranks: torch.Tensor,
    max_rank: int,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    scales: torch.Tensor,
    max_rows: int = MAX_ROWS,
    shrink_config: tuple[int, ...] | None = None,
    expand_config: tuple[int, ...] | None = None,
) -> None:
    """Same contract as `seg_lora_torch`; `t` exists only as the shrink's fp32 partials.
    Configs default to SHRINK_CONFIG and EXPAND_CONFIG."""
    partials = seg_shrink(x, a_pool, starts, ranks, max_rank, seg_indptr, seg_slots, max_rows,
                          shrink_config)
    seg_expand_triton(y, partials, b_pool, sizes, starts, ranks, max_rank, seg_indptr,
                      seg_slots, scales, max_rows, expand_config or EXPAND_CONFIG)


def seg_shrink(
    x: torch.Tensor,
    a_pool: torch.Tensor,
    starts: torch.Tensor,
    ranks: torch.Tensor,
    max_rank: int,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    max_rows: int = MAX_ROWS,
    config: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """The shrink half of `seg_lora_triton`: returns the fp32 partials [splits, T, S * R] that
    `seg_expand_triton` sums (so a CUDA graph can run the two on different streams). Only the
    entries `seg_shrink_triton` writes are defined; the expand reads no others."""
    config = config or SHRINK_CONFIG
    splits = triton.cdiv(x.shape[1], _k_split(x.shape[1], config))
    partials = x.new_empty(splits, x.shape[0], a_pool.shape[1] * max_rank, dtype=torch.float32)
    seg_shrink_triton(x, a_pool, starts, ranks, max_rank, seg_indptr, seg_slots, max_rows,
                      partials, config)
    return partials


def _k_split(k: int, config: tuple[int, ...]) -> int:
    """K per shrink split: whole BLOCK_K tiles, so only the end of K is ever masked."""
    block_k = min(config[1], max(16, triton.next_power_of_2(k)))
    return triton.cdiv(min(config[2], k), block_k) * block_k


def seg_shrink_triton(
    x: torch.Tensor,
    a_pool: torch.Tensor,
    starts: torch.Tensor,
    ranks: torch.Tensor,
    max_rank: int,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    max_rows: int,
    partials: torch.Tensor,
    config: tuple[int, ...] = SHRINK_CONFIG,
) -> None:
    """partials[p, i, j * R + c] = (A_j[slot] @ x[i])_c over split p of K (`_k_split` wide),
    for c < ranks[slot] and the rows i of the segments with an adapter; all other entries
    (c >= rank, rows without an adapter or of an empty slot) are left as they were.

    Args:
        x: [T, K]; a_pool: [U, S, K]; starts, ranks: [num_slots] int; max_rank: R.
        partials: [splits, T, S * R] fp32.
    """
    (num_slices, k), capacity = a_pool.shape[1:], seg_slots.shape[0]
    n = num_slices * max_rank
    block_n, block_k, _, num_warps, num_stages = config
    block_n = min(block_n, max(16, triton.next_power_of_2(n)))
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    k_split = _k_split(k, config)
    assert partials.shape == (triton.cdiv(k, k_split), x.shape[0], n) and partials.stride(2) == 1
    if capacity == 0 or x.shape[0] == 0:
        return
    grid = (partials.shape[0], capacity, triton.cdiv(n, block_n))  # splits first: the busy
    _shrink_kernel[grid](  # segments come first in the table, so their programs start first
        x, a_pool, partials, seg_indptr, seg_slots, starts, ranks, max_rank, n, k, k_split,
        *x.stride(), *a_pool.stride(), *partials.stride()[:2],
        PRECISION=_precision(x), UPCAST=_INTERPRETED, BLOCK_M=_block_m(max_rows),
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


def seg_expand_triton(
    y: torch.Tensor,
    partials: torch.Tensor,
    b_pool: torch.Tensor,
    sizes: Sequence[int],
    starts: torch.Tensor,
    ranks: torch.Tensor,
    max_rank: int,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    scales: torch.Tensor,
    max_rows: int,
    config: tuple[int, ...] = EXPAND_CONFIG,
) -> None:
    """y[i, slice j] += scale[slot] * B_j[slot] @ t_j[i] for the rows of the segments with an
    adapter, where t = partials.sum(0) and t_j its columns `j * R : j * R + ranks[slot]` (the
    only ones read, with the slot's `ranks[slot]` rows of b_pool).

    Args:
        y: [T, sum(sizes)], in the pool's dtype or fp32 (`LoraSlots.delta`);
        partials: [splits, T, len(sizes) * R] fp32 (up to 3 slices);
        b_pool: [U, sum(sizes)]; starts, ranks: [num_slots] int; max_rank: R.
    """
    n, capacity = b_pool.shape[1], seg_slots.shape[0]
    assert 1 <= len(sizes) <= 3 and sum(sizes) == n == y.shape[1] and partials.stride(2) == 1
    assert partials.shape[2] == len(sizes) * max_rank
    if capacity == 0 or y.shape[0] == 0:
        return
    ends = list(itertools.accumulate(sizes))[:-1] + [n] * (3 - len(sizes))  # slice ends
    block_n, num_warps = config
    block_n = min(block_n, max(16, triton.next_power_of_2(n)))
    splits = partials.shape[0]
    _expand_kernel[(triton.cdiv(n, block_n), capacity)](
        partials, b_pool, y, seg_indptr, seg_slots, starts, ranks, scales, n, max_rank, splits,
        ends[0], ends[1], *partials.stride()[:2], *b_pool.stride(), *y.stride(),
        NUM_SLICES=len(sizes), PRECISION=_precision(b_pool), UPCAST=_INTERPRETED,
        BLOCK_M=_block_m(max_rows), BLOCK_N=block_n,
        BLOCK_R=max(16, triton.next_power_of_2(max_rank)),
        BLOCK_S=triton.next_power_of_2(splits), num_warps=num_warps,
    )  # fmt: skip


def _block_m(max_rows: int) -> int:
    return max(16, triton.next_power_of_2(max_rows))


def _precision(t: torch.Tensor) -> str:
    return "ieee" if t.dtype == torch.float32 else "tf32"


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, part_ptr, indptr_ptr, slots_ptr, starts_ptr, ranks_ptr, R, N, K, K_SPLIT,
    s_x_t, s_x_k, s_a_u, s_a_s, s_a_k, s_p_split, s_p_t,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # One program: one segment's rows x BLOCK_N columns of t (N = S * R) x one split of K.
    split, seg, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slots_ptr + seg)
    start = tl.load(indptr_ptr + seg)
    end = tl.load(indptr_ptr + seg + 1)
    # The slot's rank and rows, loaded together (each a dependent load after the slot's).
    rank = tl.where(slot >= 0, tl.load(ranks_ptr + tl.maximum(slot, 0)), 0)
    u = tl.load(starts_ptr + tl.maximum(slot, 0)).to(tl.int64)
    # The tile's least rank index: that of its first column, unless the next slice starts
    # inside it (then 0). Tiles with every column at i >= rank exit before loading.
    col0 = pid_n * BLOCK_N
    i0 = col0 % R
    next_slice = col0 - i0 + R
    min_i = tl.where((next_slice < col0 + BLOCK_N) & (next_slice < N), 0, i0)
    if (start >= end) | (min_i >= rank):
        return
    rows = start + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    j, i = cols // R, cols % R  # each column's slice and rank index
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < end, (cols < N) & (i < rank)
    w_cols = a_ptr + (u + i) * s_a_u + j * s_a_s  # (BLOCK_N,): A_j's row i of each column
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = split * K_SPLIT
    for k0 in range(k_lo, tl.minimum(k_lo + K_SPLIT, K), BLOCK_K):
        k_ok = (k0 + ks) < K
        a = tl.load(x_ptr + rows[:, None] * s_x_t + (k0 + ks)[None, :] * s_x_k,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
        b = tl.load(w_cols[None, :] + (k0 + ks)[:, None] * s_a_k,
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)  # (BLOCK_K, BLOCK_N)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=PRECISION)
    out = part_ptr + split * s_p_split + rows[:, None] * s_p_t + cols[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_splits(part_ptr, w_ptr, rows, row_ok, col0, rank, SPLITS, s_p_split, s_p_t,
                UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_S: tl.constexpr):
    """t[rows, col0 : col0 + rank] from the shrink's partials (one load of every split; 0 at
    and past `rank`), in the weights' dtype (fp32 when UPCAST): (BLOCK_M, BLOCK_R)."""
    ps, rs = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_R)
    ptrs = (part_ptr + ps[:, None, None] * s_p_split + rows[None, :, None] * s_p_t
            + (col0 + rs)[None, None, :])
    mask = (ps < SPLITS)[:, None, None] & row_ok[None, :, None] & (rs < rank)[None, None, :]
    t = tl.sum(tl.load(ptrs, mask=mask, other=0.0), axis=0)
    if not UPCAST:
        t = t.to(w_ptr.dtype.element_ty)
    return t


@triton.jit
def _expand_kernel(
    part_ptr, w_ptr, out_ptr, indptr_ptr, slots_ptr, starts_ptr, ranks_ptr, scales_ptr, N, R,
    SPLITS, END0, END1, s_p_split, s_p_t, s_w_u, s_w_n, s_out_t, s_out_n,
    NUM_SLICES: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    # One program: one segment's rows x BLOCK_N output columns.
    pid_n, seg = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slots_ptr + seg)
    start = tl.load(indptr_ptr + seg)
    end = tl.load(indptr_ptr + seg + 1)
    # The slot's rank and rows, loaded together (each a dependent load after the slot's).
    rank = tl.where(slot >= 0, tl.load(ranks_ptr + tl.maximum(slot, 0)), 0)
    u = tl.load(starts_ptr + tl.maximum(slot, 0)).to(tl.int64)
    if (start >= end) | (rank <= 0):
        return
    rows = start + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    row_ok, col_ok = rows < end, cols < N
    w = tl.load(w_ptr + (u + rs)[:, None] * s_w_u + cols[None, :] * s_w_n,
                mask=col_ok[None, :] & (rs < rank)[:, None], other=0.0)  # (BLOCK_R, BLOCK_N)
    out_ptrs = out_ptr + rows[:, None] * s_out_t + cols[None, :] * s_out_n
    mask = row_ok[:, None] & col_ok[None, :]
    y = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scales_ptr + slot)
    t0 = _sum_splits(part_ptr, w_ptr, rows, row_ok, 0, rank, SPLITS, s_p_split, s_p_t, UPCAST,
                     BLOCK_M, BLOCK_R, BLOCK_S)
    if UPCAST:
        w = w.to(tl.float32)
    if NUM_SLICES == 1:
        acc = tl.dot(t0, w, input_precision=PRECISION)
    else:  # a tile may straddle slices: each slice's t meets only its own columns
        zero = tl.zeros_like(w)
        acc = tl.dot(t0, tl.where((cols < END0)[None, :], w, zero), input_precision=PRECISION)
        t1 = _sum_splits(part_ptr, w_ptr, rows, row_ok, R, rank, SPLITS, s_p_split, s_p_t,
                         UPCAST, BLOCK_M, BLOCK_R, BLOCK_S)
        in_1 = (cols >= END0) & (cols < END1)
        acc += tl.dot(t1, tl.where(in_1[None, :], w, zero), input_precision=PRECISION)
        if NUM_SLICES > 2:
            t2 = _sum_splits(part_ptr, w_ptr, rows, row_ok, 2 * R, rank, SPLITS, s_p_split,
                             s_p_t, UPCAST, BLOCK_M, BLOCK_R, BLOCK_S)
            acc += tl.dot(t2, tl.where((cols >= END1)[None, :], w, zero),
                          input_precision=PRECISION)
    tl.store(out_ptrs, (y + acc * scale).to(out_ptr.dtype.element_ty), mask=mask)


# Interpreted (TRITON_INTERPRET=1, on CPU): dots take fp32 operands.
_INTERPRETED = type(_shrink_kernel).__name__ == "InterpretedFunction"
