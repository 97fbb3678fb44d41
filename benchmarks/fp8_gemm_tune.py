"""The FP8 product at decode sizes: `torch._scaled_mm` (cuBLASLt, row-wise scales), bf16
`F.linear`, and `kernels.fp8.fp8_gemm_triton` over a grid of tiles, on Llama-3-8B's four
projections; the fraction of the copy bandwidth each reaches (weight bytes / time).

    python benchmarks/fp8_gemm_tune.py --out fp8_gemm.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_common import copy_bandwidth
from triton.testing import do_bench

from kernels.fp8 import decode_config, fp8_gemm_triton, quantize_rows, quantize_weight

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    args = ap.parse_args()
    bw = copy_bandwidth()
    res: dict = {"device": torch.cuda.get_device_name(), "copy_bw": bw, "shapes": {}}
    grid = list(itertools.product([32, 64], [256], [1, 2, 4], [4, 5], [4]))
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
        qw, sw = quantize_weight(w)
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            qx, sx = quantize_rows(x)
            row: dict = {}
            row["bf16"] = do_bench(partial(F.linear, x, w))
            row["scaled_mm"] = do_bench(partial(torch._scaled_mm, qx, qw.t(), scale_a=sx,
                                                scale_b=sw[None, :], out_dtype=torch.bfloat16))
            row["quantize"] = do_bench(partial(quantize_rows, x))
            row["default"] = do_bench(partial(fp8_gemm_triton, qx, sx, qw, sw, torch.bfloat16,
                                              *decode_config(n)))
            best = None
            for bn, bk, sk, st, wp in grid:
                try:
                    t = do_bench(partial(fp8_gemm_triton, qx, sx, qw, sw, torch.bfloat16, bn, bk,
                                         sk, st, wp))
                except Exception:  # noqa: BLE001 - a config out of shared memory
                    continue
                if best is None or t < best[0]:
                    best = (t, [bn, bk, sk, st, wp])
            assert best is not None
            row["triton"], row["triton_config"] = best
            row["fraction"] = {key: round(n * k / (row[key] * 1e-3) / bw, 3)
                               for key in ("scaled_mm", "triton", "default")}
            row["fraction"]["bf16"] = round(2 * n * k / (row["bf16"] * 1e-3) / bw, 3)
            res["shapes"][f"{name}_m{m}"] = row
            print(name, m, json.dumps(row), flush=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
