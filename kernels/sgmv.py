"""SGMV: segmented gather matrix-vector products for multi-LoRA prefill (punica's design).

Tokens of a step come in contiguous segments; every token of a segment uses the same adapter
slot (`-1` = no adapter: its rows are left untouched). Adapter weights live in one pool per
projection, each adapter at its own rank (S-LoRA style), so one launch serves every adapter of
the batch (`spec/pool_layout.md`):

    a_pool: [U, S, K]     U rank rows; S slices of a fused projection; K in_features
    b_pool: [U, N]        lora_B transposed, fused slices' columns side by side
    starts, ranks: [num_slots] int32, the adapter of slot s owns rows `starts[s] :
                   starts[s] + ranks[s]` (rank 0 = empty slot)

so slice j of that adapter is `A_j = a_pool[u : u + r, j]` ([r, K]) and its B rows are
`b_pool[u : u + r]`. Kernels mask the rank axis at `ranks[slot]`: they never read the pool rows
of other adapters (or free rows holding anything), and bandwidth follows each adapter's own
rank. The shrink output `t` is `[T, S * R]` for the launch's `max_rank` R (column `j * R + i`
is `(A_j @ x)_i`, zero at `i >= r` and on base rows), which keeps it a dense, shape-static
tensor (one compile, CUDA-graph friendly).

Fused projections (`qkv_proj` columns `[q|k|v]`, `gate_up_proj` columns `[gate|up]`): one shrink
gives `t` for all slices, then each slice's `R` columns of `t` expand into its output columns
with `slice_offset` and a column view of `b_pool` (see `lora.batch.lora_expand_slices`).

Shrink and expand are the same product `out[rows] (+)= scale * in[rows] @ W^T` with the rank
axis on W's rows (shrink) or columns (expand), so one Triton kernel serves both. The torch path
(CPU) is one matmul per segment and slice, at the adapter's rank.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl


def sgmv_shrink(
    x: torch.Tensor,
    a_pool: torch.Tensor,
    starts: torch.Tensor,
    ranks: torch.Tensor,
    max_rank: int,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
) -> torch.Tensor:
    """t = x @ A[slot]^T per segment. Triton on CUDA, grouped torch matmuls elsewhere."""
    fn = sgmv_shrink_triton if x.is_cuda else sgmv_shrink_torch
    return fn(x, a_pool, starts, ranks, max_rank, seg_indptr, seg_slots, max_seg_len)


def sgmv_expand_slices(
    y: torch.Tensor,
    t: torch.Tensor,
    b_pool: torch.Tensor,
    sizes: Sequence[int],
    starts: torch.Tensor,
    ranks: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    scales: torch.Tensor,
    max_seg_len: int,
) -> None:
    """Every slice of a fused projection: `sgmv_expand_slices_torch` has the contract; on CUDA
    one launch for all slices."""
    if y.is_cuda:
        sgmv_expand_slices_triton(y, t, b_pool, sizes, starts, ranks, seg_indptr, seg_slots,
                                  scales, max_seg_len)
    else:
        sgmv_expand_slices_torch(y, t, b_pool, sizes, starts, ranks, seg_indptr, seg_slots,
                                 scales)


# --- torch reference / CPU path ------------------------------------------------------------


def sgmv_shrink_torch(
    x: torch.Tensor,
    a_pool: torch.Tensor,
    starts: torch.Tensor,
    ranks: torch.Tensor,
    max_rank: int,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
) -> torch.Tensor:
    """Shrink every segment with its adapter's A, slice by slice.

    Args:
        x: [T, K] activations; a_pool: [U, S, K].
        starts, ranks: [num_slots] int, each slot's first pool row and rank (0 = empty).
        max_rank: R, the width of each slice's columns in t (>= every rank).
        seg_indptr: [num_segments + 1] int, segment g is tokens `seg_indptr[g]:seg_indptr[g + 1]`.
        seg_slots: [num_segments] int, adapter slot of each segment, -1 = none.
        max_seg_len: longest segment (sizes the Triton grid; unused here).
    Returns:
        t: [T, S * R], zero at columns `j * R + i` with i >= rank and on rows without an adapter.

    Semantics:
        t = zeros(T, S * R)
        for g in range(num_segments):
            slot = seg_slots[g]
            if slot >= 0:
                u, r = starts[slot], ranks[slot]
                for tok in range(seg_indptr[g], seg_indptr[g + 1]):
                    for j in range(S):
                        t[tok, j * R : j * R + r] = a_pool[u : u + r, j] @ x[tok]
    """
    t = x.new_zeros(x.shape[0], a_pool.shape[1] * max_rank)  # (num_tokens, slices * R)
    bounds, start_of, rank_of = seg_indptr.tolist(), starts.tolist(), ranks.tolist()
    for g, slot in enumerate(seg_slots.tolist()):
        lo, hi = bounds[g], bounds[g + 1]
        if slot < 0 or hi == lo or rank_of[slot] == 0:
            continue
        u, r = start_of[slot], rank_of[slot]
        shrink_rows(t[lo:hi], x[lo:hi], a_pool[u : u + r], max_rank)
    return t


def shrink_rows(t: torch.Tensor, x: torch.Tensor, a: torch.Tensor, max_rank: int) -> None:
    """t[:, j * R : j * R + r] = x @ a[:, j].T for every slice j, in one matmul.

    Args:
        t: [n, S * R] rows of the shrink output; x: [n, K]; a: [r, S, K] one adapter's rows.
    """
    r, num_slices, k = a.shape
    if r == 0:
        return
    out = (x @ a.reshape(r * num_slices, k).t()).view(-1, r, num_slices)  # [n, i, j]
    t.view(t.shape[0], num_slices, max_rank)[:, :, :r] = out.transpose(1, 2)


def sgmv_expand_torch(
    y: torch.Tensor,
    t: torch.Tensor,
    b_pool: torch.Tensor,
    starts: torch.Tensor,
    ranks: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    scales: torch.Tensor,
    max_seg_len: int,
    slice_offset: int = 0,
) -> None:
    """Expand every segment with its adapter's B, added into a column slice of y.

    Args:
        y: [T, N_total], updated in place in columns `slice_offset : slice_offset + N`.
        t: [T, >= max rank], one slice's columns of a shrink output (a column view is fine);
            only its first `rank` columns are read for each segment.
        b_pool: [U, N], one slice's columns of the pool (a column view of a fused pool is fine).
        starts, ranks: [num_slots] int; scales: [num_slots] float, each adapter's scaling.
        seg_indptr, seg_slots, max_seg_len: as in `sgmv_shrink_torch`.

    Semantics:
        for g in range(num_segments):
            slot = seg_slots[g]
            if slot >= 0:
                u, r = starts[slot], ranks[slot]
                for tok in range(seg_indptr[g], seg_indptr[g + 1]):
                    y[tok, slice_offset : slice_offset + N] += (
                        scales[slot] * (t[tok, :r] @ b_pool[u : u + r]))
    """
    out = y.narrow(1, slice_offset, b_pool.shape[1])  # (num_tokens, N) view
    bounds, start_of, rank_of = seg_indptr.tolist(), starts.tolist(), ranks.tolist()
    scale_of = scales.tolist()
    for g, slot in enumerate(seg_slots.tolist()):
        lo, hi = bounds[g], bounds[g + 1]
        if slot < 0 or hi == lo or rank_of[slot] == 0:
            continue
        u, r = start_of[slot], rank_of[slot]
        out[lo:hi].addmm_(t[lo:hi, :r], b_pool[u : u + r], alpha=scale_of[slot])


def sgmv_expand_slices_torch(
    y: torch.Tensor,
    t: torch.Tensor,
    b_pool: torch.Tensor,
    sizes: Sequence[int],
    starts: torch.Tensor,
    ranks: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    scales: torch.Tensor,
) -> None:
    """`sgmv_expand_torch` of every slice of a fused projection in one pass over the segments:
    slice j reads `t[:, j * R : j * R + rank]` and adds into columns `sum(sizes[:j]) :` of y.

    Args:
        y: [T, sum(sizes)]; t: [T, len(sizes) * R]; b_pool: [U, sum(sizes)].
    """
    max_rank, bounds = t.shape[1] // len(sizes), [0, *itertools.accumulate(sizes)]
    ends, start_of, rank_of = seg_indptr.tolist(), starts.tolist(), ranks.tolist()
    scale_of = scales.tolist()
    for g, slot in enumerate(seg_slots.tolist()):
        lo, hi = ends[g], ends[g + 1]
        if slot < 0 or hi == lo or rank_of[slot] == 0:
            continue
        u, r = start_of[slot], rank_of[slot]
        for j in range(len(sizes)):
            c0, c1 = bounds[j], bounds[j + 1]
            y[lo:hi, c0:c1].addmm_(t[lo:hi, j * max_rank : j * max_rank + r],
                                   b_pool[u : u + r, c0:c1], alpha=scale_of[slot])


# --- Triton ---------------------------------------------------------------------------------


def sgmv_shrink_triton(
    x: torch.Tensor,
    a_pool: torch.Tensor,
    starts: torch.Tensor,
    ranks: torch.Tensor,
    max_rank: int,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
) -> torch.Tensor:
    """Same contract as `sgmv_shrink_torch`."""
    t = x.new_zeros(x.shape[0], a_pool.shape[1] * max_rank)  # (num_tokens, slices * R)
    blocks = _blocks(_SHRINK_BLOCKS, max_seg_len)
    _launch(x, a_pool, t, starts, ranks, max_rank, seg_indptr, seg_slots, None, max_seg_len,
            [t.shape[1]], blocks)
    return t


def sgmv_expand_triton(
    y: torch.Tensor,
    t: torch.Tensor,
    b_pool: torch.Tensor,
    starts: torch.Tensor,
    ranks: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    scales: torch.Tensor,
    max_seg_len: int,
    slice_offset: int = 0,
) -> None:
    """Same contract as `sgmv_expand_torch`."""
    out = y.narrow(1, slice_offset, b_pool.shape[1])  # (num_tokens, N) view
    _launch(t, b_pool, out, starts, ranks, t.shape[1], seg_indptr, seg_slots, scales,
            max_seg_len, [b_pool.shape[1]], _blocks(_EXPAND_BLOCKS, max_seg_len))


def sgmv_expand_slices_triton(
    y: torch.Tensor,
    t: torch.Tensor,
    b_pool: torch.Tensor,
    sizes: Sequence[int],
    starts: torch.Tensor,
    ranks: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    scales: torch.Tensor,
    max_seg_len: int,
) -> None:
    """Same contract as `sgmv_expand_slices_torch`, in one launch: a program's column tile lies
    in one slice (slice j's tiles follow slice j - 1's), so the small [k|v] slices share the
    grid with the large ones instead of each filling a launch of its own."""
    _launch(t, b_pool, y, starts, ranks, t.shape[1] // len(sizes), seg_indptr, seg_slots,
            scales, max_seg_len, list(sizes), _blocks(_EXPAND_BLOCKS, max_seg_len))


def _launch(
    inp: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    starts: torch.Tensor,
    ranks: torch.Tensor,
    max_rank: int,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    scales: torch.Tensor | None,
    max_seg_len: int,
    sizes: list[int],
    blocks: tuple[int, int, int, int],
) -> None:
    """out[rows] (+)= scale * inp[rows] @ W[slot]^T for every segment; out: [T, N] (strided
    views allowed).

    Without scales (shrink): w is a_pool [U, S, K], inp [T, K], N = S * R (`sizes` = [N]) and
    W[slot][n, k] = w[u + n % R, n // R, k], masked at n % R >= rank. With scales (expand):
    w is b_pool [U, N] (a column view is fine), out's columns are slices of `sizes` side by
    side (N = sum(sizes)), inp holds R columns per slice, and slice j's columns read
    W[slot][n, k] = w[u + k, n] against inp's columns j * R + k, masked at k >= rank."""
    block_m, block_n, block_k, num_stages = blocks
    num_segments, n = seg_slots.shape[0], out.shape[1]
    if num_segments == 0 or max_seg_len == 0 or n == 0:
        return
    shrink = scales is None
    k = inp.shape[1] if shrink else max_rank
    # (rank row, slice or output column, k) strides of w
    w_strides = (w.stride(0), w.stride(1), w.stride(2) if shrink else w.stride(0))
    block_n = min(block_n, max(16, triton.next_power_of_2(max(sizes))))
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    if inp.is_cuda:  # as many pipeline stages as shared memory holds (fp32 tiles are twice bf16's)
        stage = (block_m * block_k + block_k * block_n) * max(inp.element_size(), w.element_size())
        num_stages = max(1, min(num_stages, _shared_memory(inp.device.index) // stage))
    # Column tiles slice by slice: slice j has tiles `ends[j - 1]:ends[j]` and columns
    # `bounds[j - 1]:bounds[j]` (from 0 for j = 0).
    assert 1 <= len(sizes) <= 3, "up to three slices ([q|k|v]) in one launch"
    ends = list(itertools.accumulate(triton.cdiv(size, block_n) for size in sizes))
    bounds = list(itertools.accumulate(sizes))
    pad = [0] * (3 - len(sizes))
    grid = (triton.cdiv(max_seg_len, block_m), ends[-1], num_segments)
    _sgmv_kernel[grid](
        inp,
        w,
        out,
        seg_indptr,
        seg_slots,
        starts,
        ranks,
        scales if scales is not None else inp,
        *(ends + pad)[:2],
        *(bounds + pad),
        k,
        max_rank,
        inp.stride(0),
        inp.stride(1),
        *w_strides,
        out.stride(0),
        out.stride(1),
        SHRINK=shrink,
        SLICES=len(sizes),
        PRECISION="ieee" if inp.dtype == torch.float32 else "tf32",
        UPCAST=_INTERPRETED,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_stages=num_stages,
    )


def _blocks(blocks: dict[str, tuple[int, int, int, int]],
            max_seg_len: int) -> tuple[int, int, int, int]:
    """The block config for segments of up to `max_seg_len` rows: prefill's for long ones."""
    return blocks["prefill" if max_seg_len >= PREFILL_ROWS else "short"]


@functools.cache
def _shared_memory(device: int | None) -> int:
    """Bytes of shared memory one program may use on this GPU."""
    index = torch.cuda.current_device() if device is None else device
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages) for short segments (decode-sized: an eager step of
# decodes ordered by adapter, small chunks) and for prefill (segments of PREFILL_ROWS rows or
# more). Short: from a sweep on an H100 (bf16, H=4096, out=6144, r=16, padded slot stacks).
# Prefill: `benchmarks/lora_prefill.py --sweep` on an H200 (Llama-3-8B shapes, 8,192 tokens in
# four segments, rank 16 in a pool of max rank 128): the shrink over the four projections took
# 43 / 32 / 40 / 72 us instead of 152 / 58 / 104 / 158 with the short config (wider row tiles
# read each weight tile for four times the rows), the expand 108 / 45 / 282 / 46 instead of
# 183 / 51 / 322 / 55 (qkv / o / gate_up / down).
PREFILL_ROWS = 64
_SHRINK_BLOCKS = {"short": (16, 64, 256, 4), "prefill": (64, 32, 128, 3)}
_EXPAND_BLOCKS = {"short": (64, 64, 16, 2), "prefill": (32, 128, 16, 2)}


@triton.jit
def _sgmv_kernel(
    in_ptr,
    w_ptr,
    out_ptr,
    indptr_ptr,
    slots_ptr,
    starts_ptr,
    ranks_ptr,
    scales_ptr,
    T1,
    T2,
    C1,
    C2,
    C3,
    K,
    R,
    s_in_t,
    s_in_k,
    s_w_u,
    s_w_n,
    s_w_k,
    s_out_t,
    s_out_n,
    SHRINK: tl.constexpr,
    SLICES: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # One program: BLOCK_M rows of one segment x BLOCK_N output columns of one slice j, which
    # has columns col0:N and column tiles first:T(j+1) (T1, T2: the tiles of slices 0, 0-1;
    # C1, C2, C3: the columns of slices 0, 0-1, 0-2).
    pid_m, pid_n, seg = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    j, first, col0, N = 0, 0, 0, C1
    if SLICES > 1:
        later = pid_n >= T1
        j, first = tl.where(later, 1, j), tl.where(later, T1, first)
        col0, N = tl.where(later, C1, col0), tl.where(later, C2, N)
    if SLICES > 2:
        later = pid_n >= T2
        j, first = tl.where(later, 2, j), tl.where(later, T2, first)
        col0, N = tl.where(later, C2, col0), tl.where(later, C3, N)
    slot = tl.load(slots_ptr + seg)
    start = tl.load(indptr_ptr + seg)
    end = tl.load(indptr_ptr + seg + 1)
    row0 = start + pid_m * BLOCK_M
    if (slot < 0) | (row0 >= end):
        return
    rank = tl.load(ranks_ptr + slot)  # loaded together with its rows' start
    w_base = w_ptr + tl.load(starts_ptr + slot).to(tl.int64) * s_w_u
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + (pid_n - first) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < end
    if SHRINK:  # column n = j * R + i is row i of slice j of A; t is 0 at i >= rank already
        i = cols % R
        col_ok = (cols < N) & (i < rank)
        w_cols = i * s_w_u + (cols // R) * s_w_n
        k_end = K
        # no live column if neither the tile's first one nor the next slice's i = 0 is
        n0 = col0 + (pid_n - first) * BLOCK_N
        n1 = n0 - n0 % R + R
        dead = (rank == 0) | ((n0 % R >= rank) & ((n1 >= n0 + BLOCK_N) | (n1 >= N)))
    else:  # k = i is row i of B: read only the adapter's rank entries of t and rows of B
        col_ok = cols < N
        in_ptr += j * R * s_in_k  # slice j's columns of t
        w_cols = cols * s_w_n
        k_end = rank
        dead = rank == 0
    if dead:
        return  # no weight of this adapter in the tile
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        k_ok = (k0 + ks) < k_end
        a = tl.load(
            in_ptr + rows[:, None] * s_in_t + (k0 + ks)[None, :] * s_in_k,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # (BLOCK_M, BLOCK_K)
        b = tl.load(
            w_base + w_cols[None, :] + (k0 + ks)[:, None] * s_w_k,
            mask=col_ok[None, :] & k_ok[:, None],
            other=0.0,
        )  # (BLOCK_K, BLOCK_N): W[slot]^T tile
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=PRECISION)
    out_ptrs = out_ptr + rows[:, None] * s_out_t + cols[None, :] * s_out_n
    mask = row_ok[:, None] & col_ok[None, :]
    if not SHRINK:
        scale = tl.load(scales_ptr + slot)
        acc = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32) + acc * scale
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# Triton 3.9's interpreter multiplies bf16 tiles in `tl.dot` as their raw uint16 bits, so under
# TRITON_INTERPRET the tiles are upcast first. bf16 x bf16 products are exact in fp32, so this
# matches a tensor-core dot with fp32 accumulation.
_INTERPRETED = type(_sgmv_kernel).__name__ == "InterpretedFunction"
