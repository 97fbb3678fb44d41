"""FP8 (E4M3) KV cache: a layer's K and V slots stored as torch.float8_e4m3fn, one byte a
value (half of bf16's; decode attention is bound by the bytes it reads), with an fp32 scale
per KV head for K and one for V.

`kv_scales` is a float32 tensor `[2, KVH]` on the cache's device: row 0 holds the K scale of
each KV head, row 1 V's. The value x (a rotated k, or v) of KV head h is stored as
`clamp(x / scale[h], -448, 448)` rounded to the nearest E4M3 value (computed in fp32; 448 is
E4M3's largest finite value) and read back as `stored.float() * scale[h]`. Caches of any other
dtype ignore the scales. `kernels.fused.rope_cache` writes such a cache and
`kernels.attention.paged_attention` reads it; this module holds what they share.

The Triton kernels take an FP8 cache as its bytes (a torch.uint8 view) and bitcast in the
kernel: Triton's CPU interpreter (TRITON_INTERPRET=1, the tests) stores float8 tensors wrongly,
and its fp32 -> E4M3 conversion loses the carry when rounding up crosses a power of two (125.0
becomes 64; Triton 3.9). So `fp8_e4m3_bytes` rounds in fp32 arithmetic first, and the
conversion it ends with is exact on any backend.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_KV = torch.float8_e4m3fn
FP8_MAX = 448.0


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_KV


def quantize_kv(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x: [T, KVH, D] (rotated k, or v), scales: [KVH] fp32 -> E4M3 [T, KVH, D].

    Semantics: clamp(x.float() / scales[h], -448, 448) rounded to the nearest E4M3 value."""
    return (x.float() / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV)


def dequantize_kv(
    k: torch.Tensor, v: torch.Tensor, kv_scales: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v: [..., KVH, D] E4M3 cache rows -> (k.float() * kv_scales[0, h],
    v.float() * kv_scales[1, h]) in `dtype`."""
    assert kv_scales is not None, "an FP8 KV cache needs kv_scales"
    return ((k.float() * kv_scales[0, :, None]).to(dtype),
            (v.float() * kv_scales[1, :, None]).to(dtype))


def kernel_operands(
    k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scales: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, bool]:
    """The caches as the Triton kernels take them (an FP8 cache as its bytes), the scales (None
    unless FP8; V's row `kv_scales.stride(0)` elements after K's) and whether the cache is FP8
    (the kernels' `FP8`)."""
    if k_cache.dtype != FP8_KV:
        return k_cache, v_cache, None, 0, False
    assert v_cache.dtype == FP8_KV and kv_scales is not None, "an FP8 cache needs kv_scales"
    assert kv_scales.dtype == torch.float32 and kv_scales.stride(1) == 1
    k_bytes, v_bytes = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    return k_bytes, v_bytes, kv_scales, kv_scales.stride(0), True


@triton.jit
def fp8_e4m3_bytes(x):
    """fp32 x -> the bytes of clamp(x, -448, 448) rounded to the nearest E4M3 value, ties to
    even (as torch's `.to(torch.float8_e4m3fn)`)."""
    x = tl.clamp(x, -448.0, 448.0)
    bits = x.to(tl.uint32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    # c = 2^(e + 20), e the exponent of |x| (at least E4M3's smallest normal one, -6): fp32's
    # ulp at c is E4M3's at |x|, so |x| + c rounds |x| to E4M3's grid, ties to even.
    c = ((tl.maximum(mag >> 23, 121) + 20) << 23).to(tl.float32, bitcast=True)
    r = (mag.to(tl.float32, bitcast=True) + c) - c
    r = (r.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)
    return r.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


# The attention kernels convert K and V tiles differently (H200, FP8 decode attention of
# Llama-3-8B's shapes in CUDA graphs, against converting both as `e4m3_values` does; Nsight
# Compute showed the kernel bound by instruction issue, not by its bytes):
# - K tiles with Triton's `cvt` (`e4m3_keys`), which the compiler applies after the tile's
#   move into the dot's layout: K's rows are the dot's contiguous dimension there, and the
#   conversion runs on another pipe than the integer ops that convert V.
# - V tiles in integer PTX (`e4m3_values`), kept in the layout the bytes load in. p.V reduces
#   over keys, so the dot wants a thread's values from consecutive keys: moved as fp16 that is
#   a transposing `ldmatrix`; moved as bytes (where Triton puts a pure conversion) it was a
#   byte-wide shared-memory load per value.
# Together 11-22% faster: batch 64 x 1k contexts 63.1 -> 54.1 us, 16 x 8k 111.9 -> 97.1,
# batch 1 x 8k 16.4 -> 12.8.
#
# `e4m3_values` gives an E4M3 value times 2^-8 (fp16 holds E4M3's bits moved: it has one more
# exponent bit, with a bias 8 larger); the kernels fold this into their V scale.
E4M3_TILE_SCALE = tl.constexpr(256.0)


@triton.jit
def e4m3_keys(x, INTERPRETED: tl.constexpr):
    """A tile of E4M3 bytes (uint8) as fp16 values, exactly (fp32 in the interpreter)."""
    x = x.to(tl.float8e4nv, bitcast=True)
    return x.to(tl.float32) if INTERPRETED else x.to(tl.float16)


@triton.jit
def e4m3_values(x, INTERPRETED: tl.constexpr):
    """A tile of E4M3 bytes (uint8) as fp16 values times 2^-8, exactly (a NaN byte reads
    480 * 2^-8; a cache never holds one). On the GPU four bytes at a time in PTX: two `prmt`
    put each byte in the top of a half, then sign | (exponent, mantissa) >> 1. Not marked pure,
    so the compiler keeps it where the tile is loaded (see above). The interpreter runs no PTX:
    there the value, scaled, in fp32."""
    if INTERPRETED:
        return x.to(tl.float8e4nv, bitcast=True).to(tl.float32) * (1.0 / E4M3_TILE_SCALE)
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 lo, hi, t;
        prmt.b32 lo, $2, 0, 0x1404;
        prmt.b32 hi, $2, 0, 0x3424;
        shr.b32 t, lo, 1;
        and.b32 t, t, 0x3F803F80;
        and.b32 lo, lo, 0x80008000;
        or.b32 $0, lo, t;
        shr.b32 t, hi, 1;
        and.b32 t, t, 0x3F803F80;
        and.b32 hi, hi, 0x80008000;
        or.b32 $1, hi, t;
        }""",
        constraints="=r,=r,r", args=[x], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def fp8_dot_operand(q):
    """q's tile as the attention kernels multiply it with an FP8 cache's K and V tiles (which
    they convert to q's new dtype): fp16, which holds every E4M3 value exactly, bf16 q exactly
    from 2^-14 to 65504 (q is clamped to +-65504), and is cheaper to convert E4M3 into than bf16
    (H200 decode: 11% faster). fp32 q stays fp32."""
    if q.dtype != tl.float32:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q
