"""The device tier: stacked LoRA buffers holding `num_slots` resident adapters.

The base model fuses projections (`qkv_proj` rows `[q|k|v]`, `gate_up_proj` rows `[gate|up]`),
so each layer keeps, per fused projection, one A stack with the slices' ranks side by side and
one B stack with the slices' output rows one after another (as in the base weight):

    a: [num_slots, num_slices * r_max, in_features]
    b: [num_slots, sum_j out_features_j, r_max]

A slot holds one adapter; ranks below `r_max` and projections the adapter does not target are
zeros, which add nothing (see `kernels.sgmv`). `scales[slot]` is the adapter's alpha / r; a
module whose own scale differs (PEFT's rank/alpha patterns) has the ratio folded into its B.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lora.adapter import LoraAdapter
from lora.batch import LoraBatchInfo, lora_shrink_expand, projection_expand, projection_shrink
from lora.shape import BaseShape
from lora.validate import projection_dims

# (projection, a [r, in], b [out, r]) -> this rank's (a, b)
Shard = Callable[[str, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


@dataclass(frozen=True)
class ProjectionSlots:
    """Stacked LoRA weights of one (fused) projection of one layer."""

    a: torch.Tensor  # (num_slots, num_slices * r_max, in_features)
    b: torch.Tensor  # (num_slots, sum(sizes), r_max), slice j's rows after slices 0..j-1
    sizes: tuple[int, ...]  # out_features of each slice


class LoraSlots:
    """Fixed-size device buffers; the adapter manager decides which adapter sits in which slot."""

    def __init__(
        self,
        base: BaseShape,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        shard: Shard | None = None,
    ) -> None:
        """Under tensor parallelism `base` is this rank's shapes, and `shard(projection, a, b)`
        cuts a whole adapter's LoRA to this rank's
        (`engine.parallel.partition.Partition.cut_lora`)."""
        self.num_slots, self.max_rank, self.shard = num_slots, max_rank, shard
        dims = projection_dims(base)

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.layers: list[dict[str, ProjectionSlots]] = [
            {
                fused: ProjectionSlots(
                    a=zeros(num_slots, len(parts) * max_rank, dims[parts[0]][0]),
                    b=zeros(num_slots, sum(dims[p][1] for p in parts), max_rank),
                    sizes=tuple(dims[p][1] for p in parts),
                )
                for fused, parts in FUSED.items()
            }
            for _ in range(base.num_layers)
        ]
        self.scales = torch.zeros(num_slots, dtype=torch.float32, device=device)  # (num_slots,)

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy a validated adapter into `slot`, replacing whatever was there."""
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter rank {adapter.rank} exceeds the slot rank {self.max_rank}")
        if len(adapter.layers) != len(self.layers):
            raise ValueError("adapter was validated against a different base model")
        self.clear(slot)
        r_max = self.max_rank
        for layer, modules in zip(self.layers, adapter.layers, strict=True):
            for fused, parts in FUSED.items():
                stack = layer[fused]
                row = 0
                for j, part in enumerate(parts):
                    m, rows = modules.get(part), stack.sizes[j]
                    if m is not None:
                        r = m.rank
                        a, b = (m.a, m.b) if self.shard is None else self.shard(part, m.a, m.b)
                        stack.a[slot, j * r_max : j * r_max + r].copy_(a)
                        stack.b[slot, row : row + rows, :r].copy_(b * (m.scale / adapter.scale))
                    row += rows
        self.scales[slot] = adapter.scale

    def clear(self, slot: int) -> None:
        for layer in self.layers:
            for stack in layer.values():
                stack.a[slot].zero_()
                stack.b[slot].zero_()
        self.scales[slot] = 0.0

    def apply(
        self, y: torch.Tensor, x: torch.Tensor, layer: int, fused: str, info: LoraBatchInfo
    ) -> None:
        """y += LoRA(x) for projection `fused` ("qkv_proj", "o_proj", "gate_up_proj",
        "down_proj") of `layer`, each token with its own slot's adapter.

        Args:
            y: [T, out_features] the base projection's output, updated in place.
            x: [T, in_features] the projection's input.
        """
        if not info.has_lora:
            return
        stack = self.layers[layer][fused]
        lora_shrink_expand(y, x, stack.a, stack.b, stack.sizes, self.scales, info)

    def shrink(self, x: torch.Tensor, layer: int, fused: str, info: LoraBatchInfo):
        """`apply` in two halves (`expand(y, shrink(x))`), for a CUDA graph to run the shrink
        on a side stream; needs `info.has_lora`."""
        return projection_shrink(x, self.layers[layer][fused].a, info)

    def expand(self, y: torch.Tensor, t, layer: int, fused: str, info: LoraBatchInfo) -> None:
        stack = self.layers[layer][fused]
        projection_expand(y, t, stack.b, stack.sizes, self.scales, info)
