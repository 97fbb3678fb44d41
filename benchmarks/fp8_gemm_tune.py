"""The FP8 product at decode sizes: `torch._scaled_mm` (cuBLASLt, row-wise scales), bf16
`F.linear`, the activation quantization, and `kernels.fp8.fp8_gemm_triton` over a grid of
tiles (split K summed with atomics), on Llama-3-8B's four projections; microseconds per
product and the fraction of the copy bandwidth each reaches (weight bytes / time).

Each product is timed as the decode graph runs it: inside a CUDA graph, 8 products over 8
distinct weights (so none is served from L2), the graph's replay time / 8. Timed one launch at
a time, a product of this size measures the host's launch instead (a 2 us quantization read
24 us that way).

    python benchmarks/fp8_gemm_tune.py --out fp8_gemm.json [--rows 1 16 64]
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_common import copy_bandwidth
from triton.testing import do_bench

from kernels.fp8 import (
    decode_config,
    fp8_gemm_triton,
    fp8_matmul_reference,
    quantize_rows,
    quantize_weight,
)

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
WEIGHTS = 8  # distinct weights a graph cycles through


def graph_us(products: Callable[[], object]) -> float:
    """Microseconds per product of `products` (which runs `WEIGHTS` of them) in a CUDA graph."""
    products()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        products()
    return do_bench(graph.replay, warmup=5, rep=40, return_mode="median") * 1e3 / WEIGHTS


def grid(m: int) -> list[tuple[int, int, int, int, int]]:
    """(block_n, block_k, split_k, num_stages, num_warps) configurations tried at `m` rows."""
    if m > 16:
        return [c for c in itertools.product([32, 64, 128], [128, 256], [1, 2, 4, 8], [3, 4, 5],
                                             [4, 8]) if c[4] == 4 or c[0] == 128]
    return list(itertools.product([32, 64, 128], [256, 512], [1, 2, 4, 8], [4], [4]))


def tune(m: int, k: int, n: int, wb: list, bw: float) -> dict:
    """One shape at `m` rows over the bf16 weights `wb` and their FP8 quantization."""
    bf16 = torch.bfloat16
    ws = [quantize_weight(w) for w in wb]
    x = torch.randn(m, k, device="cuda", dtype=bf16)
    qx, sx = quantize_rows(x)
    ref = fp8_matmul_reference(qx, sx, *ws[0], torch.float32)

    def triton_us(config: tuple[int, ...]) -> float:
        got = fp8_gemm_triton(qx, sx, *ws[0], bf16, *config).float()
        assert torch.allclose(got, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))
        return graph_us(lambda: [fp8_gemm_triton(qx, sx, q, s, bf16, *config) for q, s in ws])

    row: dict = {"bf16": graph_us(lambda: [F.linear(x, w) for w in wb]),
                 "quantize": graph_us(lambda: [quantize_rows(x) for _ in ws])}
    if m >= 16:  # cuBLASLt's FP8 kernels take rows in multiples of 16
        row["scaled_mm"] = graph_us(lambda: [
            torch._scaled_mm(qx, q.t(), scale_a=sx, scale_b=s[None, :], out_dtype=bf16)
            for q, s in ws])
    row["default"] = triton_us(decode_config(m, n, k))
    row["grid"] = {str(c): triton_us(c) for c in grid(m)}
    best = min(row["grid"], key=row["grid"].get)
    row["triton"], row["triton_config"] = row["grid"][best], best
    row["fraction"] = {key: round(n * k / (row[key] * 1e-6) / bw, 3)
                       for key in ("scaled_mm", "triton", "default") if key in row}
    row["fraction"]["bf16"] = round(2 * n * k / (row["bf16"] * 1e-6) / bw, 3)
    return row


def sweep(shapes: dict[str, tuple[int, int]],
          tune_rows: Callable[[int, int, int, list[torch.Tensor], float], dict]) -> None:
    """The command line of both tuners (`--out FILE [--rows ...]`): for each shape (K, N),
    `WEIGHTS` bf16 weights, and `tune_rows(m, k, n, weights, copy rate)` at each row count;
    the JSON rewritten after each."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    args = ap.parse_args()
    bw = copy_bandwidth()
    res: dict = {"device": torch.cuda.get_device_name(), "copy_bw": bw, "shapes": {}}
    for name, (k, n) in shapes.items():
        w = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(WEIGHTS)]
        for m in args.rows:
            row = tune_rows(m, k, n, w, bw)
            res["shapes"][f"{name}_m{m}"] = row
            print(name, m, {key: row[key] for key in row if key != "grid"}, flush=True)
            args.out.write_text(json.dumps(res, indent=2) + "\n")
        del w
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sweep(SHAPES, tune)
