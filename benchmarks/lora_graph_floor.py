"""Where LoRA's time goes in a decode CUDA graph: the engine's graph for a batch, replayed
alone, with parts of the LoRA wrapper taken out before capture (the floors that a change of
that part could reach; `benchmarks/results/lora_decode_graph_h200.md`).

    python3 benchmarks/lora_graph_floor.py VARIANT --out floor.json [--cases lora1_b1 ...]

One variant a process (the wrapper is patched before the graphs are captured):

    main           the tree as it is
    base_only      the wrapper runs its base projection only: the LoRA graph, no LoRA work
    fork_only      the side stream forked and joined around the base, nothing on it
    no_expand      main's shrinks, no expands
    serial         no side stream: shrink, base, expand in order
    shrinks_free   serial, with the shrinks of qkv, gate_up and down taking no time (o's kept):
                   shrinks fused into the kernels that make those inputs, at no cost
    side_delta     shrink and expand on the side stream into a delta nobody adds: the
                   deferred expand (`LoraLinear.deferred`) at every size, its adds free
    defer=N        main with `lora.layers.DEFER_MAX_ROWS` = N
    bgmv           main with BGMV in every LoRA decode graph (`lora.batch`'s
                   `SEGMENTED_MAX_SEGMENTS` = 0), not the segmented kernel up to 32 adapters

Variants combine with commas (`bgmv,defer=0`).

`synthetic:llama3-8b` in bf16, 1,024-token prompts, rank-16 adapters on all 7 projections; a
case `loraA_bB` is batch B over A adapters in turn, `base_bB` the same batch without. Figures:
ms a replay, the best of 3 x 20.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from gpu_common import greedy, random_prompts, write_adapter
from gpu_profile import replay_ms

import lora.batch
import lora.layers
import lora.slots
from engine import LLM
from lora.layers import LoraLinear

CASES = ("base_b1", "lora1_b1", "base_b16", "lora4_b16", "lora16_b16", "base_b64", "lora8_b64",
         "lora16_b64")
RANK, PROMPT_LEN = 16, 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("variant")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cases", nargs="+", default=list(CASES),
                    help="base_bB or loraA_bB (batch B over A adapters)")
    ap.add_argument("--adapter-dir", type=Path, default=Path("/tmp/floor-adapters"))
    args = ap.parse_args()
    patch(args.variant)
    batches = [int(c.split("_b")[1]) for c in args.cases]
    adapters = max([int(c[4:].split("_")[0]) for c in args.cases if c.startswith("lora")] or [1])
    llm = LLM("synthetic:llama3-8b", dtype="bfloat16", device="cuda", max_num_seqs=max(batches),
              max_num_batched_tokens=16384, num_pages=max(batches) * 72 + 1200,
              max_loras=adapters, max_cpu_loras=adapters, max_lora_rank=RANK)
    cfg = llm.engine.model_config
    for k in range(adapters):
        write_adapter(args.adapter_dir / f"f{k}", cfg, RANK, seed=k, device="cuda")
        llm.load_adapter(f"a{k}", args.adapter_dir / f"f{k}")
    result: dict[str, object] = {"variant": args.variant, "device": torch.cuda.get_device_name()}
    for case in args.cases:
        result[case] = replay(llm, case)
        print(args.variant, case, result[case], flush=True)
    args.out.write_text(json.dumps(result, indent=1))


def replay(llm: LLM, case: str) -> float:
    """ms a replay of the decode graph that `case`'s steps run."""
    name, batch = case.split("_b")
    n = 0 if name == "base" else int(name[4:])
    eng = llm.engine
    prompts = random_prompts(int(batch), PROMPT_LEN, seed=1, vocab=eng.model_config.vocab_size)
    rids = [f"{case}-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for i, (rid, prompt) in enumerate(zip(rids, prompts, strict=True)):
        eng.add_request(rid, prompt, greedy(300, f"a{i % n}" if n else None))
    while eng.num_waiting or any(r.num_computed_tokens < r.num_tokens - 1
                                 for r in eng.scheduler.running):
        eng.step()
    for _ in range(4):
        eng.step()
    graphs = eng.runner.graphs
    assert graphs is not None, "no CUDA graphs"
    graph, _ = graphs.graphs[graphs.last_key]
    ms = min(replay_ms(graph) for _ in range(3)) * 1e3
    for rid in rids:
        eng.abort_request(rid)
    return round(ms, 3)


def patch(variants: str) -> None:
    """Change the LoRA wrapper as `variants` say (module docstring), before any capture."""
    for variant in variants.split(","):
        _patch(variant)


def _patch(variant: str) -> None:
    if variant == "bgmv":
        lora.batch.SEGMENTED_MAX_SEGMENTS = 0
        return
    if variant.startswith("defer="):
        lora.layers.DEFER_MAX_ROWS = int(variant.split("=")[1])
        return
    if variant == "no_expand":
        lora.slots.projection_expand = lambda *args, **kw: None  # type: ignore[assignment]
        return
    forwards = {"base_only": _base_only, "fork_only": _fork_only, "serial": _serial,
                "shrinks_free": _serial, "side_delta": _side_delta}
    if variant != "main":
        forward = forwards[variant]
        LoraLinear.forward = lambda self, x, rows=None: forward(self, x, rows, variant)  # type: ignore[method-assign]


def _base_only(self: LoraLinear, x, rows, variant):
    return self.base(x, rows)


def _fork_only(self: LoraLinear, x, rows, variant):
    if self.ctx.info is None or not torch.cuda.is_current_stream_capturing():
        return self.base(x, rows)
    return self.beside_base(x, rows, lambda: None)[0]


def _serial(self: LoraLinear, x, rows, variant):
    info, slots = self.ctx.info, self.ctx.slots
    if info is None or not info.has_lora:
        return self.base(x, rows)
    if (variant == "shrinks_free" and self.fused != "o_proj"
            and torch.cuda.is_current_stream_capturing()):
        # the shrink's output, unwritten: what `projection_shrink` returns, no kernel
        width = slots.layers[self.layer][self.fused].a.shape[1] * slots.tables[self.fused].max_rank
        if info.kernel == "segmented":
            t = x.new_empty(-(-x.shape[1] // 1024), x.shape[0], width, dtype=torch.float32)
        else:
            t = x.new_empty(x.shape[0], width)
    else:
        t = slots.shrink(x, self.layer, self.fused, info)
    y = self.base(x, rows)
    slots.expand(y, t, self.layer, self.fused, info)
    return y


def _side_delta(self: LoraLinear, x, rows, variant):
    info = self.ctx.info
    if info is None or not info.has_lora or not torch.cuda.is_current_stream_capturing():
        return _main_forward(self, x, rows)
    delta = lambda: self.ctx.slots.delta(x, self.layer, self.fused, info)  # noqa: E731
    return self.beside_base(x, rows, delta)[0]  # the delta is never added


_main_forward = LoraLinear.forward

if __name__ == "__main__":
    main()
