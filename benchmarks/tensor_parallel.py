"""Tensor-parallel decode: throughput at `tensor_parallel_size` N against N=1, same script.

Each size runs in its own process (one tensor-parallel engine per process, and the GPUs'
memory freed between sizes): a batch of `--batch` requests with `--context`-token prompts is
prefilled, then `--steps` decode steps are timed (`gpu_common.decode_round`, greedy). On
GPUs each size also reports its roofline fraction: (rank 0's weight bytes + its KV bytes of
the batch's context) / the device's copy bandwidth / the step time.

    python benchmarks/tensor_parallel.py --model synthetic:llama3-8b --device cuda \
        --dtype bfloat16 --sizes 1 2 --out benchmarks/results/h200_tp.json
    python benchmarks/tensor_parallel.py --sizes 1 2 --batch 16 --context 256   # CPU, SmolLM2

Writes `tp{N}_decode_tok_s`, `tp{N}_step_ms`, `tp{N}_roofline_fraction` (GPU) and
`tp{N}_vs_tp1` (throughput ratio) to `--out` (JSON) and a markdown table beside it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


def one(args: argparse.Namespace) -> dict:
    """This process: size `args.one`."""
    from gpu_common import (
        copy_bandwidth,
        decode_round,
        greedy,
        kv_bytes_per_token,
        random_prompts,
        weight_bytes,
    )

    from engine import LLM

    size = args.one
    kw = dict(tensor_parallel_size=size, device=args.device, dtype=args.dtype,
              max_num_seqs=args.batch, max_num_batched_tokens=max(2048, args.context),
              max_loras=0, kv_cache_gb=args.kv_cache_gb)
    with LLM(model=args.model, **kw) as llm:
        eng = llm.engine
        prompts = random_prompts(args.batch, args.context, seed=0,
                                 vocab=eng.model_config.vocab_size)
        decode_round(llm, prompts[:2], lambda i, n: greedy(n), steps=2)  # warm up
        r = decode_round(llm, prompts, lambda i, n: greedy(n), steps=args.steps)
        out = {"step_ms": round(r.step_s * 1e3, 3),
               "decode_tok_s": round(r.tok_s, 1),
               "batch": round(r.mean_running, 1), "context": round(r.mean_context)}
        if args.device == "cuda":
            itemsize = eng.model.embed_tokens.weight.element_size()
            kv = kv_bytes_per_token(eng.model.local_cfg, itemsize)
            moved = weight_bytes(eng.model) + kv * r.mean_context * r.mean_running
            out["roofline_fraction"] = round(moved / copy_bandwidth() / r.step_s, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--kv-cache-gb", type=float, default=2.0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args)))
        return
    from machine import describe

    result: dict = {"machine": describe(), "model": args.model or "SmolLM2-135M-Instruct",
                    "device": args.device, "dtype": args.dtype, "batch": args.batch,
                    "context": args.context}
    flags = sys.argv[1:]
    for size in args.sizes:
        run = subprocess.run([sys.executable, __file__, *flags, "--one", str(size)],
                             capture_output=True, text=True)
        if run.returncode:
            result[f"tp{size}_error"] = run.stderr[-2000:]
            continue
        for k, v in json.loads(run.stdout.strip().splitlines()[-1]).items():
            result[f"tp{size}_{k}"] = v
    base = result.get("tp1_decode_tok_s")
    for size in args.sizes:
        if size > 1 and base and f"tp{size}_decode_tok_s" in result:
            result[f"tp{size}_vs_tp1"] = round(result[f"tp{size}_decode_tok_s"] / base, 3)
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        rows = [f"| {k} | {v} |" for k, v in result.items() if k.startswith("tp")]
        args.out.with_suffix(".md").write_text(
            f"# Tensor-parallel decode\n\n{result['machine']}\n\n{result['model']}, "
            f"{args.device} {args.dtype}, batch {args.batch}, {args.context}-token prompts\n\n"
            "| figure | value |\n|---|---|\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
