"""The engine core in the server's process (`--engine-core thread`) against its own process
(`--engine-core process`, the default), same tree, same run: `/health` latency and streamed
output tokens/s while N clients stream.

`switchboard serve` on `synthetic:tiny` on the CPU (its forward is cheap, so the step loop's
host work and the HTTP side compete for the GIL as they do on a GPU), N concurrent streaming
clients on /v1/completions (benchmarks/gpu_e2e.py's mixed workload), and beside them one
prober that GETs /health every 20 ms over a kept-alive connection. Rounds alternate the two
modes; each server is warmed by a same-shaped workload of other tokens first.

    .venv/bin/python benchmarks/core_process_cpu.py [--rounds 3] [--clients 64]
        [--out benchmarks/results/core_process_cpu.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_cpu import ROOT, serve  # noqa: E402
from gpu_e2e import http_workload, mixed_workload, pct  # noqa: E402
from machine import describe  # noqa: E402

MODES = ("thread", "process")
PROBE_EVERY_S = 0.02


def probe(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            t = time.perf_counter()
            client.get(url + "/health").raise_for_status()
            out.append(time.perf_counter() - t)
            stop.wait(PROBE_EVERY_S)


def one_round(mode: str, flags: list[str], clients: int, requests: int) -> dict:
    proc, url = serve(ROOT, [*flags, "--engine-core", mode], None)
    try:
        vocab = 49152
        warm, warm_out = mixed_workload(requests, vocab, 0.25, seed=8)
        http_workload(url, warm, warm_out, clients)
        prompts, outputs = mixed_workload(requests, vocab, 0.25)
        latencies: list[float] = []
        stop = threading.Event()
        prober = threading.Thread(target=probe, args=(url, stop, latencies))
        prober.start()
        res = http_workload(url, prompts, outputs, clients)
        stop.set()
        prober.join()
    finally:
        proc.terminate()
        proc.wait(30)
    ms = [x * 1e3 for x in latencies]
    return {"tok_s": res["tok_s"], "errors": res["errors"], "ttft_p99_s": res["ttft_p99_s"],
            "health_p50_ms": pct(ms, 0.5), "health_p99_ms": pct(ms, 0.99),
            "health_max_ms": max(ms), "probes": len(ms)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    flags = ["--model", "synthetic:tiny", "--device", "cpu", "--dtype", "float32",
             "--max-num-seqs", str(args.clients), "--max-num-batched-tokens", "2048",
             "--kv-pages", "4000", "--max-queue", "4096", "--max-loras", "0"]
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            r = one_round(mode, flags, args.clients, args.requests)
            runs[mode].append(r)
            print(mode, r, flush=True)

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[mode])

    lines = ["# The engine core in the server's process vs. its own: /health under load", "",
             f"Machine: {describe()}. `benchmarks/core_process_cpu.py --rounds {args.rounds} "
             f"--clients {args.clients}`: `synthetic:tiny` on the CPU, {args.clients} streaming "
             f"clients, {args.requests} requests on /v1/completions, /health probed every "
             f"{PROBE_EVERY_S * 1e3:g} ms meanwhile; {args.rounds} alternating rounds "
             "(medians of the rounds).", "",
             "| | --engine-core thread | --engine-core process | process / thread |",
             "|---|---|---|---|"]
    for key, label in (("health_p50_ms", "/health p50 (ms)"), ("health_p99_ms",
                       "/health p99 (ms)"), ("health_max_ms", "/health max (ms)"),
                       ("ttft_p99_s", "TTFT p99 (s)"), ("tok_s", "output tokens/s")):
        t, p = med("thread", key), med("process", key)
        lines.append(f"| {label} | {t:.3g} | {p:.3g} | {p / t:.3f} |")
    errors = {m: sum(r["errors"] for r in runs[m]) for m in MODES}
    lines += ["", f"Errors: thread {errors['thread']}, process {errors['process']}. The "
              "clients, the server and the core share this machine's cores."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
