"""A session resumed after a restart from the disk KV tier vs recomputed, on the CPU model.

Engine A serves a session's first turn (a ~1.7k-token tool result) with `kv_disk_dir` set, so
its KV is written through to page files, and is dropped. Engine B starts fresh on the same
folder and serves the next turn: time to first token from the files vs the same prompt cold
(another tenant, nothing cached) and vs cached on the device (the turn again), same run; the
tokens must be the cold run's.

    .venv/bin/python benchmarks/kv_disk_restart.py [--rows 180] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from pathlib import Path

from agent_sessions import machine

from engine import LLM, SamplingParams

_ids = itertools.count()


def ttft(engine, prompt: list[int], session: str | None = None,
         tenant: str = "default") -> tuple[float, list[int]]:
    rid, start, first, tokens = f"r{next(_ids)}", time.perf_counter(), None, []
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine.add_request(rid, prompt, params, tenant, session_id=session)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.new_token_ids:
                first = first or time.perf_counter() - start
                tokens += out.new_token_ids
    assert first is not None
    return first, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=180, help="rows in the tool result")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="kv-disk-")
    kw = dict(max_num_seqs=4, num_pages=256, host_kv_pages=256, kv_disk_dir=folder)

    a = LLM(**kw).engine
    text = "Tool result: " + ", ".join(f"row {i} has value {i * 7 % 13}" for i in range(args.rows))
    prompt = a.tokenizer.encode(text)
    _, reply = ttft(a, prompt, session="S")
    a.prefix_cache.tiers.disk.flush()
    written = a.prefix_cache.stats().disk_pages_written
    turn = prompt + reply + a.tokenizer.encode(" And the next row?")
    del a

    b = LLM(**kw).engine
    ttft(b, b.tokenizer.encode("warm up"), tenant="warm")
    cold_s, cold = ttft(b, turn, tenant="cold")
    disk_s, tokens = ttft(b, turn, session="S2")
    device_s, _ = ttft(b, turn, session="S2")
    stats = b.prefix_cache.stats()
    table = "\n".join([
        "# A session turn after a restart: from the disk KV tier vs recomputed",
        "",
        f"Machine: {machine()}; SmolLM2-135M-Instruct, float32 CPU. A {len(turn)}-token turn; "
        f"engine A wrote {written} page files, engine B (fresh, same folder) read "
        f"{stats.disk_pages_read} ({stats.disk_hit_tokens} tokens). "
        "`benchmarks/kv_disk_restart.py`.",
        "",
        "| the turn's KV | TTFT (s) | vs cold |",
        "|---|---:|---:|",
        f"| recomputed (cold) | {cold_s:.3f} | 1.0x |",
        f"| read from disk after the restart | {disk_s:.3f} | {cold_s / disk_s:.1f}x |",
        f"| cached on the device | {device_s:.3f} | {cold_s / device_s:.1f}x |",
        "",
        f"Tokens from the disk KV identical to the cold run's: {tokens == cold}.",
    ]) + "\n"
    print(table)
    if args.out:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
