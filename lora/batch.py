"""Per-step LoRA batch info, and the two calls every LoRA-wrapped projection makes.

The model runner builds one `LoraBatchInfo` per step from the scheduled sequences' adapter
slots; every LoRA layer of the forward then runs, over its projection's adapter pool
(`lora.slots`: `a_pool [U, S, H]`, `b_pool [U, N]`, each adapter at its own rows and rank,
read through the `SlotTable`),

    t = lora_shrink(x, a_pool, table, info)            # (num_tokens, S * max_rank)
    lora_expand_slices(y, t, b_pool, sizes, table, info)  # y += scale * t_j @ B_j^T per slice

both at once being `lora_shrink_expand`. A fused projection (`qkv_proj` rows `[q|k|v]`,
`gate_up_proj` rows `[gate|up]`) has S slices; slice j of `t` is columns `j * max_rank :`.

Kernel choice (`LoraBatchInfo.kernel`): runs of tokens sharing an adapter are merged into
segments. When segments average at least two tokens (prefill, chunks, decodes ordered by
adapter) SGMV does one grouped product per segment; otherwise (decodes with interleaved
adapters) BGMV gathers per token. CUDA graphs hold static tables, so that the grid does not
depend on the step's adapters: the decode graphs run `kernels.seg_lora` over 16-row segments
(`LoraBatchInfo.segmented`), or BGMV over per-token slots when the step has many segments
(`graph_kernel`); the piecewise graphs, whose steps prefill, run SGMV over 64-row segments
(`LoraBatchInfo.static`). Every path gives the same result; this is only about speed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kernels.bgmv import bgmv_expand_slices, bgmv_shrink
from kernels.seg_lora import EXPAND_CONFIG, MAX_ROWS, seg_expand_triton, seg_lora, seg_shrink
from kernels.sgmv import sgmv_expand_slices, sgmv_shrink
from kernels.upload import upload


@dataclass(frozen=True)
class SlotTable:
    """Where each slot's adapter lies in one fused projection's pool (`lora.slots`)."""

    starts: torch.Tensor  # (num_slots,) int32: its first pool row
    ranks: torch.Tensor  # (num_slots,) int32: its rows there (0: empty, or not targeted)
    scales: torch.Tensor  # (num_slots,) float32
    max_rank: int  # the largest rank: the width of each slice of `t`


@dataclass(frozen=True)
class LoraBatchInfo:
    """Which adapter slot each token of one step uses (-1 = base model only)."""

    token_slots: torch.Tensor  # (num_tokens,) int32
    seg_indptr: torch.Tensor  # (num_segments + 1,) int32, runs of equal slot
    seg_slots: torch.Tensor  # (num_segments,) int32
    max_seg_len: int
    kernel: Literal["sgmv", "bgmv", "segmented"]
    has_lora: bool  # False: every token is base-only; LoRA layers can skip all work

    @classmethod
    def build(
        cls, slots: Sequence[int], num_tokens: Sequence[int], device: torch.device | str = "cpu"
    ) -> LoraBatchInfo:
        """From host lists: `slots[i]` and `num_tokens[i]` are the adapter slot (-1 = none) and
        token count of the i-th sequence, in the order its tokens appear in the step."""
        seg_slots: list[int] = []
        seg_lens: list[int] = []
        token_slots: list[int] = []
        for slot, n in zip(slots, num_tokens, strict=True):
            if n == 0:
                continue
            token_slots += [slot] * n
            if seg_slots and seg_slots[-1] == slot:
                seg_lens[-1] += n
            else:
                seg_slots.append(slot)
                seg_lens.append(n)
        indptr = [0]
        for n in seg_lens:
            indptr.append(indptr[-1] + n)

        token_slots_t, indptr_t, seg_slots_t = upload(
            [token_slots, indptr, seg_slots], torch.int32, device
        )
        return cls(
            token_slots=token_slots_t,
            seg_indptr=indptr_t,
            seg_slots=seg_slots_t,
            max_seg_len=max(seg_lens, default=0),
            kernel="sgmv" if 2 * len(seg_lens) <= len(token_slots) else "bgmv",
            has_lora=any(s >= 0 for s in seg_slots),
        )

    @classmethod
    def segmented(cls, seg_indptr: torch.Tensor, seg_slots: torch.Tensor) -> LoraBatchInfo:
        """Over a CUDA graph's static segment table (`kernels.seg_lora.segment_table` fills it
        before each replay, segments of at most `MAX_ROWS` rows): the grid depends only on the
        table's capacity. It is also a valid SGMV table, which `lora_shrink` and
        `lora_expand_slices` use."""
        return cls(seg_indptr[:0], seg_indptr, seg_slots, MAX_ROWS, "segmented", has_lora=True)

    @classmethod
    def static(cls, seg_indptr: torch.Tensor, seg_slots: torch.Tensor,
               max_rows: int) -> LoraBatchInfo:
        """SGMV over a CUDA graph's static segment table (`segment_table` with segments of at
        most `max_rows` rows, padded with empty ones): the grid depends only on the table's
        capacity and `max_rows`. The piecewise graphs' steps (prefill) use it."""
        return cls(seg_indptr[:0], seg_indptr, seg_slots, max_rows, "sgmv", has_lora=True)

    @classmethod
    def per_token(cls, token_slots: torch.Tensor) -> LoraBatchInfo:
        """BGMV over a CUDA graph's static per-token slots (-1 on padding rows)."""
        empty = token_slots[:0]
        return cls(token_slots, empty, empty, 0, "bgmv", has_lora=True)


# A decode graph replays segmented LoRA up to this many segments with an adapter, BGMV beyond:
# with one-token segments both read each adapter once, and BGMV's wider grid reads faster. H100,
# batch 64, 8 layers x 4 projections in a graph: segmented 44.2 / 74.2 / 112.5 us a layer with
# 8 / 32 / 64 distinct adapters, BGMV 59.7 / 74.8 / 93.2 (`benchmarks/kernel_tune.py --sweep seg`).
SEGMENTED_MAX_SEGMENTS = 32


def graph_kernel(num_lora_segments: int) -> Literal["segmented", "bgmv"]:
    """The LoRA kernel a CUDA graph replays for a step with this many segments (of at most
    `MAX_ROWS` rows) that have an adapter."""
    return "segmented" if num_lora_segments <= SEGMENTED_MAX_SEGMENTS else "bgmv"


def lora_shrink(x: torch.Tensor, a_pool: torch.Tensor, table: SlotTable,
                info: LoraBatchInfo) -> torch.Tensor:
    """t[i, j * R : j * R + r] = A_j[slot(i)] @ x[i] (r its rank, R `table.max_rank`); zeros
    elsewhere and for base-only tokens.

    Args:
        x: [T, H]; a_pool: [U, S, H].
    Returns:
        t: [T, S * R]
    """
    tab = table
    if info.kernel != "bgmv":
        return sgmv_shrink(x, a_pool, tab.starts, tab.ranks, tab.max_rank, info.seg_indptr,
                           info.seg_slots, info.max_seg_len)
    return bgmv_shrink(x, a_pool, tab.starts, tab.ranks, tab.max_rank, info.token_slots)


def lora_expand_slices(
    y: torch.Tensor,
    t: torch.Tensor,
    b_pool: torch.Tensor,
    sizes: Sequence[int],
    table: SlotTable,
    info: LoraBatchInfo,
) -> None:
    """Expand a (fused) projection: slice j (columns `sum(sizes[:j]) :` of the pool, `sizes[j]`
    of them) reads `t[:, j * R : (j + 1) * R]` and adds `scale * t_j @ B_j^T` into the same
    output columns of y (`[q|k|v]` or `[gate|up]`), every slice in one launch.

    Args:
        y: [T, sum(sizes)]; t: [T, len(sizes) * R]; b_pool: [U, sum(sizes)].
    """
    tab = table
    if info.kernel == "bgmv":
        bgmv_expand_slices(y, t, b_pool, sizes, tab.starts, tab.ranks, info.token_slots,
                           tab.scales)
        return
    sgmv_expand_slices(y, t, b_pool, sizes, tab.starts, tab.ranks, info.seg_indptr,
                       info.seg_slots, tab.scales, info.max_seg_len)


def lora_shrink_expand(
    y: torch.Tensor,
    x: torch.Tensor,
    a_pool: torch.Tensor,
    b_pool: torch.Tensor,
    sizes: Sequence[int],
    table: SlotTable,
    info: LoraBatchInfo,
) -> None:
    """y += LoRA(x) for a (fused) projection: `lora_shrink`, then `lora_expand_slices`.

    Args:
        y: [T, sum(sizes)]; x: [T, H]; a_pool: [U, len(sizes), H]; b_pool: [U, sum(sizes)].
    """
    if info.kernel == "segmented":
        tab = table
        seg_lora(y, x, a_pool, b_pool, sizes, tab.starts, tab.ranks, tab.max_rank,
                 info.seg_indptr, info.seg_slots, tab.scales, info.max_seg_len)
        return
    t = lora_shrink(x, a_pool, table, info)  # (num_tokens, len(sizes) * max_rank)
    lora_expand_slices(y, t, b_pool, sizes, table, info)


def projection_shrink(x: torch.Tensor, a_pool: torch.Tensor, table: SlotTable,
                      info: LoraBatchInfo):
    """`lora_shrink_expand` in two halves, so that a CUDA graph can run the shrink on a side
    stream beside the base projection (Triton kernels only). Returns `t` for
    `projection_expand`: [T, S * max_rank], or the segmented kernel's fp32 partials."""
    if info.kernel == "segmented":
        return seg_shrink(x, a_pool, table.starts, table.ranks, table.max_rank,
                          info.seg_indptr, info.seg_slots, info.max_seg_len)
    return lora_shrink(x, a_pool, table, info)


def projection_expand(
    y: torch.Tensor,
    t: torch.Tensor,
    b_pool: torch.Tensor,
    sizes: Sequence[int],
    table: SlotTable,
    info: LoraBatchInfo,
) -> None:
    """y += the expand of `projection_shrink`'s `t`."""
    if info.kernel == "segmented":
        tab = table
        seg_expand_triton(y, t, b_pool, sizes, tab.starts, tab.ranks, tab.max_rank,
                          info.seg_indptr, info.seg_slots, tab.scales, info.max_seg_len,
                          EXPAND_CONFIG)
        return
    lora_expand_slices(y, t, b_pool, sizes, table, info)
