"""`switchboard serve --model <folder>` with no other flag against the suite's tuned flags
(issue #37's `default_serve_vs_tuned`): `python benchmarks/default_serve.py --out
sections.jsonl` (a `gpu_suite` part, `--parts default_serve`).

The suite's HTTP workload (gpu_e2e's `http` section: 256 mixed greedy requests, prompts 64-1,024
tokens, outputs 64-256, from 128 streaming clients in 4 processes) through two servers, one
after the other (each takes most of the GPU's memory): the tuned flags
(`gpu_e2e.tuned_serve_flags`), then no flag but the model. Each server gets one untimed warm-up
round of other tokens, then two rounds, the best counting; output tokens/s of the default ÷
the tuned.

`--quick` runs it at toy sizes (any device): a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from gpu_common import Recorder, random_prompts
from gpu_e2e import CLIENT_PROCESSES, Server, http_workload, mixed_workload, tuned_serve_flags

from engine.config import ModelConfig, default_cache_dir
from engine.runner.loader import resolve_model_dir


def rounds(flags: list[str], workload: tuple, vocab: int) -> dict:
    """Warm-up, then two rounds (the second with other tokens: the server keeps the first's
    prefixes); the best round."""
    prompts, outputs, concurrency, scale = workload
    with Server(flags) as srv:
        warm, warm_outputs = mixed_workload(len(prompts), vocab, scale, seed=8)
        http_workload(srv.url, warm, warm_outputs, concurrency, CLIENT_PROCESSES)
        fresh = random_prompts(len(prompts), [len(p) for p in prompts], seed=9, vocab=vocab)
        runs = [http_workload(srv.url, ps, outputs, concurrency, CLIENT_PROCESSES)
                for ps in (prompts, fresh)]
    best = max(runs, key=lambda r: r["tok_s"])
    return {"tok_s": best["tok_s"], "ttft_p50_s": best["ttft_p50_s"],
            "ttft_p99_s": best["ttft_p99_s"], "errors": sum(r["errors"] for r in runs),
            "rounds_tok_s": [r["tok_s"] for r in runs]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="synthetic:llama3-8b")
    ap.add_argument("--out", type=Path, required=True, help="JSON lines, one per section")
    ap.add_argument("--adapter-dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--budget", type=float, default=400.0, help="seconds for the whole worker")
    ap.add_argument("--quick", action="store_true", help="toy sizes: a check of the script")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    rec = Recorder(args.out, args.budget)
    vocab = ModelConfig.from_dir(resolve_model_dir(args.model, default_cache_dir())).vocab_size
    n, scale, concurrency = (16, 0.125, 8) if args.quick else (256, 1.0, 128)
    prompts, outputs = mixed_workload(n, vocab, scale)
    with rec.section("default_serve", args.budget) as s:
        store = args.adapter_dir / "default_serve_store"
        tuned = rounds(tuned_serve_flags(args.model, args.device, store, args.quick),
                       (prompts, outputs, concurrency, scale), vocab)
        default = rounds(["--model", args.model], (prompts, outputs, concurrency, scale), vocab)
        s.result.update(tuned=tuned, default=default,
                        default_serve_vs_tuned=round(default["tok_s"] / tuned["tok_s"], 3))
        print(json.dumps(s.result), flush=True)


if __name__ == "__main__":
    main()
