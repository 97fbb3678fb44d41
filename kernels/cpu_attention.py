"""Decode attention on CPUs: each step's contexts gathered by a plan built once for all layers.

`paged_decode_torch` (kernels/paged_attention.py) states what decode attention computes; this is
the path CPU engines take, the same numbers (up to summation order) at a fraction of the cost.
On a 2-core EPYC with SmolLM2's 30 layers, 24 decodes of 56-484 tokens: 70-85 ms a step
against 250-400 ms (`benchmarks/results/offline_throughput_cpu.md`). What it saves:

- The slots, the padding mask and the gather indices are built once per step (`DecodePlan`),
  not once per layer.
- Rows are grouped by context length (sorted; the cuts minimise gathered slots plus a fixed
  cost per group), so a short row is not padded to the longest row's width.
- Each group's K and V are gathered straight into `[rows, kv_heads, width, head_dim]` (one
  `index_select` over `[slots * kv_heads, head_dim]` rows), the layout both batched products
  read without a copy.
- The gathers write into two buffers the plan allocates once and every layer reuses: a fresh
  multi-megabyte tensor per layer is an mmap and its page faults in glibc's allocator, which
  cost more than the attention itself.

An FP8 cache (`kernels.fp8_kv`) is gathered as bytes into buffers of its own and widened into
the compute dtype's; its K scales multiply the queries and its V scales the output, one per KV
head, instead of every gathered value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.fp8_kv import FP8_KV

# The fixed cost of one more group, in gathered slots (its dozen small ops against the memory
# traffic of a slot's K and V): the cut point of `_groups`.
GROUP_COST = 512


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # (n,) int64: the batch rows in this group
    index: torch.Tensor  # (n * kv_heads * width,) int64: rows of a `[slots * kv_heads, D]` view
    bias: torch.Tensor  # (n, 1, 1, width): 0, or -inf past the row's context
    width: int  # slots per row, a multiple of the page size


class DecodePlan:
    """What every layer of one decode step gathers (the step's tables and lengths are shared by
    the layers), and the buffers the gathers write into."""

    def __init__(
        self,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        cache_dtype: torch.dtype | None = None,
    ):
        """`dtype` is the computation's (q's and out's); `cache_dtype` the cache's, when it
        differs (an FP8 cache)."""
        lens = seq_lens.tolist()
        order = sorted(range(len(lens)), key=lens.__getitem__)
        heads = torch.arange(kv_heads).view(1, kv_heads, 1)
        self.groups: list[DecodeGroup] = []
        for a, b in _groups([lens[i] for i in order], page_size):
            rows = torch.tensor(order[a:b])
            width = -(-lens[order[b - 1]] // page_size) * page_size
            tables = block_tables[rows, : width // page_size].long()
            slots = (tables.unsqueeze(2) * page_size + torch.arange(page_size)).flatten(1)
            pad = torch.arange(width) >= seq_lens[rows].unsqueeze(1)
            # Padded positions read the row's own first slot (and get zero weight): any other
            # slot may hold a previous request's NaN, and 0 * NaN is NaN.
            slots = torch.where(pad, slots[:, :1], slots)
            index = (slots.unsqueeze(1) * kv_heads + heads).flatten()
            bias = torch.zeros(pad.shape, dtype=dtype).masked_fill_(pad, float("-inf"))
            self.groups.append(DecodeGroup(rows, index, bias.view(len(rows), 1, 1, width),
                                           width))
        most = max((g.index.numel() for g in self.groups), default=0)
        self.k_buf = torch.empty(most, head_dim, dtype=dtype)
        self.v_buf = torch.empty(most, head_dim, dtype=dtype)
        self.fp8 = cache_dtype == FP8_KV
        self.k8_buf = self.v8_buf = None  # an FP8 cache's gathered bytes
        if self.fp8:
            self.k8_buf = torch.empty(most, head_dim, dtype=torch.uint8)
            self.v8_buf = torch.empty(most, head_dim, dtype=torch.uint8)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        """`paged_decode_torch`'s contract, for the tables and lengths the plan was built on
        (kv_scales: an FP8 cache's [2, KVH] K and V scales)."""
        heads, dim = q.shape[1], q.shape[2]
        kv_heads = k_cache.shape[1]
        fp8 = k_cache.dtype == FP8_KV
        assert fp8 == self.fp8, "the plan was built for another cache dtype"
        if fp8:
            assert kv_scales is not None, "an FP8 KV cache needs kv_scales"
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
            k_scale, v_scale = (s.view(1, kv_heads, 1, 1).to(q.dtype) for s in kv_scales)
        k_rows, v_rows = k_cache.view(-1, dim), v_cache.view(-1, dim)
        for g in self.groups:
            n, size = len(g.rows), g.index.numel()
            if fp8:
                assert self.k8_buf is not None and self.v8_buf is not None
                k8 = torch.index_select(k_rows, 0, g.index, out=self.k8_buf[:size])
                v8 = torch.index_select(v_rows, 0, g.index, out=self.v8_buf[:size])
                k = self.k_buf[:size].copy_(k8.view(FP8_KV))
                v = self.v_buf[:size].copy_(v8.view(FP8_KV))
            else:
                k = torch.index_select(k_rows, 0, g.index, out=self.k_buf[:size])
                v = torch.index_select(v_rows, 0, g.index, out=self.v_buf[:size])
            k, v = (t.view(n, kv_heads, g.width, dim) for t in (k, v))
            qg = q.index_select(0, g.rows).view(n, kv_heads, heads // kv_heads, dim)
            if fp8:
                qg = qg * k_scale
            scores = torch.matmul(qg, k.transpose(2, 3)).mul_(scale).add_(g.bias)
            o = torch.matmul(torch.softmax(scores, dim=-1), v)  # (n, kv_heads, group, dim)
            if fp8:
                o = o.mul_(v_scale)
            out.index_copy_(0, g.rows, o.view(n, heads, dim))


def _groups(lens: list[int], page_size: int) -> list[tuple[int, int]]:
    """Cut ascending context lengths into runs [a, b) that minimise the slots gathered (each
    run is as wide as its longest row, in whole pages) plus `GROUP_COST` per run."""
    widths = [-(-n // page_size) * page_size for n in lens]
    best = [0] + [0] * len(lens)  # best[j]: the cost of the first j rows
    cut = [0] * (len(lens) + 1)
    for j in range(1, len(lens) + 1):
        width = widths[j - 1]
        best[j], cut[j] = min((best[i] + (j - i) * width + GROUP_COST, i) for i in range(j))
    runs, j = [], len(lens)
    while j:
        runs.append((cut[j], j))
        j = cut[j]
    return runs[::-1]


# A chunk over a cached context whose scores (queries x heads x context) fit this many fp32
# values takes `attend_chunk` (64 MB); larger ones SDPA.
CHUNK_SCORES = 1 << 24


def attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """One sequence's chunk of queries over its context: q [n, H, D], k, v [KVH, ctx, D],
    mask [n, ctx] (True: attended) -> [n, H, D]. The query heads of a KV head are one matrix
    against that head's K and V. (SDPA with an explicit mask and grouped heads takes its
    unfused CPU path, which copies K and V for every query head: 2-3x slower for a verify
    step's 5 queries over 1.5k tokens of SmolLM2, and for up to 256 queries.)"""
    n, heads, dim = q.shape
    kv_heads = k.shape[0]
    group = heads // kv_heads
    qg = q.view(n, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, group * n, dim)
    scores = torch.matmul(qg, k.transpose(1, 2)).mul_(scale)  # (KVH, G * n, ctx)
    scores.masked_fill_(~mask.repeat(group, 1), float("-inf"))  # row g * n + i: query i
    o = torch.matmul(torch.softmax(scores, dim=-1), v)  # (KVH, G * n, D)
    return o.view(kv_heads, group, n, dim).permute(2, 0, 1, 3).reshape(n, heads, dim)

