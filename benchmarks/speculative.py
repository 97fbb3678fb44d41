"""Speculative decoding on agent-shaped requests: the same engine with and without prompt-lookup
drafts, in one run, on the embedded model (or any `--model`).

    python benchmarks/speculative.py [--k 4] [--rounds 2] [--out results.json]

Workloads (chat prompts, outputs of 48-96 tokens, a few requests at a time as one agent's
calls run):
  - tool_call: a JSON tool call whose arguments quote a log excerpt in the context;
  - code_edit: a function rewritten with one name changed (the rest is copied);
  - json_schema: a record under a JSON schema (constrained: drafts start with the tokens the
    grammar forces, then copy values from the context);
  - free_text: an answer that copies little (where drafts are rejected and turn off).
Each is run greedy and sampled (T=0.7, a seed per request). Reported per workload: output
tok/s off and on and their ratio, draft acceptance, tokens per drafted forward, and whether
the outputs were identical (they must be: speculation never changes a token); then the whole
trace: tok/s off and on, and output tokens per engine step (at --batch 1, per forward).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from engine import LLM, SamplingParams
from engine.speculative import Speculator

LOG = """12:01:07 billing status=503 path=/v1/invoices/8812 upstream=payments-eu-west-1
12:01:09 billing status=503 path=/v1/invoices/8813 upstream=payments-eu-west-1
12:01:12 auth status=200 path=/v1/sessions/refresh upstream=auth-core
12:01:15 billing status=503 path=/v1/invoices/8815 upstream=payments-eu-west-1"""

CODE = '''def load_user_settings(user_id, settings_store, default_settings):
    stored = settings_store.get(user_id)
    if stored is None:
        return dict(default_settings)
    merged = dict(default_settings)
    merged.update(stored)
    return merged'''

SCHEMA = {"type": "object", "properties": {"service": {"type": "string", "maxLength": 24},
                                           "status": {"type": "integer"},
                                           "upstream": {"type": "string", "maxLength": 40}},
          "required": ["service", "status", "upstream"], "additionalProperties": False}

WORKLOADS = {
    "tool_call": (f"Logs:\n{LOG}\n\nCall the tool search_logs with a JSON object "
                  '{"service": ..., "path": ..., "upstream": ...} for the first failing line. '
                  "Reply with the JSON only.", None),
    "code_edit": (f"Rename the parameter settings_store to store in this function and show "
                  f"the whole function:\n\n{CODE}", None),
    "json_schema": (f"Logs:\n{LOG}\n\nDescribe the failing service as JSON.",
                    {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}),
    "free_text": ("Give three short tips for writing clear commit messages.", None),
}


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, list]:
    """Output tok/s and the outputs; adds the run's tokens, seconds and engine steps (each one
    forward) to `TOTALS`."""
    eng, steps = llm.engine, 0
    step = eng.step

    def counting():
        nonlocal steps
        steps += 1
        return step()

    eng.step = counting
    try:
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        dt = time.perf_counter() - t
    finally:
        del eng.step
    tokens = sum(len(o.token_ids) for o in outs)
    mode = "on" if eng.speculator else "off"
    for key, value in ((f"{mode}_tokens", tokens), (f"{mode}_s", dt), (f"{mode}_steps", steps)):
        TOTALS[key] = TOTALS.get(key, 0) + value
    return tokens / dt, [o.token_ids for o in outs]


TOTALS: dict[str, float] = {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step")
    ap.add_argument("--batch", type=int, default=4, help="requests of a workload run together")
    ap.add_argument("--max-tokens", type=int, default=80)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    llm = LLM(model=args.model, max_num_seqs=16, num_pages=1024)
    tok = llm.tokenizer
    llm.generate([tok.encode("warm up")], [SamplingParams(max_tokens=4)])
    report: dict[str, dict] = {}
    for name, (text, rf) in WORKLOADS.items():
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}],
                                                 tokenize=False, add_generation_prompt=True))
        for mode, temperature in (("greedy", 0.0), ("sampled", 0.7)):
            params = [SamplingParams(max_tokens=args.max_tokens, temperature=temperature,
                                     seed=i, response_format=rf) for i in range(args.batch)]
            prompts = [ids] * args.batch
            off, on, same = [], [], True
            stats = None
            for _ in range(args.rounds):  # alternating, so drift hits both alike
                llm.engine.reset_prefix_cache()
                rate, base = run(llm, prompts, params)
                off.append(rate)
                llm.engine.reset_prefix_cache()
                llm.engine.speculator = stats = Speculator(args.k)
                try:
                    rate, spec = run(llm, prompts, params)
                finally:
                    llm.engine.speculator = None
                on.append(rate)
                same &= spec == base
            s = stats.stats if stats else None
            row = {"off_tok_s": round(max(off), 1), "on_tok_s": round(max(on), 1),
                   "speedup": round(max(on) / max(off), 2), "identical": same,
                   "acceptance": round(s.accepted / s.drafted, 3) if s and s.drafted else None,
                   "tokens_per_drafted_forward":
                       round(s.emitted / s.forwards, 2) if s and s.forwards else None}
            report[f"{name}/{mode}"] = row
            print(f"{name:12s} {mode:8s} {json.dumps(row)}", flush=True)
    t = TOTALS  # the whole trace: every workload and mode, every round
    report["trace"] = {
        "off_tok_s": round(t["off_tokens"] / t["off_s"], 1),
        "on_tok_s": round(t["on_tokens"] / t["on_s"], 1),
        "speedup": round(t["on_tokens"] / t["on_s"] / (t["off_tokens"] / t["off_s"]), 2),
        "tokens_per_step_off": round(t["off_tokens"] / t["off_steps"], 2),
        "tokens_per_step_on": round(t["on_tokens"] / t["on_steps"], 2),
        "identical": all(r["identical"] for r in report.values()),
    }
    print(f"{'trace':21s} {json.dumps(report['trace'])}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
