"""Offline throughput: Switchboard's engine vs transformers' static batching, same run.

A mixed-length workload (prompts 16-384 tokens, outputs 16-128, greedy, ignore_eos, all
submitted at once) runs through (a) the engine with continuous batching and (b) transformers'
`generate` in static batches of 8 with left padding, on the same weights in the same process.
Useful tokens/s = requested output tokens / wall time.

`--tree DIR` (repeatable) also times another checkout's engine (e.g. an older commit in a
`git worktree`) on the same workload, in a child process (two trees' `engine` packages cannot
share one), so a regression shows as a ratio from one run. `--repeat N` alternates the
systems N times and reports each one's best and median, and the minor page faults of a run.

    .venv/bin/python benchmarks/offline_throughput.py [--num-requests 24] [--tree DIR ...]
        [--repeat 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from machine import describe  # benchmarks/machine.py

from engine import LLM, SamplingParams


def workload(tokenizer, n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    vocab_text = tokenizer.decode(list(range(1000, 9000)))
    words = vocab_text.split()
    reqs = []
    for _ in range(n):
        plen, olen = rng.randint(16, 384), rng.randint(16, 128)
        ids: list[int] = []
        while len(ids) < plen:
            ids += tokenizer.encode(" " + " ".join(rng.choices(words, k=64)))
        reqs.append((ids[:plen], olen))
    return reqs


def faults() -> int:
    """The process's minor page faults so far: a run that allocates fresh multi-megabyte
    tensors step after step (glibc mmaps them) shows here as well as in its time."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def run_engine(llm: LLM, reqs) -> tuple[float, int]:
    """Seconds and minor page faults of one run of the workload."""
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for _, o in reqs]
    f, t = faults(), time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    dt, df = time.perf_counter() - t, faults() - f
    assert [len(o.token_ids) for o in outs] == [o for _, o in reqs]
    return dt, df


def run_transformers(hf, tokenizer, reqs, batch_size: int) -> tuple[float, int]:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    f, t = faults(), time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        chunk = reqs[i : i + batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        new = max(o for _, o in chunk)  # a static batch runs until its longest request is done
        with torch.inference_mode():
            hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                        do_sample=False, pad_token_id=pad)
    return time.perf_counter() - t, faults() - f


class Tree:
    """Another checkout's engine in a child process: `time()` runs the workload once there."""

    def __init__(self, root: Path, args: argparse.Namespace):
        env = {**os.environ, "PYTHONPATH": str(root)}
        cmd = [sys.executable, __file__, "--serve-engine", "--num-requests",
               str(args.num_requests), "--seed", str(args.seed), "--max-num-seqs",
               str(args.max_num_seqs), "--max-num-batched-tokens",
               str(args.max_num_batched_tokens)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        self.proc = subprocess.Popen(cmd, cwd=root, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                                     capture_output=True, text=True).stdout.strip() or str(root)
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline()
        if not ready.startswith("ready"):
            raise RuntimeError(f"{root}: the engine did not start ({ready!r})")

    def time(self) -> tuple[float, int]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        got = json.loads(self.proc.stdout.readline())
        return float(got["seconds"]), int(got["faults"])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(60)


def serve_engine(args: argparse.Namespace) -> None:
    """The child of `Tree`: load this tree's engine, warm it up, then time one run per line
    read from stdin."""
    llm = LLM(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    reqs = workload(llm.tokenizer, args.num_requests, args.seed)
    run_engine(llm, reqs[:4])
    print("ready", flush=True)
    for _ in sys.stdin:
        seconds, minflt = run_engine(llm, reqs)
        print(json.dumps({"seconds": seconds, "faults": minflt}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (every side)")
    ap.add_argument("--tree", type=Path, action="append", default=[],
                    help="another checkout whose engine is timed on the same workload "
                         "(repeatable)")
    ap.add_argument("--repeat", type=int, default=1, help="alternating runs of each system")
    ap.add_argument("--out", type=Path, default=None, help="append a markdown table row here")
    ap.add_argument("--serve-engine", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.serve_engine:
        return serve_engine(args)

    llm = LLM(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llm.engine.model_dir, dtype=torch.float32).eval()
    reqs = workload(llm.tokenizer, args.num_requests, args.seed)
    useful = sum(o for _, o in reqs)
    run_engine(llm, reqs[:4])  # warm-up both
    run_transformers(hf, llm.tokenizer, reqs[:2], 2)
    trees = [Tree(root, args) for root in args.tree]

    systems = {"transformers generate, static batches of 8":
               lambda: run_transformers(hf, llm.tokenizer, reqs, 8),
               "switchboard engine (this tree)": lambda: run_engine(llm, reqs)}
    for tree in trees:
        systems[f"switchboard engine ({tree.commit})"] = tree.time
    times: dict[str, list[float]] = {name: [] for name in systems}
    minflt: dict[str, list[int]] = {name: [] for name in systems}
    try:
        for _ in range(args.repeat):
            for name, fn in systems.items():
                seconds, f = fn()
                times[name].append(seconds)
                minflt[name].append(f)
    finally:
        for tree in trees:
            tree.close()

    tps = {name: useful / min(ts) for name, ts in times.items()}
    names = list(systems)
    hf_name, ours = names[0], names[1]
    print(f"machine: {describe()}")
    print(f"workload: {len(reqs)} requests, {useful} output tokens, seed {args.seed}, "
          f"{args.repeat} run(s) each, alternating; tok/s from each system's best run")
    print(f"{'system':<46} {'best s':>8} {'median s':>9} {'useful tok/s':>13} "
          f"{'page faults/run':>16}")
    for name in names:
        print(f"{name:<46} {min(times[name]):>8.1f} {statistics.median(times[name]):>9.1f} "
              f"{tps[name]:>13.1f} {int(statistics.median(minflt[name])):>16,}")
    print(f"ratio (this tree / transformers): {tps[ours] / tps[hf_name]:.2f}x")
    for tree, name in zip(trees, names[2:], strict=True):
        print(f"ratio (this tree / {tree.commit}): {tps[ours] / tps[name]:.2f}x")
    if args.out:
        others = "; ".join(f"{tree.commit} {tps[name]:.1f} ({tps[ours] / tps[name]:.2f}x)"
                           for tree, name in zip(trees, names[2:], strict=True))
        with args.out.open("a") as f:
            f.write(f"| {time.strftime('%Y-%m-%d')} | {describe()} | {len(reqs)} | {useful} | "
                    f"{args.repeat} | {tps[hf_name]:.1f} | {tps[ours]:.1f} | "
                    f"{tps[ours] / tps[hf_name]:.2f}x | {others or '-'} |\n")


if __name__ == "__main__":
    main()
