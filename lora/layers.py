"""LoRA as a wrapper: each fused projection of the base model becomes `LoraLinear(base)`.

The wrapped linear runs the base projection, then adds every token's own adapter delta
through `LoraSlots.apply` with the step's `LoraBatchInfo`. The model runner builds that info
once per step (`LoraContext.begin_step`); a step where no token has an adapter sets none, and
every wrapper then costs one attribute check.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lora.batch import LoraBatchInfo
from lora.slots import LoraSlots


class LoraContext:
    """What every `LoraLinear` of one model shares: the slots and the current step's info."""

    def __init__(self, slots: LoraSlots) -> None:
        self.slots = slots
        self.info: LoraBatchInfo | None = None
        self.device = slots.scales.device
        # While a CUDA graph is captured, each shrink runs on this stream beside its base
        # projection: a latency-bound kernel next to a bandwidth-bound GEMM.
        self.side_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def begin_step(self, requests: Sequence[Any], num_tokens: Sequence[int]) -> None:
        """`requests[i]` contributes `num_tokens[i]` tokens, in the step's token order."""
        slots = [r.lora_slot for r in requests]
        if all(s < 0 for s in slots):
            self.info = None  # base-only step: skip all LoRA work
        else:
            self.info = LoraBatchInfo.build(slots, num_tokens, self.device)


class LoraLinear(nn.Module):
    """`y = base(x) + LoRA(x)`, each token with its own adapter slot."""

    def __init__(self, base: nn.Linear, ctx: LoraContext, layer: int, fused: str) -> None:
        super().__init__()
        self.base, self.ctx, self.layer, self.fused = base, ctx, layer, fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        info, slots = self.ctx.info, self.ctx.slots
        if info is None or not info.has_lora:
            return self.base(x)
        side = self.ctx.side_stream
        if side is None or not torch.cuda.is_current_stream_capturing():
            y = self.base(x)  # (num_tokens, out_features)
            slots.apply(y, x, self.layer, self.fused, info)
            return y
        # Captured: the shrink branches off to the side stream, the expand joins after both.
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            t = slots.shrink(x, self.layer, self.fused, info)
        y = self.base(x)
        main.wait_stream(side)
        slots.expand(y, t, self.layer, self.fused, info)
        return y


def wrap_model(model: nn.Module, slots: LoraSlots) -> LoraContext:
    """Wrap the four fused projections of every decoder layer of `model` in place (after
    its weights are loaded); returns the context the model runner drives."""
    ctx = LoraContext(slots)
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = LoraLinear(attn.qkv_proj, ctx, i, "qkv_proj")
        attn.o_proj = LoraLinear(attn.o_proj, ctx, i, "o_proj")
        mlp.gate_up_proj = LoraLinear(mlp.gate_up_proj, ctx, i, "gate_up_proj")
        mlp.down_proj = LoraLinear(mlp.down_proj, ctx, i, "down_proj")
    return ctx
