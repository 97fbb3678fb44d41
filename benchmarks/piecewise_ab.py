"""Piecewise CUDA graphs on and off (engine/runner/piecewise_graphs.py), offline, same engine, same
run:
the mixed workload of the GPU suite (256 requests, prompts 64-1024 tokens, outputs 64-256, all
submitted at once, greedy), base-only and with 8 rank-16 adapters on every other request.
Rounds alternate on and off after one warm-up of each (it compiles the kernels).

    python3 benchmarks/piecewise_ab.py [--model synthetic:llama3-8b] [--rounds 2]

GPU only: a CPU engine captures no graphs. Prints output tokens/s per round and the ratios of
the medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import write_adapter  # noqa: E402
from gpu_e2e import mixed_workload  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="synthetic:llama3-8b")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("piecewise graphs are captured on CUDA only")
    t = time.perf_counter()
    llm = LLM(args.model, dtype="bfloat16", device="cuda", max_num_seqs=128,
              max_num_batched_tokens=8192, num_pages=18000, max_loras=8, max_cpu_loras=8,
              max_lora_rank=16)
    print(f"load (graphs captured) {time.perf_counter() - t:.1f} s", flush=True)
    cfg = llm.engine.model_config
    with tempfile.TemporaryDirectory() as tmp:
        names = []
        for k in range(8):
            write_adapter(Path(tmp) / f"a{k}", cfg, 16, seed=50 + k, device="cuda")
            llm.load_adapter(f"a{k}", Path(tmp) / f"a{k}")
            names.append(f"a{k}")
        prompts, outputs = mixed_workload(256, cfg.vocab_size)
        workloads = {
            "base": [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
                     for m in outputs],
            "lora on half": [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True,
                                            adapter=names[i % 8] if i % 2 else None)
                             for i, m in enumerate(outputs)],
        }
        runner = llm.engine.runner
        pieces = runner.piecewise
        rates: dict[tuple[str, str], list[float]] = {}
        for r in range(1 + args.rounds):  # round 0 warms up
            for name, params in workloads.items():
                for way in ("on", "off"):
                    runner.piecewise = pieces if way == "on" else None
                    llm.engine.reset_prefix_cache()
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    outs = llm.generate(prompts, params)
                    torch.cuda.synchronize()
                    rate = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)
                    print(f"round {r} {name}, pieces {way}: {rate:.0f} tok/s", flush=True)
                    if r:
                        rates.setdefault((name, way), []).append(rate)
    for name in workloads:
        on, off = (statistics.median(rates[(name, w)]) for w in ("on", "off"))
        print(f"{name}: pieces on {on:.0f}, off {off:.0f} tok/s: {on / off:.3f}x")


if __name__ == "__main__":
    main()
