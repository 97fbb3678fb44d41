"""The bf16 product at decode sizes: cuBLAS (`F.linear`) against `kernels.decode_gemm` over a
grid of tiles (split K summed with atomics), on Llama-3-8B's four projections and its LM head;
microseconds per product and the fraction of the copy bandwidth each reaches (weight bytes /
time). `default` is `bf16_decode_config`'s choice (cuBLAS where it is None).

Timed as the decode graph runs them (`fp8_gemm_tune.graph_us`: 8 products over 8 distinct
weights in one CUDA graph, so none is served from L2). The FP8 weights' grid is
`fp8_gemm_tune.py`'s.

    python benchmarks/decode_gemm_tune.py --out decode_gemm.json [--rows 1 16 64]
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from fp8_gemm_tune import SHAPES, graph_us, sweep
from triton.runtime.errors import OutOfResources

from kernels.decode_gemm import SMALL_M, bf16_decode_config, decode_gemm

SHAPES_BF16 = {**SHAPES, "lm_head": (4096, 128256)}
GRID = [c for c in itertools.product([32, 64, 128], [64, 128, 256], [1, 4], [3, 4, 5], [4])
        if c[0] * c[1] <= 16384]


def tune(m: int, k: int, n: int, ws: list, bw: float) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x.float(), ws[0].float())

    def triton_us(config: tuple[int, ...]) -> float:
        got = decode_gemm(x, ws[0], torch.bfloat16, config).float()
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))
        return graph_us(lambda: [decode_gemm(x, w, torch.bfloat16, config) for w in ws])

    # Past SMALL_M rows `kernels.linear` takes cuBLAS whatever the table says.
    config = bf16_decode_config(m, n, k) if m <= SMALL_M else None
    row: dict = {"cublas": graph_us(lambda: [F.linear(x, w) for w in ws]), "grid": {}}
    row["default"] = row["cublas"] if config is None else triton_us(config)
    for config in GRID:
        try:
            row["grid"][str(config)] = triton_us(config)
        except OutOfResources:
            continue
    best = min(row["grid"], key=row["grid"].get)
    row["triton"], row["triton_config"] = row["grid"][best], best
    row["fraction"] = {key: round(2 * n * k / (row[key] * 1e-6) / bw, 3)
                       for key in ("cublas", "default", "triton")}
    return row


if __name__ == "__main__":
    sweep(SHAPES_BF16, tune)
