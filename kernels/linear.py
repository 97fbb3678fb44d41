"""The model's projections: `nn.Linear` whose CPU fp32 product is computed weight-first.

`F.linear(x, W)` is the GEMM `x @ W^T`. On CPUs, with few rows (a decode step, a verify step of
a few drafts), MKL runs it far below the memory bandwidth: a one-row product goes to its GEMV,
and a few rows to a GEMM path tuned for large ones. The same product taken as `(W @ x^T)^T`
runs several times faster there. Measured on this project's 2-core CPU (AMD EPYC, MKL 2024.2)
over all of SmolLM2-135M's projections, ms per forward (`benchmarks/cpu_linear.py`,
benchmarks/results/cpu_linear.md):

| rows | `F.linear` | weight-first |
|---|---|---|
| 1 | 34 | 17 (two columns: see below) |
| 4 | 52 | 20 |
| 128 | 257 | 218 |
| 256 | 480-704 | 565-759 |
| 512 | 763-1208 | 925-1385 |

(2026-11-27, the 256 and 512 rows over three runs.) Past `WEIGHT_FIRST_MAX_ROWS` rows (a
prefill step's) the plain GEMM is as fast or faster (the copy back of the transposed product
costs more than it saves), so those take `F.linear`. One row is computed as two equal columns:
the GEMM of two columns beats MKL's GEMV. The result is the same product, summed in a different
order (last-bit differences). Other dtypes take `F.linear`.

On CUDA, a product of up to `SMALL_M` rows captured into a decode graph takes
`kernels.decode_gemm` where its shape reads the weights faster than cuBLAS
(`bf16_decode_config`). Outside a graph (eager steps) cuBLAS's cheaper host launch wins, and
keeps the product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.decode_gemm import SMALL_M, bf16_decode_config, decode_gemm

WEIGHT_FIRST_MAX_ROWS = 64  # 96-256 rows: weight-first 0.89-1.04x F.linear's speed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; on CPU in fp32, up to `WEIGHT_FIRST_MAX_ROWS` rows, computed
    weight-first; on CUDA, up to `SMALL_M` rows in a captured graph, by `decode_gemm`."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    if (x.device.type == "cuda" and n <= SMALL_M and bias is None and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and rows.is_contiguous()
            and weight.is_contiguous() and torch.cuda.is_current_stream_capturing()):
        config = bf16_decode_config(n, *weight.shape)
        if config is not None:
            return decode_gemm(rows, weight, x.dtype, config).view(*x.shape[:-1], weight.shape[0])
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return F.linear(x, weight, bias)
    if n > WEIGHT_FIRST_MAX_ROWS:
        return F.linear(x, weight, bias)
    cols = rows.repeat(2, 1) if n == 1 else rows  # a two-column GEMM beats the GEMV
    out = torch.mm(weight, cols.t())[:, :n].t().contiguous()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """`nn.Linear` computed by `linear`. Its forward takes the projections' common arguments:
    `x_rows`, x quantized for an FP8 projection (`kernels.fp8.Fp8Linear`), is never given
    to a layer in the model's dtype."""

    def forward(self, x: torch.Tensor, x_rows: object = None) -> torch.Tensor:
        assert x_rows is None, "quantized rows for a layer that is not FP8"
        return linear(x, self.weight, self.bias)
