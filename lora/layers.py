"""LoRA as a wrapper: each fused projection of the base model becomes `LoraLinear(base)`.

The wrapped linear runs the base projection, then adds every token's own adapter delta
through `LoraSlots.apply` with the step's `LoraBatchInfo`. The model runner builds that info
once per step (`LoraContext.begin_step`); a step where no token has an adapter sets none, and
every wrapper then costs one attribute check.

In a captured CUDA graph the shrink runs on a side stream beside the base projection. In small
steps the expand goes there too, into an fp32 delta that the kernel reading the projection's
output adds (`deferred_projection`; RoPE for qkv, the residual add's RMSNorm for o, SiLU-and-mul
for gate_up, the next layer's residual add and RMSNorm for down), so LoRA puts no node of its
own on the main stream between them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import nn

from kernels.fp8 import Fp8Linear, Fp8Rows
from kernels.linear import Linear
from lora.batch import LoraBatchInfo
from lora.slots import LoraSlots

T = TypeVar("T")

# Steps of up to this many rows defer their adapters' output to the consumer kernels
# (`LoraLinear.deferred`). H200, Llama-3-8B in bf16, rank-16 adapters on all projections, 1k
# contexts, the decode graph replayed alone (ms, base / in-place expands / deferred): batch 1
# 4.40 / 5.08 / 4.81, batch 16 over 4 adapters 5.03 / 5.87 / 5.74, batch 64 over 8 adapters
# 6.72 / 7.91 / 8.04. At 64 rows the side stream's two kernels slow the base GEMMs beside
# them more than the expand node they save (`benchmarks/results/lora_decode_graph_h200.md`).
DEFER_MAX_ROWS = 16
# down_proj's delta waits for the next layer's RMSNorm, a whole attention later, and gains only
# while the step has few distinct adapters (same setup; base / in-place / deferred): batch 1
# 4.39 / 4.81 / 4.63, batch 4 over 2 adapters 5.01 / 4.87, but over 4 adapters 5.15 / 5.24,
# batch 8 over 8 adapters 5.65 / 5.75. Up to 2 rows a step has at most 2 adapters.
DEFER_DOWN_MAX_ROWS = 2


class LoraContext:
    """What every `LoraLinear` of one model shares: the slots and the current step's info."""

    def __init__(self, slots: LoraSlots) -> None:
        self.slots = slots
        self.info: LoraBatchInfo | None = None
        self.device = slots.scales.device
        # While a CUDA graph is captured, each shrink runs on this stream beside its base
        # projection: a latency-bound kernel next to a bandwidth-bound GEMM.
        self.side_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def begin_step(self, slots: Sequence[int], num_tokens: Sequence[int]) -> None:
        """The i-th sequence of the step, in its token order, contributes `num_tokens[i]`
        tokens under adapter slot `slots[i]` (-1: the base model)."""
        if all(s < 0 for s in slots):
            self.info = None  # base-only step: skip all LoRA work
        else:
            self.info = LoraBatchInfo.build(slots, num_tokens, self.device)


class LoraLinear(nn.Module):
    """`y = base(x) + LoRA(x)`, each token with its own adapter slot. The base may be FP8
    (`kernels.fp8.Fp8Linear`); the adapter then reads the same unquantized x."""

    def __init__(self, base: Linear | Fp8Linear, ctx: LoraContext, layer: int,
                 fused: str) -> None:
        super().__init__()
        self.base, self.ctx, self.layer, self.fused = base, ctx, layer, fused

    def forward(self, x: torch.Tensor, x_rows: Fp8Rows | None = None) -> torch.Tensor:
        """`x_rows`: x quantized for an FP8 base (`Fp8Linear.forward`'s)."""
        info, slots = self.ctx.info, self.ctx.slots
        if info is None or not info.has_lora:
            return self.base(x, x_rows)
        if self.ctx.side_stream is None or not torch.cuda.is_current_stream_capturing():
            y = self.base(x, x_rows)  # (num_tokens, out_features)
            slots.apply(y, x, self.layer, self.fused, info)
            return y
        # Captured: the shrink branches off to the side stream, the expand joins after both.
        y, t = self.beside_base(x, x_rows, lambda: slots.shrink(x, self.layer, self.fused, info))
        slots.expand(y, t, self.layer, self.fused, info)
        return y

    def beside_base(self, x: torch.Tensor, x_rows: Fp8Rows | None, work: Callable[[], T]
                    ) -> tuple[torch.Tensor, T]:
        """(base(x), work()): `work` on the side stream beside the base projection, joined
        after both (while a CUDA graph is captured)."""
        side = self.ctx.side_stream
        assert side is not None
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            out = work()
        y = self.base(x, x_rows)
        main.wait_stream(side)
        return y, out

    def deferred(self, x: torch.Tensor, x_rows: Fp8Rows | None = None,
                 max_rows: int = DEFER_MAX_ROWS) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`(base(x), delta)` with the adapters' output in `delta` (fp32, `LoraSlots.delta`),
        for a consumer kernel that adds it as it reads y (`kernels.fused`'s `delta`
        arguments): while a decode graph is captured, the shrink and the expand both run on
        the side stream beside the base projection, and no expand node waits for the base
        on the main stream. Otherwise `(forward(x), None)`.

        Only in steps of up to `max_rows` rows (`DEFER_MAX_ROWS`: measured there)."""
        info = self.ctx.info
        if (info is None or not info.has_lora or info.kernel == "sgmv"
                or self.ctx.side_stream is None or x.shape[0] > max_rows
                or not torch.cuda.is_current_stream_capturing()):
            return self(x, x_rows), None
        return self.beside_base(
            x, x_rows, lambda: self.ctx.slots.delta(x, self.layer, self.fused, info))


def deferred_projection(proj: nn.Module, x: torch.Tensor, x_rows: Fp8Rows | None = None,
                        max_rows: int = DEFER_MAX_ROWS
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`proj(x, x_rows)` as `(y, delta)` for a caller that adds `delta` (fp32, or None) to y
    in the kernel that reads y: a LoRA wrapper's `LoraLinear.deferred`, any other
    projection's `(y, None)`."""
    if isinstance(proj, LoraLinear):
        return proj.deferred(x, x_rows, max_rows)
    return proj(x, x_rows), None


# What `wrap_model` wraps in each decoder layer: (its submodule, the fused projection in it).
TARGETS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"),
           ("mlp", "down_proj"))


def wrap_model(model: nn.Module, slots: LoraSlots) -> LoraContext:
    """Wrap the four fused projections of every decoder layer of `model` (`model.layers`) in
    place, after its weights are loaded; returns the context the model runner drives."""
    ctx = LoraContext(slots)
    layers = model.get_submodule("layers")
    assert isinstance(layers, nn.ModuleList)
    for i, layer in enumerate(layers):
        for owner, name in TARGETS:
            parent = layer.get_submodule(owner)
            base = parent.get_submodule(name)
            assert isinstance(base, (Linear, Fp8Linear)), f"layers.{i}.{owner}.{name}: {base}"
            setattr(parent, name, LoraLinear(base, ctx, i, name))
    return ctx
