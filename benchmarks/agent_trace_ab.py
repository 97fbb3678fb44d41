"""The suite's agent trace (benchmarks/gpu_e2e.py `agent_trace`: concurrent multi-turn sessions
whose contexts grow toward 8k tokens, sampled, tool calls and JSON schemas on some turns, 8
adapters) through `switchboard serve` with the engine core in a thread of the server
(`--engine-core thread`) and in its own process (the default), same run, one fresh server
each, in the order given.

    python3 benchmarks/agent_trace_ab.py --device cuda [--seconds 120] [--cores thread,process]
        [--out results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import write_adapter  # noqa: E402
from gpu_e2e import RANK, Server, agent_trace, queueing  # noqa: E402

from engine.config import ModelConfig  # noqa: E402
from engine.runner.loader import resolve_model_dir  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="synthetic:llama3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seconds", type=float, default=120.0, help="each trace's time budget")
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--cores", default="thread,process")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    work = Path(tempfile.mkdtemp(prefix="agent-ab-"))
    cfg = ModelConfig.from_dir(resolve_model_dir(args.model, work / "cache"))
    adapters = []
    for k in range(8):
        folder = work / f"e2e{k}"
        write_adapter(folder, cfg, RANK, seed=50 + k, device=args.device)
        adapters.append(folder)
    seqs, pages = (128, 18000) if cuda else (16, 1200)
    flags = ["--model", args.model, "--device", args.device,
             "--dtype", "bfloat16" if cuda else "float32", "--max-num-seqs", str(seqs),
             "--max-num-batched-tokens", "8192" if cuda else "1024", "--kv-pages", str(pages),
             "--max-loras", "8", "--max-cpu-loras", "8", "--max-lora-rank", str(RANK),
             "--max-queue", "4096", "--session-kv-pages", str(pages // 2)]
    results = {}
    for core in args.cores.split(","):
        store = work / f"store-{core}"
        with Server([*flags, "--adapter-dir", str(store), "--engine-core", core]) as srv:
            names = [srv.upload(f"tenant-bot-{k}", f) for k, f in enumerate(adapters)]
            end = time.monotonic() + args.seconds
            before = srv.metrics()
            res = asyncio.run(agent_trace(srv.url, names, args.sessions, 64, 8192,
                                          lambda end=end: end - time.monotonic()))
            res["server"] = queueing(before, srv.metrics())
            results[core] = res
            print(core, json.dumps(res), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
