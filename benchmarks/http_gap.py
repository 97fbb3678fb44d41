"""Where the server loses to the offline engine (`http_vs_offline_c128`): the engine's step time
by kind, offline and through `switchboard serve`, on the same workload, same run.

The offline engine runs the workload (all requests submitted at once) some rounds; then, one
fresh server per round (a cold prefix cache, warmed by a same-shaped workload of other tokens),
N concurrent clients send it on /v1/completions, streamed and not streamed in turn. Each round
reports output tokens/s and the engine's steps by kind with their mean wall ms
(`LLMEngine.step_times`; the server's from /metrics). Steps of the same kind and count that
take longer in the server are host work slowed by what else the server process runs: its
event loop and request threads share the GIL with the engine thread.

    .venv/bin/python benchmarks/http_gap.py [--device cpu --threads 1] [--rounds 2]
        [--out benchmarks/results/http_gap_cpu.md]
    python3 benchmarks/http_gap.py --device cuda --model synthetic:llama3-8b --requests 256 \\
        --scale 1 --clients 128 [--piecewise both]   # the suite's http workload, on a GPU

`--piecewise both` runs every round with and without the piecewise graphs of steps that
prefill (engine/runner/piecewise_graphs.py): offline on one engine, through one server each way.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import greedy  # noqa: E402
from gpu_e2e import (  # noqa: E402
    Server,
    http_workload,
    metric_steps,
    mixed_workload,
    offline_tok_s,
    step_kinds,
)
from machine import describe  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


async def unstreamed(url: str, prompts, outputs, concurrency: int) -> int:
    """The workload without streaming (one response body per request): output tokens/s."""
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def one(p, m) -> int:
            async with gate:
                r = await client.post("/v1/completions", json={
                    "model": model, "prompt": p, "max_tokens": m, "temperature": 0,
                    "ignore_eos": True})
                r.raise_for_status()
                return r.json()["usage"]["completion_tokens"]
        t = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(p, m) for p, m in zip(prompts, outputs,
                                                                        strict=True))))
        return round(tokens / (time.perf_counter() - t))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="synthetic:tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads on a CPU (1: the engine's compute keeps to one core, "
                         "so the rest is the server's and the clients')")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--scale", type=float, default=0.25, help="prompt and output lengths x")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--piecewise", choices=("on", "off", "both"), default="on",
                    help="replay steps that prefill as piecewise CUDA graphs (engine config "
                    "`piecewise_graphs`); both: every round once each way (GPU only)")
    ap.add_argument("--engine-core", choices=("process", "thread", "both"), default="process",
                    help="the servers' `--engine-core`; both: every round once each way")
    ap.add_argument("--api-servers", type=int, default=1, help="the servers' `--api-servers` "
                    "(above 1 also needs --redis-url)")
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--client-processes", type=int, default=1,
                    help="processes the streaming clients run in (the suite's c128: 4)")
    ap.add_argument("--streamed-only", action="store_true", help="skip the unstreamed rows")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    machine = describe()  # before the engine sets torch's threads
    cuda = args.device == "cuda"
    dtype = "bfloat16" if cuda else "float32"
    seqs, pages = args.clients, 18000 if cuda else 4000
    engine = {"max_num_seqs": seqs, "max_num_batched_tokens": 8192 if cuda else 2048,
              "num_pages": pages} | ({} if cuda else {"threads": args.threads})
    flags = ["--model", args.model, "--device", args.device, "--dtype", dtype,
             "--max-num-seqs", str(seqs), "--max-num-batched-tokens",
             str(engine["max_num_batched_tokens"]), "--kv-pages", str(pages),
             "--max-queue", "4096", "--max-loras", "0",
             "--api-servers", str(args.api_servers)] + \
        ([] if cuda else ["--threads", str(args.threads)]) + \
        (["--redis-url", args.redis_url] if args.redis_url else [])

    from engine import LLM

    llm = LLM(args.model, dtype=dtype, device=args.device, **engine)
    vocab = llm.engine.model_config.vocab_size
    prompts, outputs = mixed_workload(args.requests, vocab, args.scale)
    rows: list[tuple[str, int, dict, tuple[float, float] | None]] = []
    runner = llm.engine.runner
    pieces = runner.piecewise  # set aside for the rounds without them
    ways = ("on", "off") if args.piecewise == "both" else (args.piecewise,)
    for way in ways:  # warm-up
        runner.piecewise = pieces if way == "on" else None
        offline_tok_s(llm, prompts, outputs, lambda i, m: greedy(m), args.device)
    for _ in range(args.rounds):
        for way in ways:
            runner.piecewise = pieces if way == "on" else None
            before = {k: tuple(v) for k, v in llm.engine.step_times.items()}
            tok = offline_tok_s(llm, prompts, outputs, lambda i, m: greedy(m), args.device)
            rows.append((label("offline", way, cuda), round(tok),
                         step_kinds(before, llm.engine.step_times), None))
            print(*rows[-1], flush=True)
    del llm, runner, pieces
    gc.collect()
    if cuda:  # the servers need the memory this process's allocator keeps
        import torch

        torch.cuda.empty_cache()
    cores = ("process", "thread") if args.engine_core == "both" else (args.engine_core,)
    modes = ("streamed",) if args.streamed_only else ("streamed", "not streamed")
    procs = args.client_processes
    for _ in range(args.rounds):
        for way, core, mode in itertools.product(ways, cores, modes):
            off = ["--no-piecewise-graphs"] if way == "off" else []
            with Server([*flags, *off, "--engine-core", core]) as srv:
                warm, warm_out = mixed_workload(args.requests, vocab, args.scale, seed=8)
                http_workload(srv.url, warm, warm_out, args.clients, procs)
                before = srv.metrics()
                if mode == "streamed":
                    res = http_workload(srv.url, prompts, outputs, args.clients, procs)
                    tok, ttft = res["tok_s"], (res["ttft_p50_s"], res["ttft_p99_s"])
                else:
                    tok = asyncio.run(unstreamed(srv.url, prompts, outputs, args.clients))
                    ttft = None
                name = label(mode, way, cuda) + ("" if len(cores) == 1 else f", core {core}")
                rows.append((name, tok, step_kinds(metric_steps(before),
                                                   metric_steps(srv.metrics())), ttft))
                print(*rows[-1], flush=True)
    if args.out:
        args.out.write_text(render(args, machine, rows))


def label(mode: str, way: str, cuda: bool) -> str:
    """A row's name: the run and, on a GPU, whether steps that prefill replayed pieces."""
    return f"{mode}, pieces {way}" if cuda else mode


def render(args: argparse.Namespace, machine: str,
           rows: list[tuple[str, int, dict, tuple[float, float] | None]]) -> str:
    def base(mode: str) -> float:  # the offline median of the same way (pieces on or off)
        way = mode.split(", ")[1] if ", pieces" in mode else ""
        return statistics.median(t for m, t, _, _ in rows
                                 if m.startswith("offline") and m.endswith(way))

    kinds = sorted({k for _, _, steps, _ in rows for k in steps})
    lines = [
        "# The engine's steps offline and through the server (`benchmarks/http_gap.py`)", "",
        f"Machine: {machine}. `{' '.join(sys.argv[1:])}`: `{args.model}` on "
        f"{args.device}, {args.requests} requests (`gpu_e2e.mixed_workload`, lengths x "
        f"{args.scale}), {args.clients} concurrent clients; one fresh server per row.", "",
        "| run | output tok/s | ÷ offline (median, same pieces) | TTFT p50 / p99 s | "
        + " | ".join(f"{k} steps · ms" for k in kinds) + " |",
        "|---|---|---|---|" + "---|" * len(kinds),
    ]
    for mode, tok, steps, ttft in rows:
        cells = [f"{steps[k]['steps']} · {steps[k]['ms']}" if k in steps else "-" for k in kinds]
        t = f"{ttft[0]} / {ttft[1]}" if ttft else "-"
        lines.append(f"| {mode} | {tok} | {tok / base(mode):.3f} | {t} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
