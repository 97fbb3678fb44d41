"""Paged attention over a mixed batch of prefill chunks and decodes (torch path).

The KV cache of one layer is two tensors of slots, `[num_pages * page_size, kv_heads, head_dim]`;
a page is `page_size` consecutive slots. Tokens in a step are laid out decodes first (one query
token each), then prefill chunks. This module is the seam where the GPU Triton kernels go; the
CPU path gathers a sequence's slots and uses matmul / SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSeq:
    """One prefill chunk: queries `[start, start + num_new)` of the step, attending causally to
    its `num_cached` earlier tokens (already in the cache) and to itself."""

    start: int
    num_new: int
    num_cached: int
    # [num_cached + num_new] slots of the whole context; None when nothing is cached.
    slots: torch.Tensor | None
    # [num_new, num_cached + num_new] bool, True = attend; None when nothing is cached.
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner; shared by every layer."""

    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    num_decodes: int  # the first `num_decodes` tokens are decodes
    decode_slots: torch.Tensor | None  # [B, L] context slots of each decode, padded
    decode_bias: torch.Tensor | None  # [B, 1, 1, L] 0 for real slots, -inf for padding
    prefills: list[PrefillSeq]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend.

    Args:
        q: [T, H, D]; k, v: [T, KVH, D] for the step's new tokens.
        k_cache, v_cache: [S, KVH, D] slot arrays of this layer.
    Returns:
        [T, H, D]
    """
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    num_heads, num_kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    group = num_heads // num_kv_heads

    nd = meta.num_decodes
    if nd:
        assert meta.decode_slots is not None and meta.decode_bias is not None
        kd = k_cache[meta.decode_slots].permute(0, 2, 3, 1)  # (B, KVH, D, L)
        vd = v_cache[meta.decode_slots].transpose(1, 2)  # (B, KVH, L, D)
        qd = q[:nd].view(nd, num_kv_heads, group, head_dim)  # (B, KVH, G, D)
        scores = torch.matmul(qd, kd) * scale + meta.decode_bias  # (B, KVH, G, L)
        probs = torch.softmax(scores, dim=-1)
        out[:nd] = torch.matmul(probs, vd).reshape(nd, num_heads, head_dim)

    for p in meta.prefills:
        qs = q[p.start : p.start + p.num_new].transpose(0, 1)  # (H, n, D)
        if p.slots is None:
            ks = k[p.start : p.start + p.num_new].transpose(0, 1)  # (KVH, n, D)
            vs = v[p.start : p.start + p.num_new].transpose(0, 1)
            o = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=group > 1
            )
        else:
            ks = k_cache[p.slots].transpose(0, 1)  # (KVH, ctx, D)
            vs = v_cache[p.slots].transpose(0, 1)
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=p.mask, scale=scale, enable_gqa=group > 1
            )
        out[p.start : p.start + p.num_new] = o.transpose(0, 1)
    return out
