"""A 10-turn agent conversation: sessions + prefix cache vs full-history requests, same run.

The agent has a system prompt describing its tools; every turn adds a ~200-token tool result
and the model's reply. Two `switchboard serve` processes run one after the other on the CPU
model:
  (a) sessions: the turn sends only its new message with `session_id`; the session's KV stays
      pinned in the radix tree, so only the new tokens are prefilled;
  (b) no cache: `--no-prefix-cache`, the client resends the whole history every turn.
Per turn: time to first token (streaming, from request to first chunk) and prefill tokens
computed (prompt_tokens - cached_tokens from usage). Greedy decoding, so both runs see the
same conversation.

    .venv/bin/python benchmarks/agent_sessions.py [--turns 10] [--out FILE]

With `--tiers`, the host KV tier instead: `--sessions` agents take turns in rotation on a
server whose device KV pool (`--kv-pages`) holds fewer of their histories than there are, with
and without a host tier (`--host-kv-pages`), same run: prefix-cache hit rate and TTFT of the
turns after the first.

    .venv/bin/python benchmarks/agent_sessions.py --tiers [--sessions 6] [--turns 4]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from openai import OpenAI

ROOT = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
SYSTEM = (
    "You are an operations agent. You solve the user's task by calling tools and reading "
    "their results. Tools: search_logs(query, since) returns matching log lines; "
    "get_metrics(service, window) returns a table of request rates and latencies; "
    "list_deploys(service) returns recent deploys with their authors; "
    "open_ticket(title, body) files an incident. After each tool result, say in one sentence "
    "what you learned and which tool you call next."
)


def tool_result(turn: int, rng: random.Random) -> str:
    """~200 tokens of log lines, like a real tool result."""
    services = ["api", "auth", "billing", "search", "queue"]
    lines = [f"Tool result (search_logs, call {turn}):"]
    for _ in range(10):
        svc = rng.choice(services)
        lines.append(f"12:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d} {svc} "
                     f"status={rng.choice([200, 200, 500, 503])} ms={rng.randint(5, 900)}")
    return "\n".join(lines)


class Server:
    def __init__(self, flags: list[str], threads: int):
        self.log = Path(tempfile.mkstemp(suffix=".log")[1])
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)}
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gateway.main", "serve", "--port", "0", *flags],
                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 300
        while not (m := re.search(r"serving \S+ at (http://\S+)", self.log.read_text())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server failed:\n{self.log.read_text()}")
            time.sleep(0.2)
        self.url = m.group(1)
        self.client = OpenAI(base_url=self.url + "/v1", api_key="sk-none", max_retries=0,
                             timeout=600)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def timed_turn(client: OpenAI, messages: list[dict], max_tokens: int, **extra):
    """(ttft seconds, reply text, prompt tokens, cached tokens) of one streamed turn."""
    start = time.perf_counter()
    ttft, text, usage = None, "", None
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, **extra)
    for chunk in stream:
        if chunk.choices and ttft is None:
            ttft = time.perf_counter() - start
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert ttft is not None and usage is not None
    return ttft, text, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


def run(mode: str, turns: int, max_tokens: int, threads: int) -> list[dict]:
    flags = [] if mode == "sessions" else ["--no-prefix-cache"]
    srv = Server(flags, threads)
    rng = random.Random(0)
    rows = []
    try:
        timed_turn(srv.client, [{"role": "user", "content": "warm up"}], 4)
        history = [{"role": "system", "content": SYSTEM}]
        sid = None
        if mode == "sessions":
            r = httpx.post(srv.url + "/v1/sessions", json={"model": MODEL, "messages": history})
            sid = r.json()["id"]
        for t in range(1, turns + 1):
            msg = {"role": "user", "content": tool_result(t, rng)}
            if sid:
                out = timed_turn(srv.client, [msg], max_tokens, extra_body={"session_id": sid})
            else:
                out = timed_turn(srv.client, [*history, msg], max_tokens)
            ttft, reply, prompt, cached = out
            history += [msg, {"role": "assistant", "content": reply}]
            rows.append({"turn": t, "ttft": ttft, "prompt": prompt, "prefill": prompt - cached,
                         "reply": reply})
            print(f"{mode:9s} turn {t:2d}: ttft {ttft * 1000:8.1f} ms  prompt {prompt:5d}  "
                  f"prefilled {prompt - cached:5d}", flush=True)
    finally:
        srv.close()
    return rows


def run_rotation(host_pages: int, sessions: int, turns: int, max_tokens: int, kv_pages: int,
                 threads: int) -> list[dict]:
    """`sessions` agents, turn t of each in rotation, on a pool of `kv_pages` device pages and
    a host tier of `host_pages` (0: none); a row per turn."""
    flags = ["--kv-pages", str(kv_pages), "--host-kv-pages", str(host_pages)]
    srv = Server(flags, threads)
    rows = []
    try:
        timed_turn(srv.client, [{"role": "user", "content": "warm up"}], 4)
        sids = [httpx.post(srv.url + "/v1/sessions", json={
            "model": MODEL, "messages": [{"role": "system", "content": f"{SYSTEM} Agent {k}."}]}
        ).json()["id"] for k in range(sessions)]
        rngs = [random.Random(k) for k in range(sessions)]
        for t in range(1, turns + 1):
            for k, sid in enumerate(sids):
                msg = {"role": "user", "content": tool_result(t, rngs[k])}
                ttft, reply, prompt, cached = timed_turn(srv.client, [msg], max_tokens,
                                                         extra_body={"session_id": sid})
                rows.append({"session": k, "turn": t, "ttft": ttft, "prompt": prompt,
                             "cached": cached, "reply": reply})
                print(f"host {host_pages:5d} session {k} turn {t}: ttft {ttft * 1000:8.1f} ms  "
                      f"prompt {prompt:5d}  cached {cached:5d}", flush=True)
        metrics = httpx.get(srv.url + "/metrics").text
        rows[-1]["host_hit_tokens"] = next(
            (float(ln.split()[-1]) for ln in metrics.splitlines()
             if ln.startswith('switchboard_kv_tier_hit_tokens_total{tier="host"}')), 0.0)
    finally:
        srv.close()
    return rows


def tiers_table(args: argparse.Namespace) -> str:
    runs = {h: run_rotation(h, args.sessions, args.turns, args.max_tokens, args.kv_pages,
                            args.threads) for h in (0, args.host_kv_pages)}
    without, with_h = runs[0], runs[args.host_kv_pages]
    same = all(a["reply"] == b["reply"] for a, b in zip(without, with_h, strict=True))

    def summary(rows: list[dict]) -> tuple[float, float, float]:
        later = [r for r in rows if r["turn"] > 1]
        hit = sum(r["cached"] for r in later) / sum(r["prompt"] for r in later)
        ttfts = sorted(r["ttft"] for r in later)
        return hit, ttfts[len(ttfts) // 2], sum(ttfts) / len(ttfts)

    (h0, m0, a0), (h1, m1, a1) = summary(without), summary(with_h)
    history = max(r["prompt"] for r in with_h)
    lines = [
        "# Agent sessions beyond the device KV pool: with and without the host tier",
        "",
        f"Machine: {machine()}; SmolLM2-135M-Instruct, float32 CPU, {args.threads} torch "
        f"thread(s) per server. {args.sessions} sessions take {args.turns} turns each in "
        f"rotation (each turn adds a ~200-token tool result and {args.max_tokens} greedy reply "
        f"tokens; histories reach {history} tokens); device pool {args.kv_pages} pages of 16 "
        f"tokens, host tier {args.host_kv_pages} pages. `benchmarks/agent_sessions.py --tiers`.",
        "",
        "| turns 2.. | prefix hit rate | TTFT median (ms) | TTFT mean (ms) |",
        "|---|---:|---:|---:|",
        f"| device pool only | {h0:.0%} | {m0 * 1000:.0f} | {a0 * 1000:.0f} |",
        f"| with the host tier | {h1:.0%} | {m1 * 1000:.0f} | {a1 * 1000:.0f} |",
        "",
        f"Median TTFT {m0 / m1:.1f}x lower with the host tier; prompt tokens served from host "
        f"memory: {with_h[-1]['host_hit_tokens']:.0f}. Replies identical in both runs: {same}.",
    ]
    return "\n".join(lines) + "\n"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores visible, {platform.system()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="OMP threads of each server")
    ap.add_argument("--out", type=Path, help="write the markdown table here")
    ap.add_argument("--tiers", action="store_true", help="the host-tier comparison instead")
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--kv-pages", type=int, default=96)
    ap.add_argument("--host-kv-pages", type=int, default=1024)
    args = ap.parse_args()
    if args.tiers:
        table = tiers_table(args)
        print(table)
        if args.out:
            args.out.write_text(table)
        return

    with_s = run("sessions", args.turns, args.max_tokens, args.threads)
    without = run("no-cache", args.turns, args.max_tokens, args.threads)
    same = all(a["reply"] == b["reply"] for a, b in zip(with_s, without, strict=True))

    lines = [
        "# Agent session turns: sessions + prefix cache vs full history, no cache",
        "",
        f"Machine: {machine()}; SmolLM2-135M-Instruct, float32 CPU, {args.threads} torch "
        f"thread(s) per server; {args.turns} turns, each adding a ~200-token tool result; "
        f"{args.max_tokens} greedy reply tokens. `benchmarks/agent_sessions.py`.",
        "",
        "| turn | prompt tokens | prefilled (sessions) | prefilled (no cache) | TTFT sessions (ms)"
        " | TTFT no cache (ms) | TTFT ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for a, b in zip(with_s, without, strict=True):
        lines.append(f"| {a['turn']} | {b['prompt']} | {a['prefill']} | {b['prefill']} | "
                     f"{a['ttft'] * 1000:.0f} | {b['ttft'] * 1000:.0f} | "
                     f"{b['ttft'] / a['ttft']:.1f}x |")
    tot_a = sum(r["prefill"] for r in with_s)
    tot_b = sum(r["prefill"] for r in without)
    hit = 1 - tot_a / sum(r["prompt"] for r in with_s)
    last = without[-1]["ttft"] / with_s[-1]["ttft"]
    lines += [
        "",
        f"Turn-{args.turns} TTFT: **{last:.1f}x lower with sessions**. Prefill tokens over the "
        f"conversation: {tot_a} with sessions vs {tot_b} without ({tot_b / tot_a:.1f}x fewer); "
        f"prefix-cache hit rate {hit:.0%}. Replies identical in both runs: {same}.",
    ]
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table)


if __name__ == "__main__":
    main()
