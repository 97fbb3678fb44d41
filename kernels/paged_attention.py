"""Paged attention kernels (Triton) beside their torch references.

The KV cache of one layer is two slot arrays `[num_pages * page_size, kv_heads, head_dim]`; a
sequence's context is the slots of its pages in `block_tables` order (token `j` sits in slot
`table[j // page_size] * page_size + j % page_size`). The step's own K/V are already written
there, so both kernels read every key from the cache.

- decode: one query token per sequence, its context split over `num_splits` programs per KV
  head (flash-decoding), the `heads // kv_heads` query heads of a KV head sharing each K/V load;
  a second kernel merges the splits. The grid depends only on the batch size, so a CUDA graph
  captured for one batch size replays for any context lengths, and a padded graph batch adds
  up the same splits as an eager one of its size.
- prefill / extend: a chunk of new tokens attends causally to its cached context and itself;
  one program per (query block, KV head, sequence), its tile holding the block's queries for
  every query head of that KV head; a short chunk on a long context also splits the context
  over programs and merges the splits as decode does.

An FP8 cache (torch.float8_e4m3fn) is read with per-KV-head scales, `kv_scales` [2, KVH] fp32
(`kernels.fp8_kv`): K of head h is `k_cache.float() * kv_scales[0, h]`, V likewise with row 1.
The kernels load the FP8 tiles (half of bf16's bytes), convert them to fp16 for the dots (q
too; fp32 q keeps fp32) and fold the scales in: a program's K scale into its score scale, its
V scale into the output once at the end.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.attention_configs import MERGE_WARPS, decode_config, prefill_config
from kernels.cpu_attention import CHUNK_SCORES, attend_chunk
from kernels.fp8_kv import (
    E4M3_TILE_SCALE,
    dequantize_kv,
    e4m3_keys,
    e4m3_values,
    fp8_dot_operand,
    is_fp8,
    kernel_operands,
)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
    out: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Decode attention into `out`. Triton on CUDA, the torch reference elsewhere."""
    fn = paged_decode_triton if q.is_cuda else paged_decode_torch
    fn(q, k_cache, v_cache, block_tables, seq_lens, page_size, scale, out, kv_scales)


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    page_size: int,
    scale: float,
    out: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Prefill / extend attention into `out`. Triton on CUDA, the torch reference elsewhere."""
    fn = paged_prefill_triton if q.is_cuda else paged_prefill_torch
    fn(q, k_cache, v_cache, block_tables, query_start, seq_lens, max_query_len, page_size, scale,
       out, kv_scales)


# --- torch reference / CPU path ------------------------------------------------------------


def context_slots(block_tables: torch.Tensor, page_size: int) -> torch.Tensor:
    """[S, P] page ids -> [S, P * page_size] slot ids, token order."""
    offsets = torch.arange(page_size, device=block_tables.device)
    return (block_tables.long().unsqueeze(2) * page_size + offsets).flatten(1)


def paged_decode_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
    out: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """One query per sequence against its paged context, written into `out`.

    Args:
        q: [B, H, D]; k_cache, v_cache: [num_slots, KVH, D], H a multiple of KVH.
        block_tables: [B, P] int page ids; seq_lens: [B] int context lengths (1..P * page_size).
        out: [B, H, D], every element overwritten (a strided view is fine).
        kv_scales: [2, KVH] fp32, an FP8 cache's K and V scales (read as
            `k_cache.float() * kv_scales[0, kvh]` in q's dtype); ignored for other caches.

    Semantics:
        for b in range(B):
            slots = [table[b][j // page_size] * page_size + j % page_size
                     for j in range(seq_lens[b])]
            for h in range(H):
                kvh = h // (H // KVH)
                p = softmax(scale * k_cache[slots, kvh] @ q[b, h])
                out[b, h] = p @ v_cache[slots, kvh]
    """
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    slots = context_slots(block_tables, page_size)  # (B, L)
    pad = torch.arange(slots.shape[1], device=q.device) >= seq_lens.unsqueeze(1)  # (B, L)
    # Padded positions read the row's own first slot (then get zero weight): any other slot,
    # even in the row's own last page, may hold a previous request's NaN, and 0 * NaN is NaN.
    slots = torch.where(pad, slots[:, :1], slots)
    kd, vd = k_cache[slots], v_cache[slots]  # (B, L, KVH, D)
    if is_fp8(k_cache):
        kd, vd = dequantize_kv(kd, vd, kv_scales, q.dtype)
    kd, vd = kd.permute(0, 2, 3, 1), vd.transpose(1, 2)  # (B, KVH, D, L), (B, KVH, L, D)
    bias = torch.zeros(pad.shape, dtype=q.dtype, device=q.device).masked_fill(pad, -torch.inf)
    qd = q.view(batch, kv_heads, heads // kv_heads, dim)  # (B, KVH, G, D)
    scores = torch.matmul(qd, kd) * scale + bias[:, None, None, :]  # (B, KVH, G, L)
    out.copy_(torch.matmul(torch.softmax(scores, dim=-1), vd).view(batch, heads, dim))


def paged_prefill_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    page_size: int,
    scale: float,
    out: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """New tokens attending causally to their cached context and to themselves, into `out`.

    Args:
        q: [T, H, D], sequence s's queries are rows `query_start[s]:query_start[s + 1]`.
        k_cache, v_cache: [num_slots, KVH, D]; block_tables: [S, P] int page ids.
        query_start: [S + 1] int; seq_lens: [S] int, context length including the new tokens.
        max_query_len: the longest chunk (sizes the Triton grid; unused here).
        out: [T, H, D], every element overwritten (a strided view is fine).
        kv_scales: [2, KVH] fp32, an FP8 cache's scales, as in `paged_decode_torch`.

    Semantics:
        for s in range(S):
            n, ctx = query_start[s + 1] - query_start[s], seq_lens[s]
            for i in range(n):  # query i sits at position ctx - n + i
                out[query_start[s] + i] = decode attention over the first ctx - n + i + 1
                                          tokens of sequence s
    """
    group = q.shape[1] // k_cache.shape[1]
    slots = context_slots(block_tables, page_size)
    starts, lens = query_start.tolist(), seq_lens.tolist()
    for s, ctx in enumerate(lens):
        start, end = starts[s], starts[s + 1]
        qs = q[start:end].transpose(0, 1)  # (H, n, D)
        ks, vs = k_cache[slots[s, :ctx]], v_cache[slots[s, :ctx]]  # (ctx, KVH, D)
        if is_fp8(k_cache):
            ks, vs = dequantize_kv(ks, vs, kv_scales, q.dtype)
        ks, vs = ks.transpose(0, 1), vs.transpose(0, 1)  # (KVH, ctx, D)
        mask = None  # nothing cached: plain causal
        if ctx > end - start:
            q_pos = torch.arange(ctx - (end - start), ctx, device=q.device).unsqueeze(1)
            mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= q_pos  # (n, ctx)
        if mask is not None and mask.numel() * q.shape[1] <= CHUNK_SCORES:
            out[start:end] = attend_chunk(q[start:end], ks, vs, mask, scale)
            continue
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=group > 1
        )
        out[start:end] = o.transpose(0, 1)


# --- Triton ---------------------------------------------------------------------------------

# The kernels keep scores and running maxima in base 2 (the merge too): log2(e) goes into the
# score scale.
LOG2E = tl.constexpr(1.4426950408889634)


def paged_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
    out: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
    config: tuple[int, ...] | None = None,
) -> None:
    """Same contract as `paged_decode_torch`. `config`: (BLOCK_N, num_warps, num_stages,
    waves[, registers a thread at most]) as `attention_configs.decode_config` gives it."""
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    if config is None:
        config = decode_config(batch * kv_heads, is_fp8(k_cache))
    block_n, num_warps, num_stages, waves, *max_registers = config
    launch = {"maxnreg": max_registers[0]} if max_registers else {}
    splits = num_splits(batch * kv_heads, waves, q.device)
    part_o = q.new_empty(batch, heads, splits, dim, dtype=torch.float32)
    part_ml = q.new_empty(batch, heads, splits, 2, dtype=torch.float32)  # base-2 max, sum
    if batch == 0:
        return
    common = dict(
        G=group, G_PAD=max(16, triton.next_power_of_2(group)), D=dim,
        D_PAD=max(16, triton.next_power_of_2(dim)),
    )
    k_cache, v_cache, kv_scales, s_scale, fp8 = kernel_operands(k_cache, v_cache, kv_scales)
    _decode_split_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_o, part_ml, kv_scales, s_scale, scale,
        splits, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), block_tables.stride(0),
        PAGE=page_size, BLOCK_N=block_n, UPCAST=_interpreted(), FP8=fp8,
        PRECISION=_precision(q), num_warps=num_warps, num_stages=num_stages, **launch,
        **common,
    )
    _decode_merge_kernel[(batch, heads)](
        part_o, part_ml, out, out.stride(0), out.stride(1),
        SPLITS=splits, D=dim, D_PAD=common["D_PAD"], num_warps=MERGE_WARPS,
    )


def paged_prefill_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    page_size: int,
    scale: float,
    out: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
    config: tuple[int, int, int, int, int] | None = None,
) -> None:
    """Same contract as `paged_prefill_torch`.

    A program takes `BLOCK_M` queries of one sequence with all the query heads of one KV head
    (each K/V load serves them all). Long chunks have programs to spare; a short chunk on a
    long context (a cached session's next turn) has few, so its context is split over programs
    as decode's is, and `_decode_merge_kernel` merges the splits per (token, head).
    """
    tokens, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or max_query_len == 0:
        return
    group = heads // kv_heads
    g_pad = triton.next_power_of_2(group)
    if config is None:
        config = prefill_config(max_query_len * g_pad, is_fp8(k_cache))
    block_m, block_n, num_warps, num_stages, waves = config
    block_m = max(1, block_m // g_pad)  # queries per program: BLOCK_M x G_PAD tile rows
    q_blocks = triton.cdiv(max_query_len, block_m)
    splits = num_splits(q_blocks * kv_heads * num_seqs, waves, q.device)
    part_o = part_ml = out  # unused without splits
    if splits > 1:
        part_o = q.new_empty(tokens, heads, splits, dim, dtype=torch.float32)
        part_ml = q.new_empty(tokens, heads, splits, 2, dtype=torch.float32)
    d_pad = max(16, triton.next_power_of_2(dim))
    k_cache, v_cache, kv_scales, s_scale, fp8 = kernel_operands(k_cache, v_cache, kv_scales)
    _prefill_kernel[(q_blocks, kv_heads, num_seqs * splits)](
        q, k_cache, v_cache, block_tables, query_start, seq_lens, out, part_o, part_ml, kv_scales,
        s_scale, scale, splits, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        G=group, G_PAD=g_pad, D=dim, D_PAD=d_pad, PAGE=page_size, BLOCK_M=block_m,
        BLOCK_N=block_n, SPLIT=splits > 1, UPCAST=_interpreted(), FP8=fp8,
        PRECISION=_precision(q), num_warps=num_warps, num_stages=num_stages,
    )
    if splits > 1:
        _decode_merge_kernel[(tokens, heads)](
            part_o, part_ml, out, out.stride(0), out.stride(1),
            SPLITS=splits, D=dim, D_PAD=d_pad, num_warps=MERGE_WARPS,
        )


def num_splits(programs: int, waves: int, device: torch.device) -> int:
    """Splits per (sequence, KV head): enough programs for `waves` waves over the device, a
    power of two, at most 64. Splits past a short context's end return at once."""
    target = waves * _num_sms(device)
    return triton.next_power_of_2(max(1, min(-(-target // programs), 64)))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, so the merge is exercised
    return torch.cuda.get_device_properties(device).multi_processor_count


def _precision(q: torch.Tensor) -> str:
    return "ieee" if q.dtype == torch.float32 else "tf32"


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, part_o_ptr, part_ml_ptr, kvs_ptr, s_kvs, scale,
    splits, s_q_b, s_q_h, s_k_slot, s_k_h, s_v_slot, s_v_h, s_t_b,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, FP8: tl.constexpr, PRECISION: tl.constexpr,
):
    # One program: one sequence x one KV head (its G query heads) x one split of the context.
    # FP8: k_ptr, v_ptr hold E4M3 bytes; the K scales at kvs_ptr, V's s_kvs further.
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq_len)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    g_ok, d_ok = g < G, d < D
    heads = kvh * G + g
    q = tl.load(
        q_ptr + b * s_q_b + heads[:, None] * s_q_h + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :], other=0.0,
    )  # (G_PAD, D_PAD)
    if FP8:
        q = fp8_dot_operand(q)
        scale = scale * tl.load(kvs_ptr + kvh)
    if UPCAST:
        q = q.to(tl.float32)
    scale = scale * LOG2E
    m = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_sum = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D_PAD), tl.float32)
    table = tables_ptr + b.to(tl.int64) * s_t_b
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        ok = pos < hi
        page = tl.load(table + pos // PAGE, mask=ok, other=0).to(tl.int64)
        slot = page * PAGE + pos % PAGE
        kv_mask = ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + slot[:, None] * s_k_slot + kvh * s_k_h + d[None, :],
                    mask=kv_mask, other=0.0)  # (BLOCK_N, D_PAD)
        v = tl.load(v_ptr + slot[:, None] * s_v_slot + kvh * s_v_h + d[None, :],
                    mask=kv_mask, other=0.0)
        if FP8:
            k, v = e4m3_keys(k, UPCAST).to(q.dtype), e4m3_values(v, UPCAST).to(q.dtype)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (G_PAD, BLOCK_N)
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    if FP8:
        acc = acc * (tl.load(kvs_ptr + s_kvs + kvh) * E4M3_TILE_SCALE)
    # Partials of an empty split: m = -inf, l = 0, acc = 0; the merge gives them weight 0.
    row = (b * (G * tl.num_programs(1)) + heads) * splits + split  # (G_PAD,) in [B, H, splits]
    tl.store(part_o_ptr + row[:, None] * D + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
    tl.store(part_ml_ptr + row * 2, m, mask=g_ok)
    tl.store(part_ml_ptr + row * 2 + 1, l_sum, mask=g_ok)


@triton.jit
def _decode_merge_kernel(
    part_o_ptr, part_ml_ptr, out_ptr, s_o_b, s_o_h,
    SPLITS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
):
    # One program: one (sequence, head); log-sum-exp merge of its splits (maxima in base 2).
    b, h = tl.program_id(0), tl.program_id(1)
    row = (b * tl.num_programs(1) + h) * SPLITS + tl.arange(0, SPLITS)
    d = tl.arange(0, D_PAD)
    m = tl.load(part_ml_ptr + row * 2)
    l_sum = tl.load(part_ml_ptr + row * 2 + 1)
    o = tl.load(part_o_ptr + row[:, None] * D + d[None, :], mask=(d < D)[None, :], other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)  # (SPLITS,)
    acc = tl.sum(o * w[:, None], axis=0) / tl.sum(l_sum * w, axis=0)
    tl.store(out_ptr + b * s_o_b + h * s_o_h + d, acc.to(out_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, qstart_ptr, lens_ptr, out_ptr, part_o_ptr, part_ml_ptr,
    kvs_ptr, s_kvs, scale, splits, s_q_t, s_q_h, s_k_slot, s_k_h, s_v_slot, s_v_h, s_t_b, s_o_t,
    s_o_h, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    UPCAST: tl.constexpr, FP8: tl.constexpr, PRECISION: tl.constexpr,
):
    # One program: BLOCK_M queries x the G query heads of one KV head, of one sequence, over
    # one split of the keys they see (flash attention, causal). Tile row r is query
    # r // G_PAD, head r % G_PAD of the group. FP8: as in `_decode_split_kernel`.
    pid_m, kvh, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    s, split = pid_s // splits, pid_s % splits
    q0 = tl.load(qstart_ptr + s)
    num_q = tl.load(qstart_ptr + s + 1) - q0
    if pid_m * BLOCK_M >= num_q:
        return
    ctx = tl.load(lens_ptr + s)
    r = tl.arange(0, BLOCK_M * G_PAD)
    query = pid_m * BLOCK_M + r // G_PAD
    head = kvh * G + r % G_PAD
    row_ok = (query < num_q) & (r % G_PAD < G)
    q_pos = ctx - num_q + query  # absolute positions
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    q = tl.load(q_ptr + (q0 + query)[:, None] * s_q_t + head[:, None] * s_q_h + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M * G_PAD, D_PAD)
    if FP8:
        q = fp8_dot_operand(q)
        scale = scale * tl.load(kvs_ptr + kvh)
    if UPCAST:
        q = q.to(tl.float32)
    scale = scale * LOG2E
    m = tl.full((BLOCK_M * G_PAD,), float("-inf"), tl.float32)
    l_sum = tl.zeros((BLOCK_M * G_PAD,), tl.float32)
    acc = tl.zeros((BLOCK_M * G_PAD, D_PAD), tl.float32)
    table = tables_ptr + s.to(tl.int64) * s_t_b
    # Keys the block sees end past its last query; this split takes one chunk of them.
    seen = tl.minimum(ctx, ctx - num_q + (pid_m + 1) * BLOCK_M)
    chunk = tl.cdiv(tl.cdiv(seen, splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seen)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        ok = pos < hi
        page = tl.load(table + pos // PAGE, mask=ok, other=0).to(tl.int64)
        slot = page * PAGE + pos % PAGE
        kv_mask = ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + slot[:, None] * s_k_slot + kvh * s_k_h + d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + slot[:, None] * s_v_slot + kvh * s_v_h + d[None, :],
                    mask=kv_mask, other=0.0)
        if FP8:
            k, v = e4m3_keys(k, UPCAST).to(q.dtype), e4m3_values(v, UPCAST).to(q.dtype)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        sc = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (rows, BLOCK_N)
        sc = tl.where(ok[None, :] & (pos[None, :] <= q_pos[:, None]), sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=1))
        # A row may see none of a split's first keys (causal): keep its max finite.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(sc - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    if FP8:
        acc = acc * (tl.load(kvs_ptr + s_kvs + kvh) * E4M3_TILE_SCALE)
    if SPLIT:  # partials [T, H, splits, D] and (max, sum); key 0 is in split 0, so l > 0
        row = ((q0 + query) * (G * tl.num_programs(1)) + head) * splits + split
        tl.store(part_o_ptr + row[:, None] * D + d[None, :], acc,
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(part_ml_ptr + row * 2, m, mask=row_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_sum, mask=row_ok)
    else:
        acc = acc / l_sum[:, None]
        tl.store(out_ptr + (q0 + query)[:, None] * s_o_t + head[:, None] * s_o_h + d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _interpreted() -> bool:
    """Triton's interpreter multiplies bf16 tiles in `tl.dot` as raw bits (see kernels.sgmv):
    upcast there. On the GPU the dots take bf16 tiles and accumulate in fp32."""
    return type(_prefill_kernel).__name__ == "InterpretedFunction"
