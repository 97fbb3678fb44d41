"""FP8 (E4M3) linear layers: weights with a scale per output channel, activations with a scale
per token, products accumulated in fp32.

A weight row `w_n` is stored as `q_n = round(w_n / s_n)` in float8_e4m3fn with `s_n =
max|w_n| / 448` (448: E4M3's largest finite value); an activation row `x_m` likewise with `t_m
= max|x_m| / 448`, found when the layer runs (dynamic scaling). Then

    y[m, n] = t_m * s_n * sum_k qx[m, k] * qw[n, k]

On Hopper (and Ada) the sum runs on the FP8 tensor cores (`torch._scaled_mm` with row-wise
scales) and the weights are read at one byte each, half of bf16's. Elsewhere
`fp8_matmul_reference` computes the same formula in fp32 from the dequantized operands: it is
the CPU path and the reference the GPU path is tested against. The activation quantization is
one Triton kernel on CUDA (`quantize_rows_triton`, one program per row) and
`quantize_rows_torch` elsewhere.

LoRA adapters stay in the model dtype and see the layer's unquantized input
(`lora.layers.LoraLinear` wraps an `Fp8Linear` as it wraps a `Linear`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import nn

from kernels.decode_gemm import SMALL_M, decode_gemm

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_MIN_AMAX = 1e-12  # an all-zero row gets this scale's floor instead of dividing by zero


class Fp8Rows(NamedTuple):
    """An activation's rows as `quantize_rows` makes them, from the kernel that produced the
    activation (`kernels.fused.add_rms_norm_fp8`, `silu_mul_fp8`), so the FP8 product that
    reads them needs no quantization launch of its own."""

    q: torch.Tensor  # [M, K] float8_e4m3fn
    scale: torch.Tensor  # [M, 1] fp32


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [out, in] -> (FP8 [out, in], fp32 scales [out]), one scale per output row."""
    w32 = w.float()
    scale = w32.abs().amax(dim=1).clamp(min=_MIN_AMAX) / FP8_MAX
    return (w32 / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] -> (FP8 [M, K], fp32 scales [M, 1]), one scale per row.

    Semantics: t = max(max|x_m|, 1e-12) / 448 (in fp32); q = clamp(x / t, +-448) rounded to
    the nearest E4M3 value."""
    x32 = x.float()
    scale = x32.abs().amax(dim=1, keepdim=True).clamp(min=_MIN_AMAX) / FP8_MAX
    return (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_torch`'s contract: Triton on CUDA, torch elsewhere."""
    return quantize_rows_triton(x) if x.is_cuda else quantize_rows_torch(x)


def fp8_matmul_reference(qx: torch.Tensor, sx: torch.Tensor, qw: torch.Tensor,
                         sw: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """qx [M, K] FP8 with scales sx [M, 1]; qw [N, K] FP8 with scales sw [N] -> [M, N] in
    `out_dtype`: (qx @ qw^T) * sx * sw, in fp32."""
    return (torch.mm(qx.float(), qw.float().t()) * sx * sw[None, :]).to(out_dtype)


@functools.cache
def scaled_mm_supported(device: torch.device) -> bool:
    """FP8 tensor cores: compute capability 8.9 (Ada) or later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None,
               weight_values: torch.Tensor | None = None,
               x_rows: Fp8Rows | None = None) -> torch.Tensor:
    """`F.linear(x, dequantized weight, bias)` with x quantized per token: x [..., K]; weight
    [N, K] FP8 with `weight_scale` [N] -> [..., N] in x's dtype. `weight_values`: the FP8
    weight's values in fp32, if the caller keeps them (`fp8_matmul_reference`'s operand
    where there are no FP8 tensor cores). `x_rows`: x already quantized (`Fp8Rows`)."""
    rows = x.reshape(-1, x.shape[-1])
    qx, sx = quantize_rows(rows) if x_rows is None else x_rows
    if rows.shape[0] <= SMALL_M and scaled_mm_supported(x.device):
        y = fp8_gemm_triton(qx, sx, weight, weight_scale, x.dtype,
                            *decode_config(rows.shape[0], *weight.shape))
    elif scaled_mm_supported(x.device):
        # Row-wise scaling takes bf16 output; qw^T is column-major, as cuBLASLt wants it.
        y = torch._scaled_mm(qx, weight.t(), scale_a=sx, scale_b=weight_scale[None, :],
                             out_dtype=torch.bfloat16)
        y = y if x.dtype == torch.bfloat16 else y.to(x.dtype)
    else:
        qw = weight if weight_values is None else weight_values
        y = fp8_matmul_reference(qx, sx, qw, weight_scale, x.dtype)
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], weight.shape[0])


class Fp8Linear(nn.Module):
    """A linear layer whose weight is FP8 with a scale per output channel; the bias (if any)
    stays in the model dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8,
                                               device=device), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32,
                                                     device=device), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device),
                                  requires_grad=False) if bias else None)
        self._values: torch.Tensor | None = None  # `weight_values`, and the weight they are of
        self._values_of: tuple[int, int] | None = None

    @classmethod
    def quantize(cls, linear: nn.Linear) -> Fp8Linear:
        """`linear`'s weights quantized (per output channel), on its device."""
        w = linear.weight
        out = cls(linear.in_features, linear.out_features, linear.bias is not None,
                  dtype=w.dtype, device=w.device)
        q, s = quantize_weight(w.detach())
        out.weight.data, out.weight_scale.data = q, s
        if linear.bias is not None:
            assert out.bias is not None
            out.bias.data = linear.bias.detach()
        return out

    def dequantized(self) -> torch.Tensor:
        """The weight as fp32 [out, in] (tests, references)."""
        return self.weight.float() * self.weight_scale[:, None]

    def weight_values(self) -> torch.Tensor:
        """The FP8 weight's values in fp32, converted once per weight: the reference path's
        operand. (On a 2-core CPU converting SmolLM2's E4M3 weights at every forward took 0.27
        s of a 0.38 s decode step.)"""
        key = (self.weight.data_ptr(), self.weight._version)
        if self._values is None or self._values_of != key:
            self._values, self._values_of = self.weight.float(), key
        return self._values

    def forward(self, x: torch.Tensor, x_rows: Fp8Rows | None = None) -> torch.Tensor:
        """`x_rows`: x already quantized, by the kernel that made x."""
        values = None if scaled_mm_supported(x.device) else self.weight_values()
        return fp8_linear(x, self.weight, self.weight_scale, self.bias, values, x_rows)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8"


# --- Triton -----------------------------------------------------------------------------


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_torch`'s contract in one kernel, one program per row."""
    m, k = x.shape
    assert x.stride(1) == 1, "rows must be contiguous"
    q = torch.empty((m, k), dtype=torch.uint8, device=x.device)  # FP8 bytes (see the kernel)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block = min(triton.next_power_of_2(k), 4096)
    _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), BLOCK=block,
                                num_warps=4 if block <= 1024 else 8)
    return q.view(FP8), scale


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, s_x, s_q, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    x_row = x_ptr + row * s_x
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, K, BLOCK):
        k = start + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / 448.0
    tl.store(scale_ptr + row, scale)
    for start in range(0, K, BLOCK):
        k = start + tl.arange(0, BLOCK)
        v = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * s_q + k, e4m3_bytes(v, scale), mask=k < K)


@triton.jit
def quantize_row_into(v, ok, q_row_ptr, scale_ptr, cols):
    """One whole row `v` (fp32 values of the activation's dtype; `ok` masks the padding) into
    its E4M3 bytes at `q_row_ptr + cols` and its scale at `scale_ptr`: `quantize_rows`'s
    semantics, for kernels that make the row (kernels/fused.py)."""
    scale = tl.maximum(tl.max(tl.where(ok, tl.abs(v), 0.0), axis=0), 1e-12) / 448.0
    tl.store(scale_ptr, scale)
    tl.store(q_row_ptr + cols, e4m3_bytes(v, scale), mask=ok)


@triton.jit
def e4m3_bytes(v, scale):
    """fp32 v / scale, clamped to +-448 and rounded to E4M3 (to nearest, ties to even, as
    torch rounds), as bytes: the CPU interpreter (TRITON_INTERPRET=1, the tests) takes no FP8
    tensors. (The interpreter drops the carry of a value rounded up to the next power of
    two: tests/test_fp8_linear.py.)"""
    v = tl.clamp(v / scale, -448.0, 448.0).to(tl.float8e4nv, fp_downcast_rounding="rtne")
    return v.to(tl.uint8, bitcast=True)


# Decode-sized products: cuBLASLt's FP8 kernel for 64 rows tiles 128 x 128 (32 programs over
# N = 4096 on 132 SMs). `kernels.decode_gemm` tiles N narrowly (BLOCK_N columns a program), all
# rows in one tile. H200, Llama-3-8B's four projections, each timed in a CUDA graph over 8
# distinct weights: 85 us a layer at 64 rows and 77 at 1-16 (cuBLASLt 110 at 64 rows, bf16 132-140);
# 0.36-0.82 of the copy bandwidth, the narrow projections lowest (benchmarks/fp8_gemm_tune.py).


def decode_config(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(block_n, block_k, split_k, num_stages, num_warps) for a decode-sized product of `m`
    rows, `n` output columns and depth `k`. From `benchmarks/fp8_gemm_tune.py` on an H200
    (rows 1, 16 and 64; Llama-3-8B's projections; 168 configurations at 64 rows, 42 at 1-16):

    - deep and narrow (`down`, K = 3.5 N): K split 4 ways, summed with atomics (20.6-23.8 us
      against 26.6-28.6 unsplit); splitting was slower for every other shape;
    - the widest (`gate_up`, N = 28,672): 128-column tiles (33.7-36.3 us against 40.2-41.1
      with 32 or 64);
    - the rest: 64 columns where N > 4,096 (`qkv`), else 32 (`o`); 512-deep K steps up to 16
      rows (9.9-11.2 us against 10.7-12.6 with 256), 256 with 5 stages at 64 rows."""
    if k >= 2 * n:
        return (64, 256, 4, 4, 4)
    if n >= 16384:
        return (128, 128 if m > 16 else 256, 1, 4, 4)
    block_n = 64 if n > 4096 else 32
    return (block_n, 256, 1, 5, 4) if m > 16 else (block_n, 512, 1, 4, 4)


def fp8_gemm_triton(qx: torch.Tensor, sx: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor,
                    out_dtype: torch.dtype, block_n: int = 32, block_k: int = 256,
                    split_k: int = 1, num_stages: int = 4, num_warps: int = 4) -> torch.Tensor:
    """`fp8_matmul_reference`'s contract for up to `SMALL_M` rows (`kernels.decode_gemm`: one
    program per `block_n` output columns and `split_k`-th of K, all rows in one tile; split
    products are summed in fp32, atomically, then cast)."""
    return decode_gemm(qx, qw, out_dtype, (block_n, block_k, split_k, num_stages, num_warps),
                       sx, sw)
