"""Per-step LoRA batch info, and the two calls every LoRA-wrapped projection makes.

The model runner builds one `LoraBatchInfo` per step from the scheduled sequences' adapter
slots; every LoRA layer of the forward then runs

    t = lora_shrink(x, a_stack, info)                       # (num_tokens, r_max)
    lora_expand(y, t, b_stack, scales, info)                # y += scale * t @ B^T

or, for a fused projection (`qkv_proj` rows `[q|k|v]`, `gate_up_proj` rows `[gate|up]`),
one shrink with the slices' A stacked along the rank axis and `lora_expand_slices`.

Kernel choice: runs of tokens sharing an adapter are merged into segments. When segments
average at least two tokens (prefill, chunks, decodes ordered by adapter) SGMV does one
grouped product per segment; otherwise (decodes with interleaved adapters) BGMV gathers per
token. Both paths give the same result; this is only about speed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.bgmv import bgmv_expand, bgmv_expand_slices, bgmv_shrink
from kernels.sgmv import sgmv_expand, sgmv_shrink


@dataclass(frozen=True)
class LoraBatchInfo:
    """Which adapter slot each token of one step uses (-1 = base model only)."""

    token_slots: torch.Tensor  # (num_tokens,) int32
    seg_indptr: torch.Tensor  # (num_segments + 1,) int32, runs of equal slot
    seg_slots: torch.Tensor  # (num_segments,) int32
    max_seg_len: int
    use_sgmv: bool
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

        def tensor(values: list[int]) -> torch.Tensor:  # pinned: the upload does not wait
            on_gpu = torch.device(device).type == "cuda"
            host = torch.tensor(values, dtype=torch.int32, pin_memory=on_gpu)
            return host.to(device, non_blocking=True)

        return cls(
            token_slots=tensor(token_slots),
            seg_indptr=tensor(indptr),
            seg_slots=tensor(seg_slots),
            max_seg_len=max(seg_lens, default=0),
            use_sgmv=2 * len(seg_lens) <= len(token_slots),
            has_lora=any(s >= 0 for s in seg_slots),
        )


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, info: LoraBatchInfo) -> torch.Tensor:
    """t[i] = A[slot(i)] @ x[i]; zero rows for base-only tokens.

    Args:
        x: [T, H]; a_stack: [num_slots, R, H] (R = r_max, or slices x r_max when fused).
    Returns:
        t: [T, R]
    """
    if info.use_sgmv:
        return sgmv_shrink(x, a_stack, info.seg_indptr, info.seg_slots, info.max_seg_len)
    return bgmv_shrink(x, a_stack, info.token_slots)


def lora_expand(
    y: torch.Tensor,
    t: torch.Tensor,
    b_stack: torch.Tensor,
    scales: torch.Tensor,
    info: LoraBatchInfo,
    slice_offset: int = 0,
) -> None:
    """y[i, slice_offset : slice_offset + N] += scales[slot(i)] * B[slot(i)] @ t[i], in place.

    Args:
        y: [T, N_total]; t: [T, r_max]; b_stack: [num_slots, N, r_max]; scales: [num_slots].
    """
    if info.use_sgmv:
        sgmv_expand(
            y, t, b_stack, info.seg_indptr, info.seg_slots, scales, info.max_seg_len, slice_offset
        )
    else:
        bgmv_expand(y, t, b_stack, info.token_slots, scales, slice_offset)


def lora_expand_slices(
    y: torch.Tensor,
    t: torch.Tensor,
    b_stack: torch.Tensor,
    sizes: Sequence[int],
    scales: torch.Tensor,
    info: LoraBatchInfo,
) -> None:
    """Expand a fused projection: slice j (rows `sum(sizes[:j]) :` of B, `sizes[j]` of them)
    reads `t[:, j * r_max : (j + 1) * r_max]` and adds into the same output columns of y
    (`[q|k|v]` or `[gate|up]`). BGMV does every slice in one launch.

    Args:
        y: [T, sum(sizes)]; t: [T, len(sizes) * r_max]; b_stack: [num_slots, sum(sizes), r_max].
    """
    if not info.use_sgmv:
        bgmv_expand_slices(y, t, b_stack, sizes, info.token_slots, scales)
        return
    offset, r_max = 0, b_stack.shape[2]
    for j, n in enumerate(sizes):
        b = b_stack.narrow(1, offset, n)
        lora_expand(y, t[:, j * r_max : (j + 1) * r_max], b, scales, info, offset)
        offset += n
