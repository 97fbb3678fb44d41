"""Load: N concurrent streaming clients on loopback against `switchboard serve`, for a fixed time.

Each client loops until the time is up, sending one streamed request at a time from a mix:
plain chat, JSON mode (a json_schema), a tool call (tool_choice "required"), a session turn
(its own session, renewed every few turns), and chat with one of several LoRA adapters (made
with peft at start and uploaded). Then it waits for the requests in flight, deletes the
sessions (their KV is pinned until then) and reads the KV pages still used from /metrics: any
page left is a leak. Reports TTFT / TPOT p50/p95/p99 per kind, goodput (requests within the
SLO), and errors by kind (429s with a rate-limit code are the intended refusals).

    .venv/bin/python benchmarks/serve_load.py [--clients 64] [--duration 120] [--url URL]
        [--out benchmarks/results/serve_load_cpu.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
RATE_LIMITS = {"queue_full", "concurrency_limit_exceeded", "tokens_per_minute_exceeded"}
KINDS = {"chat": 35, "json": 15, "tool": 15, "session": 15, "lora": 20}  # weights (%)
TURNS_PER_SESSION = 6
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
          "population": {"type": "integer"}}, "required": ["city", "population"],
          "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"]}}}]
QUESTIONS = ["What is the capital of France?", "Give me a tip for writing tests.",
             "Name three colors.", "What does an API gateway do?", "Tell me about Paris.",
             "How do plants grow?", "Explain a cache in one sentence."]


@dataclass
class Result:
    kind: str
    ok: bool
    error: str | None
    ttft: float | None
    tpot: float | None
    tokens: int


class Client:
    def __init__(self, url: str, http: httpx.AsyncClient, adapters: list[str], seed: int,
                 max_tokens: int):
        self.url, self.http, self.adapters = url, http, adapters
        self.rng, self.max_tokens = random.Random(seed), max_tokens
        self.session: str | None = None
        self.turns = 0
        self.sessions: list[str] = []

    def body(self, kind: str) -> dict:
        q = self.rng.choice(QUESTIONS)
        body = {"model": MODEL, "messages": [{"role": "user", "content": q}], "stream": True,
                "max_tokens": self.max_tokens, "stream_options": {"include_usage": True}}
        if kind == "json":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "city", "schema": SCHEMA}}
            body["messages"] = [{"role": "user", "content": "A city and its population, JSON."}]
        elif kind == "tool":
            body.update(tools=TOOLS, tool_choice="required")
            body["messages"] = [{"role": "user", "content": f"Weather? {q}"}]
        elif kind == "lora":
            body["model"] = self.rng.choice(self.adapters)
        elif kind == "session":
            body["session_id"] = self.session
        return body

    async def one(self, kind: str) -> Result:
        if kind == "session" and (self.session is None or self.turns >= TURNS_PER_SESSION):
            r = await self.http.post(self.url + "/v1/sessions", json={"model": MODEL})
            if r.status_code != 200:
                return Result(kind, False, f"session_create:{r.status_code}", None, None, 0)
            self.session, self.turns = r.json()["id"], 0
            self.sessions.append(self.session)
        self.turns += kind == "session"
        start = time.perf_counter()
        first = last = None
        tokens, error = 0, None
        try:
            async with self.http.stream("POST", self.url + "/v1/chat/completions",
                                        json=self.body(kind)) as r:
                if r.status_code != 200:
                    body = json.loads(await r.aread() or b"{}")
                    code = body.get("error", {}).get("code")
                    return Result(kind, False, f"{r.status_code}:{code}", None, None, 0)
                async for line in r.aiter_lines():
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if "error" in chunk:
                        error = f"stream:{chunk['error'].get('code')}"
                    elif chunk.get("choices"):
                        last = time.perf_counter()
                        first = first or last
                    elif chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
        except httpx.HTTPError as e:
            error = type(e).__name__
        if error is None and first is None:
            error = "no_chunk"
        ttft = None if first is None else first - start
        tpot = (last - first) / (tokens - 1) if first and last and tokens > 1 else None
        return Result(kind, error is None, error, ttft, tpot, tokens)

    async def run(self, until: float, results: list[Result]) -> None:
        kinds, weights = list(KINDS), list(KINDS.values())
        while time.monotonic() < until:
            kind = self.rng.choices(kinds, weights)[0]
            res = await self.one(kind)
            results.append(res)
            if res.error and res.error.split(":")[-1] in RATE_LIMITS:
                await asyncio.sleep(1.0)  # Retry-After


def make_adapters(base_dir: Path, folder: Path, n: int) -> list[Path]:
    """`n` PEFT LoRA adapters (r=8 on q_proj/v_proj of every layer), random like a fine-tune."""
    import peft
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    cfg = AutoConfig.from_pretrained(base_dir)
    cfg.vocab_size = 64  # the adapters hold no embedding
    paths = []
    for i in range(n):
        torch.manual_seed(i)
        model = peft.get_peft_model(LlamaForCausalLM(cfg), peft.LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(0.05)  # a gentle fine-tune: the model still speaks
        model.save_pretrained(folder / f"a{i}", save_embedding_layers=False)
        paths.append(folder / f"a{i}")
    return paths


def metrics(url: str) -> dict[str, float]:
    lines = httpx.get(url + "/metrics", timeout=30).text.splitlines()
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines
            if ln and not ln.startswith("#")}


def start_server(threads: int, flags: list[str]) -> tuple[subprocess.Popen, str]:
    log = Path(tempfile.mkstemp(suffix=".log")[1])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gateway.main", "serve", "--port", "0",
                                 *flags], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while not (m := re.search(r"serving \S+ at (http://\S+)", log.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server failed:\n{log.read_text()}")
        time.sleep(0.2)
    return proc, m.group(1)


async def drive(url: str, args: argparse.Namespace, adapters: list[str]):
    results: list[Result] = []
    limits = httpx.Limits(max_connections=args.clients + 8)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits,
                                 headers=headers) as http:
        clients = [Client(url, http, adapters, i, args.max_tokens) for i in range(args.clients)]
        t0 = time.monotonic()
        await asyncio.gather(*[c.run(t0 + args.duration, results) for c in clients])
        wall = time.monotonic() - t0  # the last requests finish after the deadline
        idle = await asyncio.to_thread(wait_until, url, lambda m: m[
            "switchboard_running_batch_size"] == m["switchboard_queue_depth"] == 0)
        pinned = idle["switchboard_kv_pages_used"]  # the live sessions' pinned KV
        for sid in {s for c in clients for s in c.sessions}:
            await http.delete(url + f"/v1/sessions/{sid}")
    end = await asyncio.to_thread(wait_until, url, lambda m: m["switchboard_kv_pages_used"] == 0)
    return results, wall, pinned, end["switchboard_kv_pages_used"]


def wait_until(url: str, done, timeout: float = 60) -> dict[str, float]:  # noqa: ANN001
    """/metrics once `done(metrics)` holds, or after `timeout` s whatever they say."""
    deadline = time.monotonic() + timeout
    while not done(m := metrics(url)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return m


def pct(xs: list[float], q: float) -> str:
    if not xs:
        return "-"
    xs = sorted(xs)
    return f"{xs[min(len(xs) - 1, int(q * len(xs)))] * 1000:.0f}"


def report(results: list[Result], wall: float, pinned: float, leaked: float,
           args: argparse.Namespace, adapters: int) -> str:
    def good(r: Result) -> bool:
        return r.ok and r.ttft is not None and r.ttft <= args.slo_ttft and (
            r.tpot is None or r.tpot <= args.slo_tpot)

    lines = [
        "# Serving under load: concurrent streaming clients, mixed traffic",
        "",
        f"Machine: {describe()}; server: SmolLM2-135M-Instruct, float32 CPU, "
        f"{args.threads} torch thread(s), flags `{' '.join(args.serve_flags)}`. "
        f"{args.clients} clients on loopback for {args.duration:.0f} s (last requests done "
        f"after {wall:.0f} s), one streamed request at a time each, max_tokens "
        f"{args.max_tokens}; mix {', '.join(f'{k} {w}%' for k, w in KINDS.items())} "
        f"({adapters} peft LoRA adapters; a session is renewed every {TURNS_PER_SESSION} "
        f"turns). `benchmarks/serve_load.py`.",
        "",
        f"SLO: TTFT <= {args.slo_ttft:g} s and TPOT <= {args.slo_tpot * 1000:.0f} ms "
        "(sized for a 135M model on 2 shared CPU cores).",
        "",
        "| kind | requests | errors | within SLO | TTFT p50 / p95 / p99 (ms) "
        "| TPOT p50 / p95 / p99 (ms) | tokens |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for kind in [*KINDS, "all"]:
        rs = [r for r in results if kind in (r.kind, "all")]
        ttft = [r.ttft for r in rs if r.ok and r.ttft is not None]
        tpot = [r.tpot for r in rs if r.ok and r.tpot is not None]
        lines.append(
            f"| {kind} | {len(rs)} | {sum(not r.ok for r in rs)} | {sum(map(good, rs))} | "
            f"{pct(ttft, .5)} / {pct(ttft, .95)} / {pct(ttft, .99)} | "
            f"{pct(tpot, .5)} / {pct(tpot, .95)} / {pct(tpot, .99)} | "
            f"{sum(r.tokens for r in rs)} |")
    errors = Counter(f"{r.kind} {r.error}" for r in results if not r.ok)
    unintended = sum(n for e, n in errors.items() if e.split(":")[-1] not in RATE_LIMITS)
    ok = [r for r in results if r.ok]
    lines += [
        "",
        f"Goodput: **{sum(map(good, results)) / wall:.2f} requests/s within the SLO** "
        f"({sum(map(good, results))} of {len(results)}); throughput {len(ok) / wall:.2f} "
        f"requests/s, {sum(r.tokens for r in ok) / wall:.1f} generated tokens/s.",
        f"Errors by kind: {dict(errors) or 'none'}; **{unintended} errors other than "
        f"rate-limit 429s**.",
        f"KV pages used once drained: {pinned:.0f} (pinned by the live sessions); after "
        f"deleting the sessions: **{leaked:.0f} leaked pages**.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--adapters", type=int, default=3)
    ap.add_argument("--url", help="an already running server (else one is started)")
    ap.add_argument("--api-key", help="for --url with auth on")
    ap.add_argument("--threads", type=int, default=1, help="OMP threads of the started server")
    ap.add_argument("--slo-ttft", type=float, default=10.0, help="seconds")
    ap.add_argument("--slo-tpot", type=float, default=1.0, help="seconds")
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--out", type=Path, help="write the markdown table here")
    args = ap.parse_args()
    args.serve_flags = ["--max-num-seqs", str(args.clients), "--max-loras",
                        str(args.adapters + 1)]

    proc = None
    with tempfile.TemporaryDirectory() as tmp:
        url = args.url
        if url is None:
            proc, url = start_server(args.threads, args.serve_flags)
        try:
            from engine.config import default_cache_dir
            from engine.runner.loader import resolve_model_dir

            base = resolve_model_dir(None, default_cache_dir())
            auth = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
            names = []
            for i, folder in enumerate(make_adapters(base, Path(tmp), args.adapters)):
                files = [("files", (f.name, f.read_bytes())) for f in sorted(folder.iterdir())]
                name = f"load-{os.getpid()}-{i}"
                r = httpx.post(url + "/v1/adapters", data={"name": name}, files=files,
                               headers=auth, timeout=120)
                r.raise_for_status()
                names.append(name)
            results, wall, pinned, leaked = asyncio.run(drive(url, args, names))
            for name in names:
                httpx.delete(url + f"/v1/adapters/{name}", headers=auth, timeout=30)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(60)
    table = report(results, wall, pinned, leaked, args, len(names))
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table)


if __name__ == "__main__":
    main()
