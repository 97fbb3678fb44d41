"""The model's projections on CPU: `F.linear` against `kernels.linear.linear` (weight-first),
over every projection of the model in turn (the weights stream from memory as in a forward),
for each row count (a decode at batch 1 is one row; a verify step of k drafts, k + 1), same
process.

    python benchmarks/cpu_linear.py [--model PATH] [--rows 1 2 3 4 5 6 8 16 32 128] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from engine import LLM
from kernels import linear as linear_mod


def projections_ms(weights: list[torch.Tensor], rows: int, fn, repeats: int = 7) -> float:
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for w in weights:
            fn(xs[w.shape[1]], w)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8, 16, 32, 128])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    llm = LLM(model=args.model, max_num_seqs=4, num_pages=64)
    model = llm.engine.runner.model
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    report: dict[str, object] = {"threads": torch.get_num_threads()}
    print(f"{len(weights)} projections, {sum(w.numel() for w in weights) / 1e6:.1f} M weights, "
          f"{torch.get_num_threads()} threads")
    for rows in args.rows:
        base = projections_ms(weights, rows, F.linear)
        new = projections_ms(weights, rows, linear_mod.linear)
        report[f"projections/{rows}"] = {"F.linear_ms": round(base, 2),
                                         "weight_first_ms": round(new, 2),
                                         "speedup": round(base / new, 2)}
        print(f"rows {rows:4d}: F.linear {base:7.2f} ms  weight-first {new:7.2f} ms  "
              f"{base / new:.2f}x", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
