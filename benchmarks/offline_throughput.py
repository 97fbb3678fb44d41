"""Offline throughput: Switchboard's engine vs transformers' static batching, same run.

A mixed-length workload (prompts 16-384 tokens, outputs 16-128, ignore_eos) runs through
(a) the engine with continuous batching and (b) transformers' `generate` in static batches of
8 with left padding. Useful tokens/s = requested output tokens / wall time.

    .venv/bin/python benchmarks/offline_throughput.py [--num-requests 32] [--out FILE]
"""

from __future__ import annotations

import argparse
import random
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


def run_engine(llm: LLM, reqs) -> float:
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for _, o in reqs]
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    dt = time.perf_counter() - t
    assert [len(o.token_ids) for o in outs] == [o for _, o in reqs]
    return dt


def run_transformers(hf, tokenizer, reqs, batch_size: int) -> float:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    t = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        chunk = reqs[i : i + batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        new = max(o for _, o in chunk)  # a static batch runs until its longest request is done
        with torch.inference_mode():
            hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                        do_sample=False, pad_token_id=pad)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (both sides)")
    ap.add_argument("--out", type=Path, default=None, help="append a markdown table row here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    llm = LLM(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llm.engine.model_dir, dtype=torch.float32).eval()
    reqs = workload(llm.tokenizer, args.num_requests, args.seed)
    useful = sum(o for _, o in reqs)
    run_engine(llm, reqs[:4])  # warm-up both
    run_transformers(hf, llm.tokenizer, reqs[:2], 2)

    t_hf = run_transformers(hf, llm.tokenizer, reqs, 8)
    t_eng = run_engine(llm, reqs)
    eng_tps, hf_tps = useful / t_eng, useful / t_hf
    rows = [
        ("transformers generate, static batches of 8", t_hf, hf_tps),
        ("switchboard engine, continuous batching", t_eng, eng_tps),
    ]
    print(f"machine: {describe()}")
    print(f"workload: {len(reqs)} requests, {useful} output tokens, seed {args.seed}")
    print(f"{'system':<46} {'seconds':>8} {'useful tok/s':>13}")
    for name, t, tps in rows:
        print(f"{name:<46} {t:>8.1f} {tps:>13.1f}")
    print(f"ratio (engine / transformers): {eng_tps / hf_tps:.2f}x")
    if args.out:
        with args.out.open("a") as f:
            f.write(f"| {time.strftime('%Y-%m-%d')} | {describe()} | {len(reqs)} | {useful} | "
                    f"{hf_tps:.1f} | {eng_tps:.1f} | {eng_tps / hf_tps:.2f}x |\n")


if __name__ == "__main__":
    main()
