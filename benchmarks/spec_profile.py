"""Where a step's time goes, plain decode against the overlapped speculative loop (k = 4 drafts
on every step), at batch 16 and 1 on `synthetic:llama3-8b` with 1k-token contexts:

    python benchmarks/spec_profile.py [--out DIR]

Per kind: wall ms per step; per `LLMEngine.step` call its median, the median wait for the
step's draws (`ModelRunner.collect`) and the rest, the host's; then, under torch's profiler,
the device's kernel time per step, kernels per step and the top kernels. Interleaved rounds;
writes DIR/spec_profile.json. A CUDA machine only.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from pathlib import Path

import torch
from gpu_common import greedy, random_prompts

from engine import LLM
from engine.spec.speculative import Speculator


def run(llm: LLM, prompts, kind: str, steps: int, profile: bool) -> dict:
    eng = llm.engine
    eng.speculator = Speculator(4, min_acceptance=0.0) if kind == "loop" else None
    rids = [f"{kind}-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts, strict=True):
        eng.add_request(rid, p, greedy(400))
    while eng.num_waiting or any(r.num_computed_tokens < r.num_tokens - 1
                                 for r in eng.scheduler.running):
        eng.step()
    for _ in range(5):
        eng.step()
    torch.cuda.synchronize()
    waits: list[float] = []
    collect = eng.runner.collect

    def timed_collect(step):
        t = time.perf_counter()
        out = collect(step)
        waits.append(time.perf_counter() - t)
        return out

    eng.runner.collect = timed_collect
    calls = []
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    if profile:
        prof.__enter__()
    start = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        calls.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    if profile:
        prof.__exit__(None, None, None)
    del eng.runner.collect
    for rid in rids:
        eng.abort_request(rid)
    eng.speculator = None
    eng.step()  # the loop's last step in flight is read back
    call, wait = statistics.median(calls), statistics.median(waits)
    r = {"step_ms": round(wall / steps * 1e3, 3), "call_ms": round(call * 1e3, 3),
         "wait_ms": round(wait * 1e3, 3), "host_ms": round((call - wait) * 1e3, 3)}
    if profile:
        total: collections.Counter = collections.Counter()
        count: collections.Counter = collections.Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                total[e.name] += e.device_time_total
                count[e.name] += 1
        r["gpu_ms_per_step"] = round(sum(total.values()) / steps / 1e3, 3)
        r["kernels_per_step"] = round(sum(count.values()) / steps, 1)
        r["top"] = [(name[:70], round(t / steps / 1e3, 4), count[name] / steps)
                    for name, t in total.most_common(15)]
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--model", default="synthetic:llama3-8b")
    args = ap.parse_args()
    llm = LLM(args.model, dtype="bfloat16", device="cuda", max_num_seqs=64,
              max_num_batched_tokens=16384, num_pages=64 * 70 + 200, num_speculative_tokens=4)
    llm.engine.speculator = None
    prompts = random_prompts(16, 1024, seed=1, vocab=llm.engine.model_config.vocab_size)
    results = {}
    for b in (16, 1):
        for kind in ("plain", "loop", "plain", "loop"):  # the second round is kept
            results[f"{kind}_b{b}"] = run(llm, prompts[:b], kind, 40, profile=False)
        for kind in ("plain", "loop"):
            results[f"{kind}_b{b}_profiled"] = run(llm, prompts[:b], kind, 20, profile=True)
    for name, r in results.items():
        print(name, {k: v for k, v in r.items() if k != "top"}, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "spec_profile.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
