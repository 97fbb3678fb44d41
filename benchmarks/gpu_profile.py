"""Where a step's time goes on the GPU: the diagnosis behind the GPU suite's figures.

    python3 benchmarks/gpu_profile.py --out prof.json [--model synthetic:llama3-8b]

For decode at batch 64 (base, 8 and 64 distinct adapters, JSON-constrained) it reports the
engine's step wall time beside the GPU time of the same step's CUDA graph replayed alone (the
difference is host time the GPU waits on), the kernels of the step run eagerly grouped by
kind, and the host functions that cost most (cProfile). For a cached session turn on 4k of
history, the same split of wall time into kernels and host.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from gpu_common import greedy, random_prompts, write_adapter
from gpu_engine import SCHEMA

from engine import LLM

BATCH, PROMPT_LEN, RANK = 64, 1024, 16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="synthetic:llama3-8b")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--adapter-dir", type=Path, default=Path("/tmp/prof-adapters"))
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    args = ap.parse_args()
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    llm = LLM(args.model, dtype=dtype, device=args.device, max_num_seqs=BATCH,
              max_num_batched_tokens=16384, num_pages=BATCH * 72 + 1200, max_loras=BATCH,
              max_cpu_loras=BATCH, max_lora_rank=RANK)
    eng = llm.engine
    cfg = eng.model_config
    for k in range(8):
        write_adapter(args.adapter_dir / f"f{k}", cfg, RANK, seed=k, device=args.device)
    for k in range(BATCH):
        llm.load_adapter(f"a{k}", args.adapter_dir / f"f{k % 8}")
    prompts = random_prompts(BATCH, PROMPT_LEN, seed=1, vocab=cfg.vocab_size)
    rf = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    cases = {"base": lambda i: greedy(200), "lora_8": lambda i: greedy(200, f"a{i % 8}"),
             "lora_64": lambda i: greedy(200, f"a{i}"),
             "constrained": lambda i: greedy(200, response_format=rf)}
    for name, params in cases.items():
        report[name] = decode_case(eng, prompts, params)
        print(name, json.dumps(report[name], indent=1), flush=True)
    report["session"] = session_case(eng, cfg.vocab_size)
    print("session", json.dumps(report["session"], indent=1), flush=True)
    args.out.write_text(json.dumps(report, indent=1))


def decode_case(eng, prompts, params, steps: int = 12) -> dict:
    rids = [f"p{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for i, (rid, p) in enumerate(zip(rids, prompts, strict=True)):
        eng.add_request(rid, p, params(i))
    while eng.num_waiting or any(r.num_computed_tokens < r.num_tokens - 1
                                 for r in eng.scheduler.running):
        eng.step()
    for _ in range(3):
        eng.step()
    walls = []
    for _ in range(steps):
        sync()
        t = time.perf_counter()
        eng.step()
        sync()
        walls.append(time.perf_counter() - t)
    out = {"step_ms": round(statistics.median(walls) * 1e3, 2)}
    if eng.overlap:  # steps back to back, as the engine runs: the host's work overlaps
        sync()
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        sync()
        out["overlapped_step_ms"] = round((time.perf_counter() - t) / steps * 1e3, 2)
    runner = eng.runner
    if runner.graphs is not None:  # the graph the timed steps replayed, alone
        graph, _ = runner.graphs.graphs[runner.graphs.last_key]
        out["graph_replay_ms"] = round(replay_ms(graph) * 1e3, 2)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        eng.step()
    prof.disable()
    out["host_top"] = host_top(prof, 5)
    graphs, runner.graphs = runner.graphs, None  # the same step, eager: kernels by kind
    try:
        out["eager_kernels"] = kernel_kinds(eng.step)
    finally:
        runner.graphs = graphs
    for rid in rids:
        eng.abort_request(rid)
    return out


def session_case(eng, vocab: int, history: int = 4096, turn: int = 64) -> dict:
    history = min(history, eng.max_model_len - 2 * turn - 2)  # tiny models in a dry run
    def ttft(rid, prompt, session):
        sync()
        t = time.perf_counter()
        eng.add_request(rid, prompt, greedy(1), session_id=session)
        first = None
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.request_id == rid and o.new_token_ids and first is None:
                    first = time.perf_counter() - t, o.new_token_ids[0]
        return first

    def turns(seed):  # a cold request with the history, then the session's next turn
        hist, t1, t2 = random_prompts(3, [history, turn, turn], seed=seed, vocab=vocab)
        cold, tok = ttft(f"c{seed}", hist + t1, f"s{seed}")
        return cold, lambda: ttft(f"w{seed}", hist + t1 + [tok] + t2, f"s{seed}")

    out = defaultdict(list)
    for k in range(3):  # the first pair is a warm-up
        cold, warm = turns(100 + k)
        w, _ = warm()
        if k:
            out["cold_ms"].append(round(cold * 1e3, 1))
            out["warm_ms"].append(round(w * 1e3, 1))
    _, warm = turns(200)
    prof = cProfile.Profile()
    prof.enable()
    warm()
    prof.disable()
    out["host_top"] = host_top(prof, 1)
    _, warm = turns(201)
    out["warm_kernels"] = kernel_kinds(warm)
    for seed in (100, 101, 102, 200, 201):
        eng.release_session(f"s{seed}")
    return dict(out)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def replay_ms(graph, reps: int = 20) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    a.record()
    for _ in range(reps):
        graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / reps


KINDS = (("gemm", ("nvjet", "gemm", "sm90", "cutlass", "splitK")), ("attn_decode", ("_decode",)),
         ("attn_prefill", ("_prefill",)),
         ("lora", ("_bgmv", "_sgmv", "_shrink_kernel", "_expand_kernel")),
         ("fused", ("_rms", "_rope", "_silu")), ("copy_index", ("index", "copy", "Memcpy")))


def kernel_kinds(fn) -> dict:
    """Run `fn` once under torch.profiler: wall ms, summed kernel ms by kind, top kernels."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        fn()
        sync()
        wall = time.perf_counter() - t
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0
               and e.device_type == torch.autograd.DeviceType.CUDA]
    kinds: dict[str, float] = defaultdict(float)
    for e in kernels:
        kind = next((k for k, marks in KINDS if any(m in e.key for m in marks)), "other")
        kinds[kind] += e.device_time_total / 1e3
    kernels.sort(key=lambda e: -e.device_time_total)
    return {"wall_ms": round(wall * 1e3, 2),
            "kernel_ms": round(sum(e.device_time_total for e in kernels) / 1e3, 2),
            "by_kind_ms": {k: round(v, 3) for k, v in sorted(kinds.items())},
            "top": [[e.key[:70], round(e.device_time_total / 1e3, 3), e.count]
                    for e in kernels[:12]]}


def host_top(prof: cProfile.Profile, steps: int, top: int = 25) -> list[str]:
    """The costliest host functions per step, by their own time (ms per step)."""
    stream = io.StringIO()
    stats = pstats.Stats(prof, stream=stream)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [f"{tt / steps * 1e3:7.3f} ms self {ct / steps * 1e3:7.3f} ms cum  "
            f"{Path(fn).name}:{line}({name})" for (fn, line, name), (_, _, tt, ct, _) in rows]


if __name__ == "__main__":
    main()
