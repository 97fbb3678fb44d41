"""A chained Responses turn over ~4k tokens of history vs the same request unchained.

One `switchboard serve` (the embedded SmolLM2 on CPU) with two tenants. Per trial:
  1. tenant A: `responses.create` with ~4k tokens of tool output as input (the history);
  2. chained: tenant A continues it with `previous_response_id` and a short question, streamed;
  3. unchained: tenant B (whose prefix cache holds none of it) sends the same conversation as
     items (the input, the reply, the question) without `previous_response_id`, streamed.
TTFT is measured client-side, from the request to the first `response.output_text.delta`;
`cached_tokens` and `input_tokens` come from the final response's usage. Each trial uses a
fresh history, so no trial hits another's cache. Greedy decoding: both see the same prompt.

    .venv/bin/python benchmarks/responses_chain.py [--trials 3] [--history-tokens 4000]
        [--threads 1] [--out benchmarks/results/responses_chain_cpu.md]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from openai import OpenAI
from openai.types.responses import Response

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
KEYS = {"sk-bench-a": "chained", "sk-bench-b": "unchained"}
INSTRUCTIONS = "You are an operations agent. Read the tool output and answer in one sentence."
QUESTION = "Which service failed most often?"


def tool_output(tokens: int, rng: random.Random) -> str:
    """Log lines, about `tokens` tokens of them (~21 tokens a line for this tokenizer)."""
    services = ["api", "auth", "billing", "search", "queue"]
    lines = ["Tool result (search_logs):"]
    for _ in range(tokens // 21):
        lines.append(f"12:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d} "
                     f"{rng.choice(services)} status={rng.choice([200, 200, 500, 503])} "
                     f"ms={rng.randint(5, 900)}")
    return "\n".join(lines)


def start_server(threads: int, keys: Path) -> tuple[subprocess.Popen, str]:
    log = Path(tempfile.mkstemp(suffix=".log")[1])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)}
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.main", "serve", "--port", "0", "--api-keys",
             str(keys), "--kv-pages", "1024", "--page-size", "16"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while not (m := re.search(r"serving \S+ at (http://\S+)", log.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server failed:\n{log.read_text()}")
        time.sleep(0.2)
    return proc, m.group(1)


@dataclass
class Row:
    input_tokens: int
    cached: int
    chained_ttft: float
    cold_input_tokens: int
    cold_cached: int
    cold_ttft: float
    same_reply: bool


def streamed(client: OpenAI, **kw: Any) -> tuple[float, Response]:
    """(seconds to the first text delta, the final response) of one streamed response."""
    start = time.perf_counter()
    ttft, final = None, None
    with client.responses.stream(model=MODEL, temperature=0, instructions=INSTRUCTIONS,
                                 max_output_tokens=8, **kw) as stream:
        for event in stream:
            if event.type == "response.output_text.delta" and ttft is None:
                ttft = time.perf_counter() - start
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
    assert ttft is not None and final is not None and final.usage is not None
    return ttft, final


def trial(url: str, history_tokens: int, seed: int) -> Row:
    a = OpenAI(base_url=url + "/v1", api_key="sk-bench-a", max_retries=0, timeout=900)
    b = OpenAI(base_url=url + "/v1", api_key="sk-bench-b", max_retries=0, timeout=900)
    log = tool_output(history_tokens, random.Random(seed))
    first = a.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=log,
                               max_output_tokens=16, temperature=0)
    chained_ttft, chained = streamed(a, input=QUESTION, previous_response_id=first.id)
    items = [{"role": "user", "content": log},
             {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": QUESTION}]
    cold_ttft, cold = streamed(b, input=items, store=False)
    cu, uu = chained.usage, cold.usage
    assert cu is not None and uu is not None
    row = Row(cu.input_tokens, cu.input_tokens_details.cached_tokens, chained_ttft,
              uu.input_tokens, uu.input_tokens_details.cached_tokens, cold_ttft,
              chained.output_text == cold.output_text)
    print(json.dumps(asdict(row)), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--history-tokens", type=int, default=4000)
    ap.add_argument("--threads", type=int, default=1, help="OMP threads of the server")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    keys = Path(tempfile.mkstemp(suffix=".json")[1])
    keys.write_text(json.dumps(KEYS))
    proc, url = start_server(args.threads, keys)
    try:
        OpenAI(base_url=url + "/v1", api_key="sk-bench-a").responses.create(
            model=MODEL, input="warm up", max_output_tokens=2)
        rows = [trial(url, args.history_tokens, seed) for seed in range(args.trials)]
    finally:
        proc.terminate()
        proc.wait(30)
    table = [
        "# A chained Responses turn vs the same request unchained",
        "",
        f"Machine: {describe()}; SmolLM2-135M-Instruct, float32 CPU, {args.threads} torch "
        f"thread(s) in the server. `benchmarks/responses_chain.py --trials {args.trials} "
        f"--history-tokens {args.history_tokens}`: ~{args.history_tokens} tokens of history "
        "(one tool output and its reply), then a short question; chained = "
        "`previous_response_id` (same tenant), unchained = the whole conversation as input "
        "items from a tenant with a cold prefix cache. TTFT: request to first text delta, "
        "streamed.",
        "",
        "| trial | input tokens | cached (chained) | cached % | TTFT chained (ms) | "
        "TTFT unchained (ms) | TTFT ratio | same reply |",
        "|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for i, r in enumerate(rows):
        table.append(
            f"| {i + 1} | {r.input_tokens} | {r.cached} | "
            f"{100 * r.cached / r.input_tokens:.1f}% | {1000 * r.chained_ttft:.0f} | "
            f"{1000 * r.cold_ttft:.0f} (cached {r.cold_cached}) | "
            f"{r.cold_ttft / r.chained_ttft:.1f}x | {r.same_reply} |")
    ratios = [r.cold_ttft / r.chained_ttft for r in rows]
    fractions = [r.cached / r.input_tokens for r in rows]
    table += ["", f"Median: cached {100 * statistics.median(fractions):.1f}% of the input; "
              f"TTFT {statistics.median(ratios):.1f}x lower chained."]
    text = "\n".join(table) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
