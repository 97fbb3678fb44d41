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
from dataclasses import dataclass
from pathlib import Path

from engine import LLM, SamplingParams
from engine.spec.speculative import Speculator
from gateway.openai.tools import FALLBACK_SYSTEM
from grammar.spec import parse_constraint
from grammar.tools import parse_tools, tool_constraint

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

SEARCH_LOGS = {"type": "function", "function": {
    "name": "search_logs", "description": "Search the logs of one service.",
    "parameters": {"type": "object", "properties": {
        "service": {"type": "string"}, "path": {"type": "string"}, "upstream": {"type": "string"}},
        "required": ["service", "path", "upstream"], "additionalProperties": False}}}

# name -> (messages, constraint, agent): `agent` workloads make the agent trace; the
# free-text control copies little and is reported beside it.
TOOL_PROMPT = (f"Logs:\n{LOG}\n\nThe first failing request is service billing, path "
               "/v1/invoices/8812, upstream payments-eu-west-1. Search its logs.")
EDIT_PROMPT = ("Rename the parameter settings_store to store in this function and show the "
               f"whole function:\n\n{CODE}")
WORKLOADS = {
    "tool_call": ([{"role": "system",
                    "content": FALLBACK_SYSTEM.format(tools=json.dumps(SEARCH_LOGS))},
                   {"role": "user", "content": TOOL_PROMPT}],
                  tool_constraint(parse_tools([SEARCH_LOGS], "required")), True),
    "code_edit": ([{"role": "user", "content": EDIT_PROMPT}], None, True),
    "json_schema": ([{"role": "user", "content": f"Logs:\n{LOG}\n\nDescribe the failing "
                                                 "service as JSON."}],
                    parse_constraint({"type": "json_schema",
                                      "json_schema": {"name": "r", "schema": SCHEMA}}), True),
    "free_text": ([{"role": "user", "content": "Give three short tips for writing clear commit "
                                               "messages."}], None, False),
}


@dataclass
class Totals:
    """Output tokens, seconds and engine steps (each one forward at batch 1) of the runs
    added: whole requests, and their decode phase (after the step that gave every request of
    its run its first token: the prompts' prefill is the same with and without drafts)."""

    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    decode_steps: int = 0

    def add(self, other: Totals) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[Totals, list]:
    """The run's totals and its outputs' token ids."""
    eng = llm.engine
    step = eng.step
    ends: list[tuple[float, int]] = []  # per step: when it ended, tokens it produced
    started: set[str] = set()
    first_phase = 0  # steps until every request had a token

    def counting():
        nonlocal first_phase
        outs = step()
        ends.append((time.perf_counter(), sum(len(o.new_token_ids) for o in outs)))
        started.update(o.request_id for o in outs if o.new_token_ids)
        if not first_phase and len(started) == len(prompts):
            first_phase = len(ends)
        return outs

    eng.step = counting
    try:
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        dt = time.perf_counter() - t
    finally:
        del eng.step
    tokens = sum(len(o.token_ids) for o in outs)
    later = ends[first_phase:]
    return Totals(tokens, dt, len(ends), sum(n for _, n in later),
                  ends[-1][0] - ends[first_phase - 1][0], len(later)), [o.token_ids for o in outs]


def summary(off: Totals, on: Totals) -> dict[str, float]:
    def rate(t: Totals, decode: bool = False) -> float:
        return t.decode_tokens / t.decode_seconds if decode else t.tokens / t.seconds

    return {"off_tok_s": round(rate(off), 1), "on_tok_s": round(rate(on), 1),
            "speedup": round(rate(on) / rate(off), 2),
            "decode_off_tok_s": round(rate(off, True), 1),
            "decode_on_tok_s": round(rate(on, True), 1),
            "decode_speedup": round(rate(on, True) / rate(off, True), 2),
            "decode_tokens_per_step_off": round(off.decode_tokens / off.decode_steps, 2),
            "decode_tokens_per_step_on": round(on.decode_tokens / on.decode_steps, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step")
    ap.add_argument("--batch", type=int, default=4, help="requests of a workload run together")
    ap.add_argument("--max-tokens", type=int, default=80)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    llm = LLM(model=args.model, max_num_seqs=16, num_pages=1024,
              num_speculative_tokens=args.k)
    assert llm.engine.speculator is not None
    max_batch = llm.engine.speculator.max_batch  # the engine's choice for its device
    llm.engine.speculator = None
    tok = llm.tokenizer
    llm.generate([tok.encode("warm up")], [SamplingParams(max_tokens=4)])
    report: dict[str, dict] = {}
    trace = {group: (Totals(), Totals()) for group in ("agent", "all")}
    for name, (messages, constraint, agent) in WORKLOADS.items():
        ids = tok.encode(tok.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True))
        for mode, temperature in (("greedy", 0.0), ("sampled", 0.7)):
            params = [SamplingParams(max_tokens=args.max_tokens, temperature=temperature,
                                     seed=i, constraint=constraint) for i in range(args.batch)]
            prompts = [ids] * args.batch
            off, on, same = Totals(), Totals(), True
            stats = None
            llm.generate(prompts[:1], params[:1])  # untimed: compiles the grammar, if any
            for _ in range(args.rounds):  # alternating, so drift hits both alike
                llm.engine.reset_prefix_cache()
                totals, base = run(llm, prompts, params)
                off.add(totals)
                llm.engine.reset_prefix_cache()
                llm.engine.speculator = stats = Speculator(args.k, max_batch=max_batch)
                try:
                    totals, spec = run(llm, prompts, params)
                finally:
                    llm.engine.speculator = None
                on.add(totals)
                same &= spec == base
            for group in ("agent", "all") if agent else ("all",):
                trace[group][0].add(off)
                trace[group][1].add(on)
            s = stats.stats if stats else None
            row = {**summary(off, on), "identical": same,
                   "acceptance": round(s.accepted / s.drafted, 3) if s and s.drafted else None,
                   "tokens_per_drafted_forward":
                       round(s.emitted / s.forwards, 2) if s and s.forwards else None}
            report[f"{name}/{mode}"] = row
            print(f"{name:12s} {mode:8s} {json.dumps(row)}", flush=True)
    same = all(r["identical"] for r in report.values())
    for group, (off, on) in trace.items():
        report[f"trace/{group}"] = {**summary(off, on), "identical": same}
        print(f"{'trace/' + group:21s} {json.dumps(report[f'trace/{group}'])}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
