"""Device adapter pools filled for timing: every slot an adapter of one rank, side by side."""

from __future__ import annotations

import torch

from lora.slots import LoraSlots


def side_by_side(slots: LoraSlots, rank: int, scale: float = 2.0, a_std: float | None = None,
                 b_std: float = 0.02) -> LoraSlots:
    """Give each of `slots`' slots a random adapter of `rank` on every projection, slot s at
    rows `s * rank`; lora_A ~ N(0, a_std or in_features ** -0.5), lora_B ~ N(0, b_std)."""
    assert slots.pool_rows >= slots.num_slots * rank, "the pool holds fewer adapters"
    for layer in slots.layers:
        for pool in layer.values():
            pool.a.normal_(0, a_std or pool.a.shape[2] ** -0.5)
            pool.b.normal_(0, b_std)
    starts = torch.arange(slots.num_slots, dtype=torch.int32, device=slots.starts.device) * rank
    slots.starts.copy_(starts.expand_as(slots.starts))
    slots.ranks.fill_(rank)
    slots.scales.fill_(scale)
    return slots
