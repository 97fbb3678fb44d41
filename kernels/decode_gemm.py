"""Decode-sized products, `y = x @ W^T` for up to `SMALL_M` rows, as one Triton kernel.

A decode step multiplies a few rows by each weight, so the product is a stream of the weight's
bytes. cuBLAS tiles such products for large ones: for 64 rows of Llama-3-8B's projections on an
H200 its bf16 kernels read the weights at 0.54-0.94 of the copy bandwidth, the narrow `o` and
`qkv` lowest (`benchmarks/results/decode_gemm_h200.json`). This kernel puts all the rows in one
tile and gives each program `BLOCK_N` output columns (and a `SPLIT_K`-th of the depth, summed
with atomics), so every SM streams weight rows from the start.

The same kernel serves bf16 (or fp16) weights (`kernels.linear`) and E4M3 weights with their
scales (`kernels.fp8.fp8_gemm_triton`): an FP8 product bitcasts the bytes for the FP8 tensor
cores and applies the row and column scales after the sum. The CPU interpreter runs it in the
tests; `benchmarks/decode_gemm_tune.py` chose the configurations.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SMALL_M = 64  # rows up to which the decode-sized kernel is taken on CUDA


def bf16_decode_config(m: int, n: int, k: int) -> tuple[int, int, int, int, int] | None:
    """(block_n, block_k, split_k, num_stages, num_warps) for a bf16 product of `m` rows, `n`
    output columns and depth `k`, or None where cuBLAS is as fast. H200, Llama-3-8B, us a
    product in a CUDA graph at 1 / 16 / 64 rows, cuBLAS -> this kernel
    (`benchmarks/results/decode_gemm_h200.json`, 48 configurations each):

    - the LM head (N >= 8 K): 248.8 / 253.5 / 284.5 -> 237.3 / 243.2 / 256.9;
    - `down` (K >= 2 N): 33.3 / 34.0 / 37.3 -> 32.8 / 32.4 / 34.9 (split K lost in bf16);
    - `gate_up` (N >= 4 K): 63.6 -> 62.2 at 64 rows, equal below;
    - `o` (N = K) up to 16 rows: 14.6 / 14.9 -> 12.7 / 12.5; at 64 rows cuBLAS's 13.0 is
      faster than the best tile's 13.3;
    - `qkv`: equal (16.5-17.4 either way)."""
    if n >= 8 * k:
        return (128 if m > 16 else 64, 128, 1, 4, 4)
    if k >= 2 * n:
        return (32, 256, 1, 4 if m > 16 else 5, 4)
    if n >= 4 * k:
        return (128, 128, 1, 4, 4) if m > 16 else None
    if n == k and m <= 16:
        return (32, 256, 1, 5, 4)
    return None


def decode_gemm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype,
                config: tuple[int, ...], a_scale: torch.Tensor | None = None,
                b_scale: torch.Tensor | None = None) -> torch.Tensor:
    """a [M, K] @ b [N, K]^T -> [M, N] in `out_dtype`, M <= `SMALL_M`; `config` is
    (block_n, block_k, split_k, num_stages, num_warps). With scales, a and b hold E4M3 bytes
    (uint8 or float8_e4m3fn) and the result is `a_scale[m] * b_scale[n] * sum_k a b`."""
    block_n, block_k, split_k, num_stages, num_warps = config
    m, k = a.shape
    n = b.shape[0]
    fp8 = a_scale is not None
    if fp8:
        assert b_scale is not None
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    if split_k == 1:
        out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    else:
        out = torch.zeros((m, n), dtype=torch.float32, device=a.device)
    k_chunk = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    _decode_gemm_kernel[(triton.cdiv(n, block_n), split_k)](
        a, a_scale if fp8 else a, b, b_scale if fp8 else b, out, m, n, k, k_chunk,
        a.stride(0), b.stride(0), out.stride(0), BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_N=block_n, BLOCK_K=block_k, FP8=fp8, ATOMIC=split_k > 1, UPCAST=_INTERPRETED,
        num_stages=num_stages, num_warps=num_warps)
    return out if split_k == 1 else out.to(out_dtype)


@triton.jit
def _decode_gemm_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, M, N, K, K_CHUNK, s_a, s_b, s_c,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        FP8: tl.constexpr, ATOMIC: tl.constexpr, UPCAST: tl.constexpr):
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_start = tl.program_id(1) * K_CHUNK
    k_end = tl.minimum(k_start + K_CHUNK, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_ptr + rm[:, None] * s_a + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < k_end), other=0)
        b = tl.load(b_ptr + rn[None, :] * s_b + kk[:, None],
                    mask=(rn[None, :] < N) & (kk[:, None] < k_end), other=0)
        if FP8:
            a = a.to(tl.float8e4nv, bitcast=True)
            b = b.to(tl.float8e4nv, bitcast=True)
        elif UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    if FP8:
        sa = tl.load(sa_ptr + rm, mask=rm < M, other=0.0)
        sb = tl.load(sb_ptr + rn, mask=rn < N, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    c = c_ptr + rm[:, None] * s_c + rn[None, :]
    ok = (rm[:, None] < M) & (rn[None, :] < N)
    if ATOMIC:
        tl.atomic_add(c, acc, mask=ok, sem="relaxed")
    else:
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=ok)


# Triton's CPU interpreter (TRITON_INTERPRET=1, the tests) multiplies bf16 tiles in `tl.dot` as
# their raw bits (`kernels.sgmv`), so there they are upcast first: bf16 products are exact in
# fp32, as on the tensor cores.
_INTERPRETED = type(_decode_gemm_kernel).__name__ == "InterpretedFunction"
