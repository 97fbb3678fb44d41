"""Paged attention over a mixed batch of decodes and prefill chunks: the model's one call.

The KV cache of one layer is two tensors of slots, `[num_pages * page_size, kv_heads, head_dim]`;
a page is `page_size` consecutive slots. Tokens in a step are laid out decodes first (one query
token each), then prefill chunks. The kernels (`kernels.paged_attention`) are Triton on CUDA
and torch on CPU (decode through `kernels.cpu_attention`); both read the metadata below.
An FP8 cache (torch.float8_e4m3fn) comes with its per-KV-head scales (`kernels.fp8_kv`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.cpu_attention import DecodePlan
from kernels.paged_attention import paged_decode, paged_prefill


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner; shared by every layer."""

    slot_mapping: torch.Tensor  # [T] int64, where each new token's K/V is written
    page_size: int
    num_decodes: int  # the first `num_decodes` tokens are decodes, one per sequence
    decode_tables: torch.Tensor  # [num_decodes, P] int32 page ids
    decode_lens: torch.Tensor  # [num_decodes] int32 context lengths, this step's token included
    prefill_tables: torch.Tensor  # [S, P] int32, one row per prefill chunk
    prefill_query_start: torch.Tensor  # [S + 1] int32, token offsets after the decodes
    prefill_lens: torch.Tensor  # [S] int32 context lengths, the chunk included
    max_prefill_len: int  # longest chunk (0: no prefill)
    # The CPU decode path's gathers, built by the step's first layer for all of them.
    _cpu_plan: DecodePlan | None = field(default=None, init=False, repr=False, compare=False)

    def cpu_decode_plan(self, k_cache: torch.Tensor, dtype: torch.dtype | None = None
                        ) -> DecodePlan:
        """The step's plan, built on the first call; `dtype` is q's (default: the cache's)."""
        if self._cpu_plan is None:
            self._cpu_plan = DecodePlan(self.decode_tables, self.decode_lens, self.page_size,
                                        k_cache.shape[1], k_cache.shape[2],
                                        dtype or k_cache.dtype, k_cache.dtype)
        return self._cpu_plan


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attend; this step's K/V are in the cache already (`kernels.fused.rope_cache` writes
    them at `meta.slot_mapping`).

    Args:
        q: [T, H, D] for the step's new tokens.
        k_cache, v_cache: [S, KVH, D] slot arrays of this layer.
        out: [T, H, D] to write into (default: a new tensor).
        kv_scales: [2, KVH] fp32 on the cache's device, an FP8 cache's scales: K of KV head
            h is read as `k_cache.float() * kv_scales[0, h]`, V with row 1. Ignored for
            caches of other dtypes.
    Returns:
        [T, H, D]: `out`
    """
    out = torch.empty_like(q) if out is None else out
    nd = meta.num_decodes
    if nd and not q.is_cuda:
        meta.cpu_decode_plan(k_cache, q.dtype).attend(q[:nd], k_cache, v_cache, scale, out[:nd],
                                                       kv_scales)
    elif nd:
        paged_decode(
            q[:nd], k_cache, v_cache, meta.decode_tables, meta.decode_lens, meta.page_size,
            scale, out[:nd], kv_scales,
        )
    if meta.max_prefill_len:
        paged_prefill(
            q[nd:], k_cache, v_cache, meta.prefill_tables, meta.prefill_query_start,
            meta.prefill_lens, meta.max_prefill_len, meta.page_size, scale, out[nd:], kv_scales,
        )
    return out
