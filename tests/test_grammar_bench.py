"""grammar-bench: the MaskBench runner's CLI and JSON summary on a few dev-set cases."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from grammar.bench import CaseResult, summarize
from tests.maskbench import MASKBENCH

# Known-good cases, by the backend of the default chain that compiles them.
GOOD = {
    "BFCL_java_16": "llguidance",
    "Github_easy---o25976": "llguidance",
    "BFCL_parallel_multiple_23": "llguidance",
    "Synthesized---draft2019_09_valid_type_id79_subschema1_not_2": "llguidance-relaxed",  # not
    "Handwritten---mod305": "xgrammar",  # neither llguidance mode compiles it
}
KEYS = {
    "cases",
    "passing",
    "compile_errors",
    "validation_errors",
    "timeouts",
    "mask_us_p50",
    "mask_us_p99",
    "compile_ms_p50",
    "compile_ms_p99",
}


def bench(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "gateway.main", "grammar-bench", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not MASKBENCH.is_dir(), reason="needs the MaskBench dev set")
def test_bench_json_summary_on_known_good_cases():
    summary = bench(*(str(MASKBENCH / f"{name}.json") for name in GOOD), "--timeout", "20")
    assert set(summary) >= KEYS
    assert summary["cases"] == summary["passing"] == len(GOOD)
    assert summary["compile_errors"] == summary["validation_errors"] == summary["timeouts"] == 0
    assert 0 < summary["mask_us_p50"] <= summary["mask_us_p99"]
    assert 0 < summary["compile_ms_p50"] <= summary["compile_ms_p99"]
    assert summary["compiled_by"] == {"llguidance": 3, "llguidance-relaxed": 1, "xgrammar": 1}


def test_summary_counts_each_outcome():
    results = [
        CaseResult("a", "pass", "llguidance", 2.0, [10.0, 30.0]),
        CaseResult("b", "validation_error", "xgrammar", 4.0, [20.0]),
        CaseResult("c", "compile_error", detail="llguidance: Unimplemented keys"),
        CaseResult("d", "timeout", detail="xgrammar: compilation took over the 3s limit"),
    ]
    summary = summarize(results, "auto")
    assert summary["cases"] == 4 and summary["passing"] == 1
    assert summary["compile_errors"] == summary["validation_errors"] == summary["timeouts"] == 1
    assert summary["mask_us_p50"] == 20.0 and summary["compile_ms_p50"] == 3.0
    assert summary["compiled_by"] == {"llguidance": 1, "xgrammar": 1}
    assert summarize([], "auto")["mask_us_p99"] is None


# Handmade cases whose labels are deliberately wrong or whose schema is refused, with where the
# mask refuses each (SmolLM2's tokens: `{"a": "x|`y"}` is `{"`, `a`, `":`, ` "`, ...).
REPORT_CASES = {
    "mislabeled": {  # instance 1 breaks the schema but is marked valid
        "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        "tests": [{"data": {"a": 1}, "valid": True}, {"data": {"a": "x|`y"}, "valid": True}],
    },
    "loose": {  # satisfies the schema but is marked invalid
        "schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
        "tests": [{"data": {"a": 2}, "valid": False}],
    },
    "too_small": {  # `1` could still grow into an integer >= 10: the stop token is refused
        "schema": {"type": "integer", "minimum": 10},
        "tests": [{"data": 12, "valid": True}, {"data": 1, "valid": True}],
    },
    "bad_type": {  # fails its metaschema: refused before compiling
        "schema": {"type": "integr"},
        "tests": [{"data": 1, "valid": True}],
    },
    "fine": {"schema": {"type": "string"}, "tests": [{"data": "x", "valid": True}]},
}


def test_report_names_each_failures_reason(tmp_path, smollm2_dir, capsys):
    from grammar.bench import main

    for name, case in REPORT_CASES.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(case))
    common = [str(tmp_path), "--json", "--timeout", "20", "--tokenizer", str(smollm2_dir)]
    assert main([*common, "--report", str(tmp_path / "report.md")]) == 0
    # The default output is the summary alone; the report goes to its file.
    summary = json.loads(capsys.readouterr().out)
    assert summary["passing"] == 1 and summary["validation_errors"] == 3
    lines = (tmp_path / "report.md").read_text().splitlines()
    assert lines[0] == "grammar-bench --backend auto: 5 cases, 1 pass, 4 fail."
    rows = [line for line in lines if line.startswith("| ") and line != lines[2]]
    # Sorted by status then name; `|` inside a cell is escaped, so each row has 4 cells.
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows]
    assert [c[:3] for c in cells] == [
        ["bad_type", "compile_error", "—"],
        ["loose", "validation_error", "llguidance"],
        ["mislabeled", "validation_error", "llguidance"],
        ["too_small", "validation_error", "llguidance"],
    ]
    why = {c[0]: c[3] for c in cells}
    assert why["bad_type"].startswith("invalid JSON schema at type: ")
    assert why["loose"] == (
        'invalid instance 0 accepted: `{"a": 2}`; jsonschema finds it valid: the label disagrees'
    )
    assert why["mislabeled"] == (
        "valid instance 1 refused at token 3 `' \"'`: ``{\"a\":‸ \"x\\|`y\"}``; jsonschema finds"
        " it invalid too (type at $.a: 'x\\|`y' is not of type 'integer'): the case's label"
        " disagrees"
    )
    assert why["too_small"].startswith(
        "valid instance 1 refused at its end (token 1, the stop token: the grammar wants more):"
        " `1‸`; jsonschema finds it invalid too (minimum at $: 1 is less than the minimum of 10)"
    )



def test_report_without_file_goes_to_stdout(capsys):
    from grammar.bench import write_report

    results = [
        CaseResult("b", "timeout", detail="cannot compile this JSON schema: xgrammar: took over"),
        CaseResult("a", "validation_error", "xgrammar", 1.0, detail="valid instance 0 refused"),
        CaseResult("c", "pass", "llguidance", 1.0),
    ]
    write_report("-", results, "auto")
    assert capsys.readouterr().out.splitlines() == [
        "grammar-bench --backend auto: 3 cases, 1 pass, 2 fail.",
        "",
        "| case | status | backend | reason |",
        "|---|---|---|---|",
        "| b | timeout | — | cannot compile this JSON schema: xgrammar: took over |",
        "| a | validation_error | xgrammar | valid instance 0 refused |",
    ]


def test_a_long_jsonschema_message_keeps_its_verdict():
    from grammar.bench_report import MAX_MESSAGE, schema_error

    schema = {"oneOf": [{"type": "object"}, {"required": ["a"]}]}
    why = schema_error(schema, {"a": "x" * 300})
    assert why is not None and why.startswith("oneOf at $: {'a': 'xxx")
    assert "x… is valid under each of {" in why
    assert len(why) <= len("oneOf at $: ") + MAX_MESSAGE
    assert schema_error(schema, {"b": 1}) is None
