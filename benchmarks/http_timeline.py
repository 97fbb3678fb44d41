"""Where the suite's HTTP c128 run spends its wall time outside the engine's steps, beside the
offline engine on the same workload (`http_vs_offline_c128`'s gap, same run).

Offline, the engine gets the 256 requests at once and this script times every `step()`. Through
`switchboard serve`, 128 streaming clients in 4 processes send the same workload (as
`gpu_e2e.py`'s http section does) while a thread reads the server's /metrics every few
milliseconds: the engine's step counters (`switchboard_engine_step*`) say when the first and
the last step of the round ended. Each request's record carries its wall-clock send and end.
The round's wall then splits into
    head   from the first request sent to the first step's start (that step's seconds taken
           back from the counters' first change);
    steps  the engine's step seconds (the counters' difference);
    tail   from the last step's end to the last client's end;
    idle   the rest: the engine had nothing to step between two steps.
and the core loop's own account of the round (`switchboard_engine_loop_seconds`): applying
commands, stepping, publishing outputs.

    python3 benchmarks/http_timeline.py --device cuda --model synthetic:llama3-8b --rounds 2
    .venv/bin/python benchmarks/http_timeline.py --quick   # a check of the script on a CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import threading
import time
from pathlib import Path

import torch
from gpu_common import greedy, random_prompts, sync
from gpu_e2e import (
    CLIENT_PROCESSES,
    Server,
    http_workload,
    metric_steps,
    mixed_workload,
    offline_tok_s,
    sizes,
    tuned_serve_flags,
)
from machine import describe

from engine import LLM


def offline_timeline(llm: LLM, prompts, outputs, device: str) -> dict:
    """The workload submitted at once, every step timed: tokens/s, wall, head (submission),
    step seconds, tail."""
    eng = llm.engine
    eng.reset_prefix_cache()
    sync(device)
    t0 = time.perf_counter()
    for i, (p, m) in enumerate(zip(prompts, outputs, strict=True)):
        eng.add_request(f"tl-{i}", p, greedy(m))
    first = time.perf_counter()
    tokens, stepping = 0, 0.0
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        for out in eng.step():
            if out.finished:
                tokens += out.num_output_tokens
        stepping += time.perf_counter() - t
    sync(device)
    end = time.perf_counter()
    return {"tok_s": round(tokens / (end - t0)), "wall_s": round(end - t0, 3),
            "head_s": round(first - t0, 4), "steps_s": round(stepping, 3),
            "rest_s": round(end - t0 - (first - t0) - stepping, 4)}


class Poller(threading.Thread):
    """/metrics every `every` seconds: (wall-clock time, steps, step seconds) at each change;
    the core loop's seconds by part at the first and the last reading."""

    def __init__(self, srv: Server, every: float = 0.005):
        super().__init__(daemon=True)
        self.srv, self.every, self.done = srv, every, threading.Event()
        self.changes: list[tuple[float, float, float]] = []
        self.first_loop: dict[str, float] | None = None
        self.last_loop: dict[str, float] = {}

    def run(self) -> None:
        last = None
        while not self.done.is_set():
            m = self.srv.metrics()
            steps, now = metric_steps(m), time.time()
            loop = {k[k.index('"') + 1:-2]: v for k, v in m.items()
                    if k.startswith("switchboard_engine_loop_seconds_total")}
            self.first_loop = loop if self.first_loop is None else self.first_loop
            self.last_loop = loop
            n, s = sum(v[0] for v in steps.values()), sum(v[1] for v in steps.values())
            if (n, s) != last:
                self.changes.append((now, n, s))
                last = (n, s)
            time.sleep(self.every)


def http_timeline(srv: Server, prompts, outputs) -> dict:
    poll = Poller(srv)
    poll.start()
    time.sleep(0.1)  # the first reading is the baseline
    records: list[dict] = []
    res = http_workload(srv.url, prompts, outputs, 128, CLIENT_PROCESSES, records=records)
    time.sleep(0.1)
    poll.done.set()
    poll.join()
    (_, n0, s0), changes = poll.changes[0], poll.changes[1:]
    start = min(r["sent_at"] for r in records)
    end = max(r["done_at"] for r in records)
    first_change, last_change = changes[0], changes[-1]
    steps_s = last_change[2] - s0
    # The first change reports the steps that ended by then: they began that long before.
    first_step = first_change[0] - (first_change[2] - s0)
    head = first_step - start
    tail = end - last_change[0]
    sends = sorted(r["sent_at"] - start for r in records)
    first = poll.first_loop or {}
    loop = {f"loop_{k}_s": round(v - first.get(k, 0.0), 3)
            for k, v in poll.last_loop.items() if k != "wait"}  # an idle reading is stale
    return {"tok_s": res["tok_s"], "wall_s": round(end - start, 3),
            "start_skew_s": res["start_skew_s"], "head_s": round(head, 4),
            "steps_s": round(steps_s, 3), "steps": int(last_change[1] - n0),
            "tail_s": round(tail, 4), "idle_s": round(end - start - head - steps_s - tail, 4),
            "sent_by_128th_s": round(sends[min(127, len(sends) - 1)], 4),
            "first_token_s": round(min(r["sent_at"] + r["ttft"] for r in records) - start, 4),
            "ttft_p50_s": res["ttft_p50_s"], **loop}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="synthetic:llama3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of each client start")
    ap.add_argument("--quick", action="store_true", help="small sizes on a CPU")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dev = "cpu" if args.quick else args.device
    model = "synthetic:tiny" if args.quick else args.model
    seqs, pages, step = sizes(args.quick)
    n, scale = (32, 0.125) if args.quick else (256, 1.0)
    rows: list[dict] = []

    def show(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    llm = LLM(model, dtype="bfloat16" if dev == "cuda" else "float32", device=dev,
              max_num_seqs=seqs, max_num_batched_tokens=step, num_pages=pages)
    vocab = llm.engine.model_config.vocab_size
    prompts, outputs = mixed_workload(n, vocab, scale)
    offline_timeline(llm, prompts, outputs, dev)  # warm-up
    for _ in range(args.rounds):
        show({"run": "offline", **offline_timeline(llm, prompts, outputs, dev)})
        # The suite's reference (`gpu_e2e.offline_tok_s`: `LLM.generate`).
        show({"run": "generate", "tok_s": round(offline_tok_s(llm, prompts, outputs,
                                                              lambda i, m: greedy(m), dev))})
    del llm
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()
    with Server(tuned_serve_flags(model, dev, Path("/tmp/tl-store"), args.quick)) as srv:
        warm, warm_outputs = mixed_workload(n, vocab, scale, seed=8)
        http_workload(srv.url, warm, warm_outputs, 128, CLIENT_PROCESSES)
        for r in range(2 * args.rounds):
            fresh = random_prompts(n, [len(p) for p in prompts], seed=100 + r, vocab=vocab)
            show({"run": "http", **http_timeline(srv, fresh, outputs)})
    if args.out:
        keys = ["tok_s", "wall_s", "start_skew_s", "head_s", "steps_s", "idle_s", "tail_s",
                "sent_by_128th_s", "first_token_s", "loop_commands_s",
                "loop_step_s", "loop_publish_s"]
        lines = [f"# The HTTP c128 run's wall, step by step ({describe()})", "",
                 "| run | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
        for r in rows:
            lines.append(f"| {r['run']} | " + " | ".join(str(r.get(k, r.get("rest_s", "")
                                                                  if k == "idle_s" else ""))
                                                      for k in keys) + " |")
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
