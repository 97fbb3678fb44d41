"""One line naming the machine a benchmark ran on (for the committed result tables)."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import torch


def describe() -> str:
    try:
        cpu = next(line.split(":", 1)[1].strip()
                   for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or "unknown CPU"
    mem = subprocess.run(["free", "-g"], capture_output=True, text=True).stdout.split()[7]
    return f"{cpu}, {torch.get_num_threads()} threads, {mem} GiB RAM, torch {torch.__version__}"
