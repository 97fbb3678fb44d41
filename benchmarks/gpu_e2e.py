"""The GPU suite's end-to-end worker: what users send, not one timed decode round.

Sections (each records its figures, or its error, as one JSON line in --out):
  setup            load the model, measure copy bandwidth and the bf16 matmul rate;
  sampled          a mixed offline workload (prompts 64-1024 tokens, outputs 64-256, all
                   submitted at once), greedy vs sampled (T=0.8, top_p 0.9, top_k 50, a seed
                   per request): output tokens/s and `sampled_vs_greedy_e2e`; plus one timed
                   decode round at batch 64, 1k contexts, per sampling mode (ms per step);
  long_ctx         decode steps over 16 x 7.9k and 64 x 4k contexts: (weight + KV bytes) ÷
                   copy bandwidth ÷ step time (`long_ctx_roofline_16x8k`, `..._64x4k`);
  prefill          64 x 2,048-token prompts: prompt tokens/s x model FLOPs ÷ the matmul rate
                   (`prefill_mfu`);
  http             the greedy mixed workload through `switchboard serve` with 128 concurrent
                   streaming clients on /v1/completions (from 4 client processes) ÷ the
                   offline engine on the same workload (`http_vs_offline_c128`), best of two
                   rounds each, TTFT p50/p99;
  agent_trace      32 concurrent multi-turn sessions through HTTP: each turn appends a tool
                   result and asks again (contexts grow toward 8k tokens), sampled, tool calls
                   and JSON schemas on some turns, 8 adapters;
  http_c512        512 requests from 512 streaming clients through `switchboard serve
                   --api-servers 2` (over a local redis-server) ÷ the offline engine on the
                   same 512 requests (`http_vs_offline_c512`), TTFT p50/p99.

The http section also reports the offline engine fed the way its clients send
(`pools_tok_s`): each client process's share, `concurrency` at a time, the next request
submitted as soon as one finishes, with no HTTP between: what a server with no overhead
would reach on that load, so `http_vs_offline_pools_c128` is the server's own share of the gap.

Run by benchmarks/gpu_suite.py; `--device cpu --quick` runs every section small on a CPU
(a check of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from gpu_common import (
    Recorder,
    copy_bandwidth,
    decode_round,
    greedy,
    kv_bytes_per_token,
    random_prompts,
    sync,
    timed_generate,
    weight_bytes,
    write_adapter,
)
from redis_server import RedisServer

from engine import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
RANK = 16
CLIENT_PROCESSES = 4  # the HTTP section's load generator (see there)
TOOLS = [{"type": "function", "function": {"name": "search_logs", "parameters": {
    "type": "object", "properties": {"service": {"type": "string", "maxLength": 16},
                                     "minutes": {"type": "integer"}},
    "required": ["service", "minutes"], "additionalProperties": False}}}]
SCHEMA = {"type": "object", "properties": {"cause": {"type": "string", "maxLength": 40},
                                           "severity": {"type": "integer"}},
          "required": ["cause", "severity"], "additionalProperties": False}


def sampled(i: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, top_k=50, seed=i,
                          ignore_eos=True)


def temp_only(i: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.8, ignore_eos=True)


def mixed_workload(n: int, vocab: int, scale: float = 1.0,
                   seed: int = 7) -> tuple[list[list[int]], list[int]]:
    """`n` prompts of 64-1024 random tokens and output lengths of 64-256 (seeded)."""
    rng = random.Random(seed)
    lengths = [max(8, int(rng.randint(64, 1024) * scale)) for _ in range(n)]
    outputs = [max(4, int(rng.randint(64, 256) * scale)) for _ in range(n)]
    return random_prompts(n, lengths, seed=seed, vocab=vocab), outputs


def offline_tok_s(llm: LLM, prompts, outputs, make, device: str) -> float:
    """Output tokens/s of one offline run; it starts from an empty prefix cache, as the HTTP
    run does (a repeated workload would otherwise skip its prefills)."""
    params = [make(i, m) for i, m in enumerate(outputs)]
    outs, seconds = timed_generate(llm, prompts, params, device)
    return sum(len(o.token_ids) for o in outs) / seconds


def offline_pools_tok_s(llm: LLM, prompts, outputs, pools: int, concurrency: int,
                        device: str) -> float:
    """Output tokens/s of the offline engine fed as `http_workload` sends: pool k holds
    requests k, k + pools, ... and keeps `concurrency // pools` of them in the engine,
    submitting its next one as soon as one of its own finishes (between two steps)."""
    eng = llm.engine
    queues = [list(range(k, len(prompts), pools)) for k in range(pools)]
    owner: dict[str, int] = {}

    def submit(k: int) -> None:
        if queues[k]:
            i = queues[k].pop(0)
            eng.add_request(f"pool-{i}", prompts[i], greedy(outputs[i]))
            owner[f"pool-{i}"] = k

    eng.reset_prefix_cache()
    sync(device)
    t, tokens = time.perf_counter(), 0
    for k in range(pools):
        for _ in range(concurrency // pools):
            submit(k)
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                tokens += out.num_output_tokens
                submit(owner.pop(out.request_id))
    sync(device)
    return tokens / (time.perf_counter() - t)


def matmul_rate(device: str, n: int = 8192) -> float:
    """bf16 matmul FLOP/s (median of 10 products of n x n)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    n = n if device == "cuda" else 512
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        sync(device)
        t = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times)


def model_flops_per_token(cfg, context: int) -> float:
    """Forward FLOPs of one prompt token at `context` tokens of causal attention (on average
    half of a prompt of that length): 2 x the matrix parameters (the lm_head is computed for the
    last token only, so left out) plus QK^T and PV."""
    h, layers = cfg.hidden_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    matrices = layers * (h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size)
    attention = layers * 2 * 2 * q * context / 2
    return 2 * matrices + attention


def sizes(quick: bool) -> tuple[int, int, int]:
    """The suite's sequences, KV pages and tokens a step."""
    return (16, 1200, 1024) if quick else (128, 18000, 8192)


def tuned_serve_flags(model: str, dev: str, store: Path, quick: bool = False) -> list[str]:
    """The flags the suite's server runs with (`default_serve.py` compares no flags)."""
    seqs, pages, step = sizes(quick)
    return ["--model", model, "--device", dev,
            "--dtype", "bfloat16" if dev == "cuda" else "float32",
            "--max-num-seqs", str(seqs), "--max-num-batched-tokens", str(step),
            "--kv-pages", str(pages), "--max-loras", "8", "--max-cpu-loras", "8",
            "--max-lora-rank", str(RANK), "--adapter-dir", str(store), "--max-queue", "4096",
            "--session-kv-pages", str(pages // 2)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="synthetic:llama3-8b")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget", type=float, default=240.0)
    ap.add_argument("--adapter-dir", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="small sizes (a check of the script)")
    args = ap.parse_args()
    rec, dev, quick = Recorder(args.out, args.budget), args.device, args.quick
    n_requests, scale = (32, 0.125) if quick else (256, 1.0)
    long_ctx = [(4, 448), (8, 192)] if quick else [(16, 7936), (64, 4032)]
    prefill_n, prefill_len = (8, 128) if quick else (64, 2048)
    seqs, pages, step = sizes(quick)
    dtype = "bfloat16" if dev == "cuda" else "float32"
    flags = {"max_num_seqs": seqs, "max_num_batched_tokens": step, "num_pages": pages}

    with rec.section("setup", 90) as s:
        t = time.monotonic()
        llm = LLM(args.model, dtype=dtype, device=dev, **flags)
        cfg = llm.engine.model_config
        bw = copy_bandwidth() if dev == "cuda" else 1e10
        s.result.update(load_s=round(time.monotonic() - t, 1), copy_bw=bw,
                        matmul_flops=matmul_rate(dev), weight_bytes=weight_bytes(llm.engine.model),
                        kv_bytes_per_token=kv_bytes_per_token(cfg, 2 if dev == "cuda" else 4))
        setup = s.result
    vocab = cfg.vocab_size
    prompts, outputs = mixed_workload(n_requests, vocab, scale)

    offline: dict[str, float] = {}
    with rec.section("sampled", 120) as s:
        # Three rounds each, alternating; the first warms up (graphs, kernels), the best of
        # the other two counts (a round's rate varies by a few percent on the same machine).
        runs: dict[str, list[float]] = {"greedy": [], "sampled": []}
        for _ in range(3):
            before = {k: tuple(v) for k, v in llm.engine.step_times.items()}
            runs["greedy"].append(offline_tok_s(llm, prompts, outputs,
                                                lambda i, m: greedy(m), dev))
            # The engine's steps by kind, for the http section's (the server's) to compare.
            s.result["greedy_steps"] = step_kinds(before, llm.engine.step_times)
            runs["sampled"].append(offline_tok_s(llm, prompts, outputs, sampled, dev))
        g = offline["greedy"] = max(runs["greedy"][1:])
        x = max(runs["sampled"][1:])
        s.result.update(greedy_tok_s=round(g), sampled_tok_s=round(x),
                        sampled_vs_greedy_e2e=round(x / g, 3),
                        first_round_tok_s={k: round(v[0]) for k, v in runs.items()})
        batch = random_prompts(64 if not quick else 8, 1024 if not quick else 64, 3, vocab)
        for name, make in (("greedy", lambda i, m: greedy(m)), ("temperature", temp_only),
                           ("sampled", sampled)):
            r = decode_round(llm, batch, make, steps=16 if not quick else 4)
            s.result[f"step_ms_b64_{name}"] = round(r.step_s * 1e3, 2)

    with rec.section("long_ctx", 90) as s:
        # The ceiling is the best copy rate seen: one measurement can catch the clocks low.
        bw = max(bw, copy_bandwidth()) if dev == "cuda" else bw
        s.result["copy_bw"] = bw
        for n, length in long_ctx:
            r = decode_round(llm, random_prompts(n, length, 11, vocab),
                             lambda i, m: greedy(m), steps=16 if not quick else 4)
            moved = setup["weight_bytes"] + setup["kv_bytes_per_token"] * r.mean_context * n
            key = f"long_ctx_roofline_{n}x{round(length / 1000)}k"
            s.result[key] = round(moved / bw / r.step_s, 3)
            s.result[key.replace("roofline", "step_ms")] = round(r.step_s * 1e3, 2)

    with rec.section("prefill", 60) as s:
        batch = random_prompts(prefill_n, prefill_len, 5, vocab)
        llm.generate(batch[:4], [greedy(1)] * 4)  # warm-up
        llm.engine.reset_prefix_cache()
        sync(dev)
        t = time.perf_counter()
        llm.generate(batch, [greedy(1)] * prefill_n)
        sync(dev)
        tok_s = prefill_n * prefill_len / (time.perf_counter() - t)
        flops = model_flops_per_token(cfg, prefill_len)
        s.result.update(prompt_tok_s=round(tok_s),
                        prefill_mfu=round(tok_s * flops / setup["matmul_flops"], 3))

    with rec.section("offline_pools", 30) as s:
        offline["pools"] = offline_pools_tok_s(llm, prompts, outputs, CLIENT_PROCESSES, 128,
                                               dev)
        s.result["pools_tok_s"] = round(offline["pools"])
    n512 = 64 if quick else 512
    prompts512, outputs512 = mixed_workload(n512, vocab, scale, seed=11)
    with rec.section("offline_c512", 60) as s:  # the best of two rounds, as for c128
        offline["c512"] = max(offline_tok_s(llm, prompts512, outputs512,
                                            lambda i, m: greedy(m), dev) for _ in range(2))
        s.result["greedy_tok_s"] = round(offline["c512"])

    adapters = []
    for k in range(8):
        folder = args.adapter_dir / f"e2e{k}"
        write_adapter(folder, cfg, RANK, seed=50 + k, device=dev)
        adapters.append(folder)
    del llm
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()

    serve_flags = tuned_serve_flags(args.model, dev, args.adapter_dir / "store", quick)
    with Server(serve_flags) as srv:
        with rec.section("http", 120) as s:
            # Warm-up, untimed: a workload of the same shapes from other random tokens (not the
            # measured prompts' prefixes), so the Triton kernels the run specializes are
            # compiled first, as the offline figure's first round compiles them for it. Then the
            # best of two rounds, as offline: the second sends prompts of the same lengths made
            # of other tokens, since the server keeps the first round's KV in its prefix cache
            # (the offline rounds empty theirs). The clients run in CLIENT_PROCESSES processes:
            # one Python process parsing ~5k SSE events a second spends 0.6-0.7 of a core on it
            # and adds its own delay to every TTFT (H100 host, same server and prompts: TTFT p50
            # 0.37 s from one process, 0.14-0.18 s from two to eight; tokens/s alike).
            warm, warm_outputs = mixed_workload(n_requests, vocab, scale, seed=8)
            s.result["warm_tok_s"] = http_workload(srv.url, warm, warm_outputs, 128,
                                                   CLIENT_PROCESSES)["tok_s"]
            fresh = random_prompts(n_requests, [len(p) for p in prompts], seed=9, vocab=vocab)
            rounds = []
            for ps in (prompts, fresh):
                before = srv.metrics()
                rounds.append(http_workload(srv.url, ps, outputs, 128, CLIENT_PROCESSES))
                rounds[-1]["server"] = queueing(before, srv.metrics())
            res = max(rounds, key=lambda r: r["tok_s"])
            s.result.update(res, rounds=[{k: r[k] for k in ("tok_s", "ttft_p50_s", "ttft_p99_s",
                                                            "server")} for r in rounds])
            if "greedy" in offline:
                s.result["http_vs_offline_c128"] = round(res["tok_s"] / offline["greedy"], 3)
            if "pools" in offline:
                s.result["http_vs_offline_pools_c128"] = round(res["tok_s"] / offline["pools"],
                                                               3)
        with rec.section("agent_trace", 120) as s:
            names = [srv.upload(f"tenant-bot-{k}", f) for k, f in enumerate(adapters)]
            turns, max_ctx = (3, 1024) if quick else (64, 8192)
            before = srv.metrics()
            s.result.update(asyncio.run(agent_trace(srv.url, names, 8 if quick else 32, turns,
                                                    max_ctx, s.left)))
            s.result["server"] = queueing(before, srv.metrics())
    with rec.section("http_c512", 150) as s, RedisServer() as redis, Server(
            serve_flags + ["--api-servers", "2", "--redis-url", redis.url]) as srv:
        # Warm-up as for c128 (other tokens, same shapes), then one round.
        warm, warm_outputs = mixed_workload(n512 // 4, vocab, scale, seed=12)
        http_workload(srv.url, warm, warm_outputs, 128, CLIENT_PROCESSES)
        res = http_workload(srv.url, prompts512, outputs512, n512, CLIENT_PROCESSES)
        s.result.update(res)
        if "c512" in offline:
            s.result["http_vs_offline_c512"] = round(res["tok_s"] / offline["c512"], 3)


class Server:
    """`switchboard serve` in a subprocess on a free port."""

    def __init__(self, flags: list[str], api_key: str | None = None):
        self.flags = flags
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def __enter__(self) -> Server:
        self.log = Path(tempfile.mkstemp(suffix=".log")[1])
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gateway.main", "serve", "--port", "0", "--log-level",
                 "warning", *self.flags], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path})
        deadline = time.monotonic() + 180
        while not (m := re.search(r"serving \S+ at (http://\S+)", self.log.read_text())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"serve did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.5)
        self.url = m.group(1)
        models = httpx.get(self.url + "/v1/models", headers=self.headers).json()
        self.model = models["data"][0]["id"]
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def metrics(self) -> dict[str, float]:
        """/metrics as {series (name with labels): value} (the suite's server runs without
        API keys, so the route is open)."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        return {k: float(v) for k, _, v in (line.rpartition(" ") for line in text.splitlines()
                                          if line and not line.startswith("#"))}

    def upload(self, name: str, folder: Path) -> str:
        files = [("files", (p.name, p.read_bytes())) for p in sorted(folder.iterdir())]
        r = httpx.post(self.url + "/v1/adapters", data={"name": name}, files=files, timeout=120)
        r.raise_for_status()
        return name


async def stream(client: httpx.AsyncClient, path: str, body: dict) -> dict:
    """One streamed request: TTFT, per-token time, tokens, usage, the text, or the error."""
    t, sent_at = time.perf_counter(), time.time()
    first = last = None
    chunks, text, usage, error = 0, "", None, None
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if "error" in d:
                error = d["error"].get("message")
            for c in d.get("choices", []):
                piece = c.get("text") or (c.get("delta") or {}).get("content") or ""
                calls = (c.get("delta") or {}).get("tool_calls")
                if piece or calls:
                    now = time.perf_counter()
                    first = first or now
                    last, chunks = now, chunks + 1
                    text += piece
            usage = d.get("usage") or usage
    done = time.perf_counter()
    n = (usage or {}).get("completion_tokens", 0)
    return {"ttft": (first or done) - t, "tpot": ((last or done) - (first or done)) / max(n - 1, 1),
            "tokens": n, "usage": usage or {}, "text": text, "error": error,
            "sent_at": sent_at, "done_at": sent_at + done - t}


def queueing(before: dict[str, float], after: dict[str, float]) -> dict:
    """What the server's /metrics say about the requests between two readings, to tell what
    their TTFT waited for: their grammars (constrained requests, before they are queued), the
    engine's queue (for a seat, pages, an adapter), each as the mean and the share over 1 s;
    how many sequences were preempted; the prompt tokens the prefix cache served; the engine's
    steps by kind with their mean ms (beside the offline engine's, `greedy_steps`); the core
    loop's seconds applying commands, stepping and publishing outputs (the rest of the round's
    wall it waited for work)."""
    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    def waits(name: str) -> dict:
        h = f"switchboard_{name}_seconds"
        n = delta(h + "_count")
        over = n - delta(h + '_bucket{le="1.0"}')
        return {"count": int(n), "mean_s": round(delta(h + "_sum") / max(n, 1), 4),
                "over_1s": round(over / max(n, 1), 3)}

    hit, miss = (delta(f"switchboard_prefix_cache_{k}_tokens_total") for k in ("hit", "miss"))
    return {"grammar_wait": waits("grammar_wait"), "queue_time": waits("request_queue_time"),
            "preemptions": int(delta("switchboard_preemptions_total")),
            "prefix_hit_tokens": round(hit / max(hit + miss, 1), 3),
            "engine_steps": step_kinds(metric_steps(before), metric_steps(after)),
            "loop_s": {part: round(delta(f'switchboard_engine_loop_seconds_total{{part="{part}"}}'),
                                   3) for part in ("commands", "step", "publish")}}


def metric_steps(m: dict[str, float]) -> dict[str, tuple[float, float]]:
    """{kind: (steps, seconds)} from a /metrics reading (`switchboard_engine_step*`)."""
    out: dict[str, tuple[float, float]] = {}
    for key, value in m.items():
        if k := re.fullmatch(r'switchboard_engine_(steps|step_seconds)_total\{kind="(\w+)"\}', key):
            n, seconds = out.get(k[2], (0.0, 0.0))
            out[k[2]] = (value, seconds) if k[1] == "steps" else (n, value)
    return out


def step_kinds(before: dict, after: dict) -> dict:
    """Engine steps between two readings of {kind: (steps, seconds)}: per kind, how many
    ran and their mean wall ms (`LLMEngine.step_times`; a server's from /metrics)."""
    out = {}
    for kind, (n, seconds) in after.items():
        n0, s0 = before.get(kind, (0, 0.0))
        if n > n0:
            out[kind] = {"steps": int(n - n0), "ms": round((seconds - s0) / (n - n0) * 1e3, 2)}
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4) if xs else float("nan")


async def http_client(url: str, prompts, outputs, concurrency: int, ready=None) -> dict:
    """One client process's share: its requests through /v1/completions, `concurrency` at a
    time. With `ready` (a barrier shared with the other client processes and the parent), the
    requests go out once every process has connected. Returns each request's record, the wall
    span and this process's CPU seconds."""
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8,
                          max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def one(p, m):
            async with gate:
                return await stream(client, "/v1/completions", {
                    "model": model, "prompt": p, "max_tokens": m, "temperature": 0,
                    "ignore_eos": True})
        # The connections open before the start, as a fleet of clients holds theirs: opening
        # 32 from one Python process spread its first requests over ~0.16 s (H200 host), time
        # the server had nothing to run.
        await asyncio.gather(*(client.get("/health") for _ in range(concurrency)))
        if ready is not None:
            ready.wait()  # blocks the loop, which has nothing else to run yet
        cpu, start = time.process_time(), time.time()
        res = await asyncio.gather(*(one(p, m) for p, m in zip(prompts, outputs, strict=True)))
        end = time.time()
    return {"records": res, "start": start, "end": end, "cpu_s": time.process_time() - cpu}


def _client_process(url: str, prompts, outputs, concurrency: int, ready, results, k: int) -> None:
    """A client process: its share's result, or its error (the barrier is broken for the
    others, so that none waits for it)."""
    try:
        part: object = asyncio.run(http_client(url, prompts, outputs, concurrency, ready))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        ready.abort()
        part = RuntimeError(f"client process {k}: {type(e).__name__}: {e}")
    results.put((k, part))


def http_workload(url: str, prompts, outputs, concurrency: int, processes: int = 1,
                  records: list | None = None) -> dict:
    """Every request of the workload through /v1/completions, `concurrency` at a time, from
    `processes` client processes (request i goes to process i mod processes, each with its
    share of the concurrency). A Python client parses every SSE event; at a few thousand
    events a second one process can fall behind the server, and then the figure measures the
    client. `client_cpu` is each process's CPU time ÷ the wall time: near 1.0, add processes.
    The processes start, import and connect first, then all begin at once, as the offline
    engine gets its requests at once (begun as each got ready, they were 1.3-1.5 s apart on an
    H200 host, most of it importing torch). `records`, when given, receives each request's
    record (`stream`'s, with wall-clock times)."""
    if processes == 1:
        parts = [asyncio.run(http_client(url, prompts, outputs, concurrency))]
    else:
        import multiprocessing as mp
        ctx = mp.get_context("spawn")
        ready, results = ctx.Barrier(processes), ctx.Queue()
        procs = [ctx.Process(target=_client_process, daemon=True, args=(
            url, prompts[k::processes], outputs[k::processes], concurrency // processes, ready,
            results, k)) for k in range(processes)]
        for proc in procs:
            proc.start()
        done = dict(results.get() for _ in procs)
        for proc in procs:
            proc.join()
        if errors := [p for p in done.values() if isinstance(p, Exception)]:
            raise errors[0]
        parts = [done[k] for k in range(processes)]
    res = [r for part in parts for r in part["records"]]
    wall = max(p["end"] for p in parts) - min(p["start"] for p in parts)
    ok = [r for r in res if not r.get("error")]
    if records is not None:
        records.extend(res)
    return {"tok_s": round(sum(r["tokens"] for r in ok) / wall), "requests": len(res),
            "errors": len(res) - len(ok), "ttft_p50_s": pct([r["ttft"] for r in ok], 0.5),
            "ttft_p99_s": pct([r["ttft"] for r in ok], 0.99), "client_processes": processes,
            "client_cpu": [round(p["cpu_s"] / (p["end"] - p["start"]), 2) for p in parts],
            "start_skew_s": round(max(p["start"] for p in parts)
                                  - min(p["start"] for p in parts), 4),
            "wall_s": round(wall, 3)}


def tool_result(rng: random.Random, lines: int) -> str:
    services = ["api", "auth", "billing", "search", "queue", "cache", "mailer"]
    out = ["Tool result (search_logs):"]
    for _ in range(lines):
        out.append(f"12:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d} "
                   f"{rng.choice(services)} status={rng.choice([200, 200, 500, 503])} "
                   f"ms={rng.randint(5, 900)} trace={rng.getrandbits(32):08x}")
    return "\n".join(out)


async def agent_trace(url: str, adapters: list[str], sessions: int, turns: int, max_ctx: int,
                      left) -> dict:  # noqa: ANN001 - a Section's time-left callable
    """`sessions` agents, each on a session: every turn appends a tool result (~450 tokens)
    and asks again until its context reaches `max_ctx` tokens or the time runs out. Half the
    agents offer a tool on every turn (tool_choice auto); every fourth turn asks for a JSON
    schema; three agents in four run on one of the adapters."""
    base = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    records: list[dict] = []
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=sessions + 8)) as client:
        async def agent(k: int) -> None:
            rng = random.Random(k)
            model = adapters[k % len(adapters)] if k % 4 else base
            r = await client.post("/v1/sessions", json={"model": model, "messages": [
                {"role": "system", "content": "You are an on-call agent. Read each tool "
                 "result and say what to check next."}]})
            r.raise_for_status()
            sid = r.json()["id"]
            for turn in range(turns):
                if left() < 5:
                    break
                body = {"model": model, "session_id": sid, "max_tokens": 48,
                        "temperature": 0.8, "top_p": 0.95, "seed": k * 1000 + turn,
                        "messages": [{"role": "user", "content": tool_result(rng, 14)}]}
                if k % 2:  # an agent offers its tools on every turn, as frameworks do
                    body |= {"tools": TOOLS, "tool_choice": "auto"}
                if turn % 4 == 3:  # an answer in a schema: the tools stay offered, unused
                    if "tools" in body:
                        body["tool_choice"] = "none"
                    body["response_format"] = {"type": "json_schema", "json_schema": {
                        "name": "triage", "schema": SCHEMA}}
                rec = await stream(client, "/v1/chat/completions", body)
                records.append(rec)
                # The next turn adds a tool result (~450 tokens) and up to 48 more.
                if rec.get("error") or rec["usage"].get("prompt_tokens", 0) + 700 > max_ctx:
                    break
            await client.delete(f"/v1/sessions/{sid}")

        t = time.perf_counter()
        await asyncio.gather(*(agent(k) for k in range(sessions)))
        wall = time.perf_counter() - t
    ok = [r for r in records if not r.get("error")]
    prompt = sum(r["usage"].get("prompt_tokens", 0) for r in ok)
    cached = sum((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                 for r in ok)
    return {"agent_trace": {
        "turns": len(records), "errors": len(records) - len(ok),
        "output_tok_s": round(sum(r["tokens"] for r in ok) / wall, 1),
        "ttft_p50_s": pct([r["ttft"] for r in ok], 0.5),
        "ttft_p99_s": pct([r["ttft"] for r in ok], 0.99),
        "tpot_p50_s": pct([r["tpot"] for r in ok], 0.5),
        "tpot_p99_s": pct([r["tpot"] for r in ok], 0.99),
        "prefix_hit_rate": round(cached / max(prompt, 1), 3),
        "max_prompt_tokens": max((r["usage"].get("prompt_tokens", 0) for r in ok), default=0),
        "first_errors": [r["error"] for r in records if r.get("error")][:3]}}


if __name__ == "__main__":
    main()
