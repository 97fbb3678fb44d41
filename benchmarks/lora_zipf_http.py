"""The mission's workload through HTTP: many tenants' adapters, Zipf popularity, against the
same traffic on the base model, same run.

`--tenants` tenants upload `--adapters` PEFT adapters between them over `POST /v1/adapters`
(ranks 8, 16, 32, 64 in turn; every other one attention-only, the rest on all seven
projections; random weights). Then `--clients` streaming clients send sampled chat requests
(temperature 0.8, top_p 0.95, `ignore_eos`), each as its tenant: a request's adapter follows a
Zipf(1.0) popularity over the adapters, and `--base-share` of them name the base model;
prompts of 256-2,048 tokens, outputs of 64-256 (both times `--scale`). Rounds alternate that
traffic and the same requests all on the base model (each round with prompts of its own, so
no round reads another's prefix cache). Then the cold start of an adapter: a first request to
an adapter in no device slot nor the host cache (the five uploaded first, evicted since), minus
a request's time to first token once the adapter is resident (medians).

    .venv/bin/python benchmarks/lora_zipf_http.py [--model synthetic:tiny] [--adapters 100]
        [--clients 16] [--requests 64] [--out benchmarks/results/lora_zipf_http_cpu.md]
    # on a GPU, no other flag: --model synthetic:llama3-8b --adapters 1000 --clients 128 \\
    #     --requests 512 --scale 1
    # (the 8B's thousand adapters are about 100 GB of files in the server's store; the 1B's,
    # --model synthetic:llama3-1b, 22.6 GB: benchmarks/results/lora_zipf1000_h200.md)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_e2e import Server, pct  # noqa: E402
from machine import describe  # noqa: E402

from engine.config import ModelConfig, default_cache_dir  # noqa: E402
from engine.runner.loader import resolve_model_dir  # noqa: E402
from lora.validate import projection_dims  # noqa: E402

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = [*ATTN, "gate_proj", "up_proj", "down_proj"]
RANKS = (8, 16, 32, 64)
WORDS = ("agent tool call result file line error test build deploy cache token model server "
         "request stream queue batch kernel memory page prefix session tenant adapter schema "
         "value field index report retry limit config path module class method").split()


# Random numbers the adapters' tensors are cut from, at random offsets: drawing 100 GB of
# normals for a thousand 8B adapters would take the client longer than the run.
NORMALS = np.random.default_rng(0).standard_normal(2**24).astype(np.float16)


def write_adapter(folder: Path, base: ModelConfig, rank: int, targets: list[str],
                  seed: int) -> None:
    """A random PEFT LoRA of `rank` on `targets`, in PEFT's file layout (float16, as PEFT
    saves a half-precision fine-tune)."""
    rng = np.random.default_rng(seed)
    tensors = {}
    dims = projection_dims(base)

    def normal(rows: int, cols: int, scale: float) -> np.ndarray:
        start = int(rng.integers(0, NORMALS.size - rows * cols))
        return (NORMALS[start : start + rows * cols] * np.float16(scale)).reshape(rows, cols)

    for i in range(base.num_layers):
        for proj in targets:
            fan_in, fan_out = dims[proj]
            key = f"base_model.model.model.layers.{i}.{'self_attn' if proj in ATTN else 'mlp'}"
            tensors[f"{key}.{proj}.lora_A.weight"] = normal(rank, fan_in, fan_in**-0.5)
            tensors[f"{key}.{proj}.lora_B.weight"] = normal(fan_out, rank, 0.01)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}))


def zipf_weights(n: int, s: float = 1.0) -> list[float]:
    return [1 / (i + 1) ** s for i in range(n)]


def workload(adapters: list[tuple[str, str]], n: int, seed: int, scale: float,
             base_share: float) -> list[tuple[str, str | None, str, int]]:
    """(tenant, adapter or None, prompt, max_tokens) of n requests; adapters by Zipf(1.0) over
    a seed-independent popularity order (the same adapters are hot in every round)."""
    rng = random.Random(seed)
    weights = zipf_weights(len(adapters))
    out = []
    for _ in range(n):
        tenant, name = rng.choices(adapters, weights)[0]
        text = " ".join(rng.choices(WORDS, k=int(rng.randint(256, 2048) * scale)))
        out.append((tenant, None if rng.random() < base_share else name, text,
                    max(8, int(rng.randint(64, 256) * scale))))
    return out


async def chat(client: httpx.AsyncClient, model: str, tenant: str, text: str,
               max_tokens: int) -> dict:
    try:
        return await _chat(client, model, tenant, text, max_tokens)
    except httpx.HTTPError as e:  # counted, as a status error is: the run goes on
        return {"error": f"{type(e).__name__}: {e}"}


async def _chat(client: httpx.AsyncClient, model: str, tenant: str, text: str,
                max_tokens: int) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.8, "top_p": 0.95,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": text}]}
    t = time.perf_counter()
    first, tokens = None, 0
    async with client.stream("POST", "/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer sk-{tenant}"}) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            d = json.loads(line[6:])
            if first is None and any((c.get("delta") or {}).get("content")
                                     for c in d.get("choices", [])):
                first = time.perf_counter()
            tokens = (d.get("usage") or {}).get("completion_tokens") or tokens
    return {"ttft": (first or time.perf_counter()) - t, "tokens": tokens}


async def one_round(url: str, base_model: str, work, clients: int, on_base: bool) -> dict:
    gate = asyncio.Semaphore(clients)
    async with httpx.AsyncClient(base_url=url, timeout=1800,
                                 limits=httpx.Limits(max_connections=clients + 8)) as client:
        async def one(tenant: str, adapter: str | None, text: str, m: int) -> dict:
            async with gate:
                model = base_model if on_base or adapter is None else adapter
                return await chat(client, model, tenant, text, m)
        start = time.perf_counter()
        res = await asyncio.gather(*(one(*w) for w in work))
        wall = time.perf_counter() - start
    ok = [r for r in res if "error" not in r]
    if len(ok) < len(res):
        print("errors:", [r["error"] for r in res if "error" in r][:3], flush=True)
    return {"tok_s": sum(r["tokens"] for r in ok) / wall, "errors": len(res) - len(ok),
            "ttft_p50_s": pct([r["ttft"] for r in ok], 0.5),
            "ttft_p99_s": pct([r["ttft"] for r in ok], 0.99)}


# What the engine did in a round (deltas of /metrics), to tell why one traffic ran faster.
ENGINE_SERIES = ("switchboard_engine_steps", "switchboard_engine_step_seconds",
                 "switchboard_engine_loop_seconds", "switchboard_prefix_cache_hit_tokens",
                 "switchboard_prefix_cache_miss_tokens", "switchboard_preemptions")


def engine_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The series of `ENGINE_SERIES` that moved, as {series without the prefix: change}, and
    the mean step time by kind (ms)."""
    out = {k.removeprefix("switchboard_"): round(v - before.get(k, 0.0), 3)
           for k, v in after.items() if k.startswith(ENGINE_SERIES) and v != before.get(k)}
    for key, n in list(out.items()):
        if key.startswith("engine_steps_total") and n:
            kind = key.removeprefix("engine_steps_total")
            out[f"step_ms{kind}"] = round(out.get(f"engine_step_seconds_total{kind}", 0.0)
                                          / n * 1e3, 2)
    return out


def upload(url: str, tenant: str, name: str, folder: Path) -> None:
    files = [("files", (p.name, p.read_bytes())) for p in sorted(folder.iterdir())]
    r = httpx.post(url + "/v1/adapters", data={"name": name}, files=files, timeout=300,
                   headers={"Authorization": f"Bearer sk-{tenant}"})
    r.raise_for_status()


def cold_start(url: str, adapters: list[tuple[str, str]], scale: float) -> dict:
    """TTFT of first requests to `adapters` (each in no slot nor the host cache) and of the same
    kind of request to each once it is resident (a new prompt: no prefix-cache hit); medians."""
    async def go() -> list[tuple[float, float]]:
        out = []
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            for k, (tenant, adapter) in enumerate(adapters):
                work = workload([(tenant, adapter)], 2, seed=4242 + k, scale=scale,
                                base_share=0)
                cold = await chat(client, adapter, tenant, work[0][2], 8)
                warm = await chat(client, adapter, tenant, work[1][2], 8)
                out.append((cold["ttft"], warm["ttft"]))
        return out
    times = asyncio.run(go())
    cold, warm = (statistics.median(t[i] for t in times) for i in (0, 1))
    return {"cold_ttft_ms": round(cold * 1e3, 1), "warm_ttft_ms": round(warm * 1e3, 1),
            "adapter_cold_ttft_ms": round(
                statistics.median(c - w for c, w in times) * 1e3, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="synthetic:tiny")
    ap.add_argument("--flags", default="", help="more `switchboard serve` flags")
    ap.add_argument("--tenants", type=int, default=10)
    ap.add_argument("--adapters", type=int, default=100)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of each traffic")
    ap.add_argument("--base-share", type=float, default=0.2)
    ap.add_argument("--scale", type=float, default=0.25, help="prompt and output lengths")
    ap.add_argument("--upload-clients", type=int, default=4,
                    help="adapters written and uploaded at once")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    base = ModelConfig.from_dir(resolve_model_dir(args.model, default_cache_dir()))
    tmp = Path(tempfile.mkdtemp(prefix="lora-zipf-"))
    tenants = [f"t{i}" for i in range(args.tenants)]
    (tmp / "keys.json").write_text(json.dumps({f"sk-{t}": t for t in tenants}))
    adapters = [(tenants[i % args.tenants], f"a{i}") for i in range(args.adapters)]

    def write_and_upload(url: str, i: int) -> int:
        """One adapter's folder written, uploaded, and deleted (the server keeps its copy):
        the client's disk holds a few adapters at a time, not a thousand."""
        tenant, name = adapters[i]
        write_adapter(tmp / name, base, RANKS[i % len(RANKS)], ATTN if i % 2 else ALL, i)
        upload(url, tenant, name, tmp / name)
        size = sum(f.stat().st_size for f in (tmp / name).iterdir())
        shutil.rmtree(tmp / name)
        return size

    per_tenant = -(-args.adapters // args.tenants)
    flags = ["--model", args.model, "--api-keys", str(tmp / "keys.json"), "--public-metrics",
             "--adapter-dir", str(tmp / "store"), "--max-adapters-per-tenant",
             str(per_tenant), *shlex.split(args.flags)]
    runs: dict[str, list[dict]] = {"lora": [], "base": []}
    with Server(flags, api_key=f"sk-{tenants[0]}") as srv:
        t = time.perf_counter()
        # In order, a few at a time: the first ones are the coldest (`cold_start`).
        with ThreadPoolExecutor(args.upload_clients) as pool:
            uploaded = sum(pool.map(lambda i: write_and_upload(srv.url, i),
                                    range(args.adapters)))
        upload_s = time.perf_counter() - t
        print(f"uploaded {args.adapters} adapters ({uploaded / 1e9:.1f} GB) in {upload_s:.1f} s",
              flush=True)
        # Popularity: the last uploaded are the hottest (the first ones have left the host
        # cache since, and stay cold for `cold_start`).
        hot = adapters[::-1]
        warm = workload(hot, args.clients, seed=999, scale=args.scale,
                        base_share=args.base_share)
        for on_base in (False, True):
            asyncio.run(one_round(srv.url, srv.model, warm, args.clients, on_base))
        for r in range(args.rounds):
            order = ["lora", "base"] if r % 2 == 0 else ["base", "lora"]
            for k, name in enumerate(order):
                work = workload(hot, args.requests, seed=2 * r + k, scale=args.scale,
                                base_share=args.base_share)
                before = srv.metrics()
                res = asyncio.run(one_round(srv.url, srv.model, work, args.clients,
                                            on_base=name == "base"))
                runs[name].append(res)
                print(name, {k: round(v, 3) for k, v in res.items()}, flush=True)
                print("  engine:", engine_deltas(before, srv.metrics()), flush=True)
        cold = cold_start(srv.url, adapters[:5], args.scale)  # uploaded first: cold
        print(cold, flush=True)
        metrics = srv.metrics()
        resident = {k: v for k, v in metrics.items() if k.startswith("switchboard_adapter")}
        print({k: v for k, v in metrics.items() if k.startswith("switchboard_connections")},
              flush=True)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    ratio = med("lora", "tok_s") / med("base", "tok_s")
    ttft99 = med("lora", "ttft_p99_s") / med("base", "ttft_p99_s")
    errors = sum(r["errors"] for rs in runs.values() for r in rs)
    lines = [f"# {args.adapters} adapters, Zipf(1.0) traffic, through HTTP ({describe()})", "",
             f"`benchmarks/lora_zipf_http.py --model {args.model} --flags '{args.flags}' "
             f"--tenants {args.tenants} --adapters {args.adapters} --clients {args.clients} "
             f"--requests {args.requests} --rounds {args.rounds} --base-share "
             f"{args.base_share} --scale {args.scale}`. Medians of the rounds.", "",
             "| traffic | output tok/s | TTFT p50 s | TTFT p99 s |", "|---|---:|---:|---:|"]
    for name in ("lora", "base"):
        lines.append(f"| {name} | {med(name, 'tok_s'):,.1f} | {med(name, 'ttft_p50_s'):.3f} "
                     f"| {med(name, 'ttft_p99_s'):.3f} |")
    lines += ["", f"- `lora_zipf{args.adapters}_vs_base` = **{ratio:.3f}** (output tokens/s); "
              f"TTFT p99 {ttft99:.2f}x the base run's; {errors} errors.",
              f"- Upload of {args.adapters} adapters ({uploaded / 1e9:.1f} GB of files, "
              f"written and uploaded by {args.upload_clients} clients at once): {upload_s:.1f} s "
              f"({uploaded / upload_s / 1e6:.0f} MB/s).",
              f"- `adapter_cold_ttft_ms` = **{cold['adapter_cold_ttft_ms']}** (median over 5 "
              f"adapters of cold minus warm; cold {cold['cold_ttft_ms']} ms, warm "
              f"{cold['warm_ttft_ms']} ms).",
              f"- Adapter metrics at the end: `{json.dumps(resident)}`."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
