"""Suffix decoding on agent traffic: plain decoding, prompt lookup and suffix decoding on the
same multi-turn traces, one engine, same run, greedy (outputs must be identical).

    python benchmarks/suffix_decoding.py [--device cpu] [--dtype auto] [--batch 1]
        [--sessions 6] [--rounds 2] [--modes plain,ngram:4,suffix:4,suffix:8] [--out results.json]

Traces (each session's turns in order, each turn's prompt the whole conversation so far;
`--batch` sessions run side by side, their turns batched together):
  - agent: an incident agent. Turn 1 calls `search_logs` (a constrained tool call quoting the
    session's log lines), turn 2 writes a JSON record under a schema, turn 3 a two-sentence
    summary. Sessions differ in the service, ids, paths and regions in their logs, so what
    repeats across sessions is the skeleton (the tool call's, the record's keys, the
    summary's phrasing), not the values.
  - code_edit: each turn rewrites the function the turn before returned, renaming one more
    identifier, and shows the whole function; sessions start from different functions.
Modes: `plain`, `ngram:K` (prompt lookup), `suffix:K`, and `suffix-nohints:K` (suffix
decoding whose overlapped loop on CUDA drafts from the sequence alone, without the host's
hints from the corpus: an A/B of those). The first mode is the baseline. Every mode starts
each round from an empty suffix corpus: what suffix decoding drafts from earlier sessions it
learned within that run of the trace. The modes alternate over `--rounds`, and figures sum
the rounds; on a GPU each mode first runs `--batch` sessions untimed (Triton compiles a
kernel variant on its first call). Reported per trace and mode: decode time per output token
(after each request's first token: the prefill is the same in every mode) and its ratio to
the baseline's, accepted drafts, and output tokens per verify step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative import CODE, SCHEMA, SEARCH_LOGS, Totals, run  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.spec.speculative import PromptLookup, SpecStats, Speculator  # noqa: E402
from engine.spec.suffix import SuffixDrafter  # noqa: E402
from gateway.openai.tools import FALLBACK_SYSTEM  # noqa: E402
from grammar.spec import ConstraintSpec, parse_constraint  # noqa: E402
from grammar.tools import parse_tools, tool_constraint  # noqa: E402

SERVICES = [("billing", "invoices", "payments-eu-west-1"), ("auth", "sessions", "auth-core"),
            ("search", "queries", "index-us-east-2"), ("orders", "carts", "orders-db-ap-1"),
            ("media", "uploads", "blob-eu-central-1"), ("mail", "messages", "smtp-relay-2"),
            ("maps", "tiles", "geo-us-west-1"), ("chat", "threads", "chat-core-3")]
CODE_FUNCS = [
    CODE,
    '''def summarize_orders(orders, currency, exchange_rates):
    total = 0.0
    for order in orders:
        rate = exchange_rates.get(order.currency, 1.0)
        total += order.amount * rate
    return round(total, 2), currency''',
    '''def parse_log_line(line, field_separator, known_levels):
    parts = line.split(field_separator)
    if len(parts) < 3:
        return None
    level = parts[1] if parts[1] in known_levels else "INFO"
    return {"time": parts[0], "level": level, "message": parts[2]}''',
]
RENAMES = [["settings_store", "default_settings", "stored"], ["exchange_rates", "orders", "total"],
           ["field_separator", "known_levels", "parts"]]


def _logs(s: int) -> tuple[str, str]:
    service, noun, upstream = SERVICES[s % len(SERVICES)]
    base = 8800 + 37 * s
    lines = [f"12:0{i}:1{s % 10} {service} status=503 path=/v1/{noun}/{base + i} "
             f"upstream={upstream}" for i in range(3)]
    lines.insert(2, f"12:02:3{s % 10} health status=200 path=/v1/ping upstream=lb-{s}")
    ask = ("Logs:\n" + "\n".join(lines) + f"\n\nThe first failing request is service "
           f"{service}, path /v1/{noun}/{base}, upstream {upstream}. Search its logs.")
    return ask, service


Turn = tuple[str, ConstraintSpec | None, int]  # user message, constraint, max_tokens


def agent_turns(s: int) -> list[Turn]:
    """Each turn of agent session `s`."""
    ask, service = _logs(s)
    tool = tool_constraint(parse_tools([SEARCH_LOGS], "required"))
    record = parse_constraint({"type": "json_schema",
                               "json_schema": {"name": "r", "schema": SCHEMA}})
    return [(ask, tool, 64),
            (f"search_logs found 3 errors for {service} in the last hour. Describe the "
             "failing service as JSON.", record, 64),
            ("Write the incident summary for the on-call channel in two sentences.", None, 64)]


def code_turns(s: int) -> list[Turn]:
    func, names = CODE_FUNCS[s % len(CODE_FUNCS)], RENAMES[s % len(RENAMES)]
    first = (f"Rename the parameter {names[0]} to {names[0].split('_')[0]}_in in this function "
             f"and show the whole function:\n\n{func}")
    turns: list[Turn] = [(first, None, 96)]
    return turns + [
        (f"Now also rename {n} to {n}_value and show the whole function again.", None, 96)
        for n in names[1:]]


TRACES = {"agent": agent_turns, "code_edit": code_turns}


def run_trace(llm: LLM, turns_of, sessions: int, batch: int) -> tuple[Totals, list]:
    """Every session's turns, `batch` sessions side by side; (totals, every output's ids)."""
    tok, totals, outputs = llm.tokenizer, Totals(), []
    system = {"role": "system", "content": FALLBACK_SYSTEM.format(tools=json.dumps(SEARCH_LOGS))}
    for first in range(0, sessions, batch):
        group = list(range(first, min(first + batch, sessions)))
        chats = {s: [system] if turns_of is agent_turns else [] for s in group}
        plans = {s: turns_of(s) for s in group}
        for t in range(len(plans[group[0]])):
            prompts, params = [], []
            for s in group:
                text, constraint, max_tokens = plans[s][t]
                chats[s].append({"role": "user", "content": text})
                prompts.append(tok.encode(tok.apply_chat_template(
                    chats[s], tokenize=False, add_generation_prompt=True)))
                params.append(SamplingParams(max_tokens=max_tokens, temperature=0,
                                             constraint=constraint))
            part, ids = run(llm, prompts, params)
            totals.add(part)
            outputs += ids
            for s, out in zip(group, ids, strict=True):
                chats[s].append({"role": "assistant", "content": str(tok.decode(out))})
    return totals, outputs


def run_mode(llm: LLM, mode: str, max_batch: int, turns_of, sessions: int, batch: int
             ) -> tuple[Totals, list, Speculator | None]:
    """`run_trace` in `mode` from an empty prefix cache, and the mode's speculator."""
    llm.engine.reset_prefix_cache()
    llm.engine.speculator = spec = speculator(mode, max_batch)
    try:
        return *run_trace(llm, turns_of, sessions, batch), spec
    finally:
        llm.engine.speculator = None


def _k(mode: str) -> int:
    """The draft length of `mode` (0 for `plain`, which runs on the shortest's engine)."""
    return int(mode.split(":")[1]) if ":" in mode else 0


def speculator(mode: str, max_batch: int) -> Speculator | None:
    if mode == "plain":
        return None
    method, k = mode.split(":")
    if not method.startswith("suffix"):
        return Speculator(int(k), PromptLookup(), max_batch=max_batch)
    drafter = SuffixDrafter()
    if method == "suffix-nohints":  # the overlapped loop's drafts from the sequence alone
        drafter.hints = None  # type: ignore[assignment,method-assign]
    return Speculator(int(k), drafter, max_batch=max_batch)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--modes", default="plain,ngram:4,suffix:4,suffix:8")
    ap.add_argument("--traces", default="agent,code_edit")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    modes = args.modes.split(",")
    # A CUDA engine's verify graphs hold 1 + k queries a sequence, so each draft length gets
    # its own engine (the weights are loaded once per engine; plain decoding runs on the first).
    llms: dict[int, LLM] = {}
    ks = sorted({_k(mode) for mode in modes} - {0}) or [4]
    for k in ks:
        llms[k] = llm = LLM(model=args.model, device=args.device, dtype=args.dtype,
                            max_num_seqs=max(16, args.batch), num_pages=2048,
                            num_speculative_tokens=k)
        assert llm.engine.speculator is not None
        max_batch = llm.engine.speculator.max_batch  # the engine's choice for its device
        llm.engine.speculator = None
        llm.generate([llm.tokenizer.encode("warm up")], [SamplingParams(max_tokens=4)])
    machine = {"device": args.device, "dtype": str(llm.engine.cfg.dtype), "batch": args.batch,
               "sessions": args.sessions, "date": time.strftime("%Y-%m-%d")}
    report: dict[str, dict[str, object]] = {"machine": machine}
    for trace in args.traces.split(","):
        totals = {mode: Totals() for mode in modes}
        stats = {mode: SpecStats() for mode in modes}
        same = {mode: True for mode in modes}
        plain_ids = None
        if args.device != "cpu":  # what compiles on first use (Triton kernels) does so untimed
            for mode in modes:
                run_mode(llms[_k(mode) or ks[0]], mode, max_batch, TRACES[trace], args.batch,
                         args.batch)
        for _ in range(args.rounds):  # the modes alternate, so drift hits all alike
            for mode in modes:
                part, ids, spec = run_mode(llms[_k(mode) or ks[0]], mode, max_batch,
                                           TRACES[trace], args.sessions, args.batch)
                totals[mode].add(part)
                plain_ids = ids if plain_ids is None else plain_ids
                same[mode] &= ids == plain_ids
                if spec is not None:
                    for name in ("drafted", "accepted", "forwards", "emitted"):
                        setattr(stats[mode], name,
                                getattr(stats[mode], name) + getattr(spec.stats, name))
        base = totals[modes[0]]
        for mode in modes:
            t, s = totals[mode], stats[mode]
            per_token = t.decode_seconds / t.decode_tokens
            row: dict[str, object] = {"decode_ms_per_token": round(1000 * per_token, 2),
                   "speedup_vs_plain": round(base.decode_seconds / base.decode_tokens
                                             / per_token, 2),
                   "identical": same[mode],
                   "output_tokens": t.tokens,
                   "decode_tokens_per_step": round(t.decode_tokens / t.decode_steps, 2),
                   "acceptance": round(s.accepted / s.drafted, 3) if s.drafted else None,
                   "tokens_per_verify_step": round(s.emitted / s.forwards, 2)
                   if s.forwards else None}
            report[f"{trace}/{mode}"] = row
            print(f"{trace:10s} {mode:10s} {json.dumps(row)}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
