"""The GPU suite's bookkeeping, which runs on any machine: where its results go, and how runs
of some of its parts merge into one results file."""

from __future__ import annotations

import sys

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_suite import TARGETS, machine_name, merge  # noqa: E402


def test_results_files_are_named_for_the_card():
    assert machine_name("NVIDIA H100 80GB HBM3") == "h100"
    assert machine_name("NVIDIA H200") == "h200"
    assert machine_name("NVIDIA A100-SXM4-80GB") == "a100"
    assert machine_name("NVIDIA GeForce RTX 4090") == "nvidia-geforce-rtx-4090"
    assert machine_name("Some Accelerator") == "some-accelerator"


def _run(date: str, figures: dict) -> dict:
    return {"date": date, "device": "NVIDIA H200", "sections": {}, "workers": {},
            "gpu_tests": {"status": "skipped"}, "serve_smoke": {"status": "skipped"},
            **figures}


def test_partial_runs_merge_and_say_which_parts_ran():
    first = _run("d1", {"lora_vs_base_b64": 0.85, "roofline_fraction_b64": 0.80,
                        "runs": [{"date": "d1", "parts": ["engine"], "device": "NVIDIA H200"}]})
    merged = merge(first, _run("d2", {"lora_more_than_slots_vs_base": 0.59}), {"lora_slots"})
    assert merged["lora_vs_base_b64"] == 0.85 and merged["lora_more_than_slots_vs_base"] == 0.59
    assert [r["parts"] for r in merged["runs"]] == [["engine"], ["lora_slots"]]
    again = merge(merged, _run("d3", {"lora_vs_base_b64": 0.88}), {"engine"})
    assert again["lora_vs_base_b64"] == 0.88 and len(again["runs"]) == 3
    assert again["targets"] == TARGETS
