"""Tokens per valid JSON document under `response_format` json_schema, on MaskBench dev schemas.

Whitespace between JSON tokens is bounded (grammar.spec.JSON_MAX_WHITESPACE); before that, a
small model padded its JSON with newlines and ran into `max_tokens`. Each case asks SmolLM2 (chat
template) for an instance of one dev schema, greedy, under that schema; a document is valid when
it finished with "stop" and validates. Run once per checkout, then compare:

    .venv/bin/python benchmarks/json_whitespace.py --out after.json
    # /tmp/base: `git archive <before> | tar -x`, plus this script
    (cd /tmp/base && PYTHONPATH=$PWD $VENV/bin/python benchmarks/json_whitespace.py \
        --dev $DEV --out /tmp/before.json)
    .venv/bin/python benchmarks/json_whitespace.py --compare /tmp/before.json after.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

DEV = Path(__file__).resolve().parents[2] / "shared" / "maskbench-dev"
# String literals, so that what remains is the JSON between tokens.
STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def pick_schemas(dev: Path, n: int, max_bytes: int) -> list[tuple[str, dict]]:
    """`n` small schemas spread deterministically over the dev set (name order)."""
    files = sorted(dev.glob("*.json"))
    picked = []
    for f in files[:: max(1, len(files) // (3 * n))]:
        schema = json.loads(f.read_text())["schema"]
        if len(json.dumps(schema)) <= max_bytes:
            picked.append((f.stem, schema))
    return picked[:n]


def whitespace_between_tokens(text: str) -> int:
    """Whitespace characters outside JSON string literals."""
    return sum(c.isspace() for c in STRING.sub('""', text))


def run(dev: Path, n: int, max_tokens: int, max_bytes: int) -> dict:
    import jsonschema

    from engine import LLM, SamplingParams

    cases = pick_schemas(dev, n, max_bytes)
    llm = LLM(max_num_seqs=len(cases))
    prompts, params = [], []
    for i, (_, schema) in enumerate(cases):
        ask = f"Write a JSON instance of this JSON schema:\n{json.dumps(schema)}"
        text = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": ask}], add_generation_prompt=True, tokenize=False
        )
        prompts.append(llm.tokenizer.encode(text, add_special_tokens=False))
        rf = {"type": "json_schema", "json_schema": {"name": f"c{i}", "schema": schema}}
        params.append(SamplingParams(max_tokens=max_tokens, temperature=0, response_format=rf))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    rows = []
    for (name, schema), out in zip(cases, outs, strict=True):
        valid = False
        if out.finish_reason == "stop":
            try:
                jsonschema.validate(json.loads(out.text), schema)
                valid = True
            except (ValueError, jsonschema.ValidationError):
                pass
        rows.append({"case": name, "finish": out.finish_reason, "valid": valid,
                     "tokens": len(out.token_ids), "ws": whitespace_between_tokens(out.text)})
    return {"max_tokens": max_tokens, "seconds": round(seconds, 1), "cases": rows}


def summary(result: dict, only: set[str] | None = None) -> dict[str, float]:
    rows = [r for r in result["cases"] if only is None or r["case"] in only]
    valid = [r for r in rows if r["valid"]]
    return {
        "cases": len(rows),
        "valid": len(valid),
        "tokens/valid doc": mean([r["tokens"] for r in valid]),
        "whitespace/valid doc": mean([r["ws"] for r in valid]),
        "length": sum(r["finish"] == "length" for r in rows) / max(1, len(rows)),
        "error": sum(r["finish"] == "error" for r in rows),
    }


def mean(xs: list[int]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def compare(before: dict, after: dict) -> str:
    both = {r["case"] for r in before["cases"] if r["valid"]}
    both &= {r["case"] for r in after["cases"] if r["valid"]}
    lines = ["| run | cases | valid docs | tokens / valid doc | whitespace chars / valid doc "
             "| ended in `length` | errors | tokens / doc, valid in both |",
             "|---|---|---|---|---|---|---|---|"]
    for label, result in (("before", before), ("after", after)):
        s, p = summary(result), summary(result, both)
        lines.append(
            f"| {label} | {s['cases']} | {s['valid']} | {s['tokens/valid doc']:.1f} | "
            f"{s['whitespace/valid doc']:.1f} | {s['length']:.0%} | {s['error']} | "
            f"{p['tokens/valid doc']:.1f} ({p['valid']} docs) |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dev", type=Path, default=DEV, help="the MaskBench dev set")
    ap.add_argument("--cases", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-schema-bytes", type=int, default=1500)
    ap.add_argument("--out", type=Path, help="write the per-case results here (JSON)")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args()
    if args.compare:
        before, after = (json.loads(p.read_text()) for p in args.compare)
        print(compare(before, after))
        return
    if not args.dev.is_dir():
        sys.exit(f"the MaskBench dev set is not at {args.dev}")
    result = run(args.dev, args.cases, args.max_tokens, args.max_schema_bytes)
    print(json.dumps(summary(result)), f"{result['seconds']} s")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
