"""Tile configurations of the paged-attention kernels (`kernels/paged_attention.py`), with the
measurements they were chosen from, and which one a launch takes."""

from __future__ import annotations

# Decode: (BLOCK_N, num_warps, num_stages, waves of programs the splits aim for), for small
# and large batches (x KV heads); prefill: (tile rows = queries x grouped heads, BLOCK_N,
# num_warps, num_stages, waves). From the
# H100 sweep in `kernel_tune.py` (8B shapes, 1k contexts): 0.82 of copy bandwidth at batch 64.
# Small batches since (H200, CUDA graphs, 8B shapes; the method of
# `benchmarks/attention_graphs.py --sweep`): 5 stages, which give the loop its second
# K/V buffer (Triton pipelines these gathered loads one tile ahead only from 5 stages), and a
# wave of programs: 0.92-0.94 of the time of (64, 4, 3, 4) at batch 1 x 8k, 16 x 1k, 16 x 8k.
DECODE_CONFIG = (64, 4, 5, 1)
# Large batches: with base-2 scores (32, 4, 2, 4) took 1.28x its time at 128 x 1k (169 against
# 132 us; these configurations' times jump between compilations of nearby ones); this one is
# within 1% of it at 64 and 128 x 1k.
DECODE_CONFIG_LARGE = (64, 4, 3, 2)  # batch x KV heads >= 256
PREFILL_CONFIG = (64, 32, 4, 2, 2)  # + waves of programs a short chunk's splits aim for
# Chunks whose queries x grouped heads fit 32 tile rows (a speculative step's 1 + k tokens):
# `kernel_tune.py --sweep verify` (H200, 8B shapes, 5 queries on 1k-4k contexts, batch 1-16):
# 0.80-0.85 of the default's time, 1.13-1.29x decode's on the same contexts.
VERIFY_CONFIG = (32, 32, 4, 2, 2)
# The merge of the splits: one warp per (token, head) program. H200, D=128: 2.6 us against 8.3
# with 4 warps for 80 tokens x 32 heads x 4 splits (a batch-16 verify step's), 2.0 against 3.0
# for 16 decodes x 8 splits, 2.8 against 3.4 for 5 tokens x 64 splits.
MERGE_WARPS = 1
# An FP8 cache's, from H200 sweeps (8B shapes, contexts of 1k-8k, batch 1-128, CUDA graphs as
# in `benchmarks/attention_graphs.py --sweep`).
# FP8 decode is bound by instruction issue (Nsight Compute: 2 of 4 instructions a cycle, 14
# warps an SM), the E4M3 -> fp16 conversions 40% of them (`kernels.fp8_kv`): 1.16-1.28x bf16's
# speed at batch 16-128 (54 against 69 us at 64 x 1k), 1.1x at batch 1 x 8k.
DECODE_CONFIG_FP8 = (64, 4, 2, 2)
DECODE_CONFIG_FP8_LARGE = (128, 4, 2, 2)  # batch x KV heads >= 1024
# Prefill against (128, 128, 8, 2, 2) before: 0.84x the time of 16 x 2k-token prompts, 0.87x a
# 256-token chunk on an 8k context; verify against (32, 128, 4, 3, 2): 0.86x at batch 16.
PREFILL_CONFIG_FP8 = (128, 64, 4, 3, 2)
VERIFY_CONFIG_FP8 = (32, 128, 4, 2, 2)


def decode_config(programs: int, fp8: bool) -> tuple[int, ...]:
    """The decode kernel's configuration for `programs` = batch x KV heads: (BLOCK_N,
    num_warps, num_stages, waves), and optionally the registers a thread may use at most
    (Triton's `maxnreg`: more programs an SM, at the cost of spills)."""
    if fp8:
        return DECODE_CONFIG_FP8_LARGE if programs >= 1024 else DECODE_CONFIG_FP8
    return DECODE_CONFIG_LARGE if programs >= 256 else DECODE_CONFIG


def prefill_config(tile_rows: int, fp8: bool) -> tuple[int, int, int, int, int]:
    """The prefill kernel's configuration for a chunk of `tile_rows` = its longest sequence's
    new tokens x the grouped query heads (padded): a speculative step's fit `VERIFY_CONFIG`."""
    short = tile_rows <= VERIFY_CONFIG[0]
    if fp8:
        return VERIFY_CONFIG_FP8 if short else PREFILL_CONFIG_FP8
    return VERIFY_CONFIG if short else PREFILL_CONFIG
