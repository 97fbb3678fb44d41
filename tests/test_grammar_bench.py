"""grammar-bench: the MaskBench runner's CLI and JSON summary on a few dev-set cases."""

from __future__ import annotations

import json
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
