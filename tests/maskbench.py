"""Where the MaskBench dev set lives: `shared/maskbench-dev` beside the checkout."""

from __future__ import annotations

from pathlib import Path

MASKBENCH = Path(__file__).resolve().parents[2] / "shared" / "maskbench-dev"
