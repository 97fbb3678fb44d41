"""Anthropic's Messages API against chat completions, through HTTP on one server, same run.

`/v1/messages` is planned as the chat completion that answers it (gateway/messages/prompt.py)
and streams Anthropic's events instead of chat chunks. This measures what that costs: N
streaming clients send the same kind of sampled requests (a system prompt, a user turn of
200-1,500 words, 64-256 output tokens, temperature 0.8, top_p 0.95, `ignore_eos`) to either
route; rounds alternate chat and messages, each round with prompts of its own (so neither
route reads the other's prefix cache), and the figure is messages ÷ chat of the medians.

    .venv/bin/python benchmarks/messages_http.py [--model synthetic:tiny] [--clients 32]
        [--requests 96] [--rounds 2] [--out benchmarks/results/messages_http_cpu.md]
    # on a GPU: --model synthetic:llama3-8b --flags "--device cuda --dtype bfloat16"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_e2e import Server, pct  # noqa: E402
from machine import describe  # noqa: E402

WORDS = ("agent tool call result file line error test build deploy cache token model server "
         "request stream queue batch kernel memory page prefix session tenant adapter schema "
         "value field index report retry limit config path module class method").split()
SYSTEM = "You are a coding agent. Answer with care and cite the files you read."


def workload(n: int, seed: int, scale: float) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [(" ".join(rng.choices(WORDS, k=int(rng.randint(200, 1500) * scale))),
             max(8, int(rng.randint(64, 256) * scale))) for _ in range(n)]


async def chat(client: httpx.AsyncClient, model: str, text: str, max_tokens: int) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.8, "top_p": 0.95,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": text}]}
    return await _stream(client, "/v1/chat/completions", body, _chat_event)


async def messages(client: httpx.AsyncClient, model: str, text: str, max_tokens: int) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.8, "top_p": 0.95,
            "ignore_eos": True, "stream": True, "system": SYSTEM,
            "messages": [{"role": "user", "content": text}]}
    return await _stream(client, "/v1/messages", body, _messages_event)


def _chat_event(d: dict) -> tuple[bool, int | None]:
    """(the event carries output text, the output tokens it reports)"""
    text = any((c.get("delta") or {}).get("content") for c in d.get("choices", []))
    return text, (d.get("usage") or {}).get("completion_tokens")


def _messages_event(d: dict) -> tuple[bool, int | None]:
    text = d["type"] == "content_block_delta" and d["delta"].get("type") == "text_delta"
    tokens = d["usage"]["output_tokens"] if d["type"] == "message_delta" else None
    return text, tokens


async def _stream(client: httpx.AsyncClient, path: str, body: dict, read) -> dict:
    t = time.perf_counter()
    first, tokens = None, 0
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            text, n = read(json.loads(line[6:]))
            if text and first is None:
                first = time.perf_counter()
            tokens = n if n is not None else tokens
    return {"ttft": (first or time.perf_counter()) - t, "tokens": tokens}


async def one_round(url: str, model: str, send, work: list[tuple[str, int]],
                    clients: int) -> dict:
    gate = asyncio.Semaphore(clients)
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=clients + 8)) as client:
        async def one(text: str, m: int) -> dict:
            async with gate:
                return await send(client, model, text, m)
        start = time.perf_counter()
        res = await asyncio.gather(*(one(t, m) for t, m in work))
        wall = time.perf_counter() - start
    ok = [r for r in res if "error" not in r]
    return {"tok_s": sum(r["tokens"] for r in ok) / wall, "errors": len(res) - len(ok),
            "ttft_p50_s": pct([r["ttft"] for r in ok], 0.5),
            "ttft_p99_s": pct([r["ttft"] for r in ok], 0.99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="synthetic:tiny")
    ap.add_argument("--flags", default="", help="more `switchboard serve` flags")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of each route")
    ap.add_argument("--scale", type=float, default=1.0, help="prompt and output lengths")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    routes = {"chat": chat, "messages": messages}
    runs: dict[str, list[dict]] = {"chat": [], "messages": []}
    with Server(["--model", args.model, *shlex.split(args.flags)]) as srv:
        warm = workload(args.clients, seed=999, scale=args.scale)
        for send in routes.values():
            asyncio.run(one_round(srv.url, srv.model, send, warm, args.clients))
        for r in range(args.rounds):
            order = ["chat", "messages"] if r % 2 == 0 else ["messages", "chat"]
            for k, name in enumerate(order):
                work = workload(args.requests, seed=2 * r + k, scale=args.scale)
                res = asyncio.run(one_round(srv.url, srv.model, routes[name], work,
                                            args.clients))
                runs[name].append(res)
                print(name, {k: round(v, 3) for k, v in res.items()}, flush=True)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    errors = sum(r["errors"] for rs in runs.values() for r in rs)
    ratio = med("messages", "tok_s") / med("chat", "tok_s")
    lines = [f"# Messages API vs chat completions over HTTP ({describe()})", "",
             f"`benchmarks/messages_http.py --model {args.model} --flags '{args.flags}' "
             f"--clients {args.clients} --requests {args.requests} --rounds {args.rounds} "
             f"--scale {args.scale}`: {args.requests} sampled streaming requests a round, "
             f"{args.clients} at a time; rounds alternate the routes. Medians.", "",
             "| route | tok/s | TTFT p50 (s) | TTFT p99 (s) | rounds |", "|---|---|---|---|---|"]
    for name in routes:
        each = ", ".join(f"{r['tok_s']:.0f}" for r in runs[name])
        lines.append(f"| {name} | {med(name, 'tok_s'):.0f} | {med(name, 'ttft_p50_s'):.3f} | "
                     f"{med(name, 'ttft_p99_s'):.3f} | {each} |")
    lines += ["", f"messages ÷ chat: **{ratio:.3f}** tok/s; errors: {errors}", ""]
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
