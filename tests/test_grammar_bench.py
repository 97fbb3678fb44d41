"""grammar-bench: the MaskBench runner's CLI and JSON summary on a few dev-set cases."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

MASKBENCH = Path("/work/shared/maskbench-dev")
# Cases every configuration passes, and one whose schema no backend can enforce exactly.
GOOD = ["BFCL_java_16", "Glaiveai2K---calculate_area_1", "Handwritten---oneof13"]
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

pytestmark = pytest.mark.skipif(not MASKBENCH.is_dir(), reason="needs the MaskBench dev set")


def bench(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "grammar.bench", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_bench_json_summary_on_known_good_cases():
    summary = bench(*(str(MASKBENCH / f"{name}.json") for name in GOOD), "--timeout", "10")
    assert set(summary) >= KEYS
    assert summary["cases"] == len(GOOD)
    assert summary["passing"] == len(GOOD)
    assert summary["compile_errors"] == summary["validation_errors"] == summary["timeouts"] == 0
    assert 0 < summary["mask_us_p50"] <= summary["mask_us_p99"]
    assert 0 < summary["compile_ms_p50"] <= summary["compile_ms_p99"]
