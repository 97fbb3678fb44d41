"""Constrained vs unconstrained decoding throughput at batch 16, same run (CPU by default).

Both sides run the same 16 prompts; the constrained side adds a JSON schema (compiled once
beforehand: this measures the per-step mask cost, not compilation). Throughput is measured on
full steps only (all `batch` requests running), so that constrained outputs ending earlier do
not change the prefill share: tokens/s = tokens delivered / time of those steps, best of
`--rounds` interleaved rounds (the machine is shared and noisy).

    .venv/bin/python benchmarks/structured_overhead.py [--batch 16] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import time

import torch

from engine import LLM, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "notes": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["title", "tags", "notes"],
}


def decode_tok_s(llm: LLM, prompts: list[str], params: SamplingParams) -> float:
    """Tokens per second over the steps in which every request is running (tokens the grammar
    forces count: they are output the step delivered)."""
    eng = llm.engine
    ids = [llm.tokenizer.encode(p) for p in prompts]
    for i, p in enumerate(ids):
        eng.add_request(f"bench-{time.monotonic_ns()}-{i}", p, params)
    tokens, seconds = 0, 0.0
    while eng.has_unfinished_requests():
        full = eng.num_running == len(prompts) and not eng.num_waiting
        t = time.perf_counter()
        outs = eng.step()
        if full and len(outs) == len(prompts):
            seconds += time.perf_counter() - t
            tokens += sum(len(o.new_token_ids) for o in outs)
    return tokens / seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    llm = LLM(max_num_seqs=args.batch)
    prompts = [f"Describe item number {i} of the catalogue as JSON:" for i in range(args.batch)]
    free = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=0, ignore_eos=True)
    constrained = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=1.0,
        seed=0,
        response_format={"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}},
    )
    t = time.perf_counter()
    llm.engine.grammar.compile(constrained.constraint).result()
    compile_s = time.perf_counter() - t
    decode_tok_s(llm, prompts[:2], free)  # warm-up
    best = {"free": 0.0, "constrained": 0.0}
    for _ in range(args.rounds):
        for name, params in (("free", free), ("constrained", constrained)):
            best[name] = max(best[name], decode_tok_s(llm, prompts, params))
    ratio = best["constrained"] / best["free"]
    print(f"threads: {torch.get_num_threads()}, batch {args.batch}, max_tokens {args.max_tokens}")
    print(f"compile (first, incl. worker start): {compile_s * 1000:.0f} ms")
    print(f"unconstrained: {best['free']:.1f} tok/s   constrained: {best['constrained']:.1f} tok/s")
    print(f"ratio (constrained / unconstrained): {ratio:.3f}")
    llm.engine.grammar.close()


if __name__ == "__main__":
    main()
