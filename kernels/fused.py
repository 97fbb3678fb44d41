"""Fused elementwise stages of the decoder layer: RMSNorm (alone, after the residual add, and
per head of q and k), RoPE on q and k with the step's K/V written to the paged cache, SiLU-and-mul.

Each is one Triton kernel on CUDA in place of the several torch kernels of its reference; in
a decode step these tensors are small, so the separate launches, not the bytes, were the cost
(measured in `kernel_tune.py`). The torch references are the CPU path and keep HF's rounding
points; the kernels compute in fp32 and round once, so bf16 results may differ by one ulp.

Before an FP8 projection, the residual add's RMSNorm and SiLU-and-mul also quantize the rows
they write (`add_rms_norm_fp8`, `silu_mul_fp8`: `kernels.fp8.quantize_rows`' bytes and scales),
so the product launches no quantization of its own.

RoPE, the residual add's RMSNorm and SiLU-and-mul take an optional fp32 `delta`: the adapters'
output of the LoRA projection that made their input, deferred to them in small decode graphs
(`lora.layers.LoraLinear.deferred`), added as they read the input (`with_delta`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.fp8 import FP8, Fp8Rows, quantize_row_into, quantize_rows_torch
from kernels.fp8_kv import fp8_e4m3_bytes, is_fp8, kernel_operands, quantize_kv


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, N] -> weight * (x / rms(x)), normalised in fp32 (as HF's LlamaRMSNorm)."""
    fn = rms_norm_triton if x.is_cuda else rms_norm_torch
    return fn(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    delta: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next RMSNorm: returns (rms_norm(x + residual), x + residual),
    the sum rounded to x's dtype first (as HF's `hidden = residual + out`). The Triton path
    writes both in place of its inputs (normed into x, the sum into residual).

    `delta`: fp32, x's shape, added to x first and rounded to x's dtype (`with_delta`): the
    deferred LoRA output of the projection that made x (`lora.layers.LoraLinear.deferred`)."""
    fn = add_rms_norm_triton if x.is_cuda else add_rms_norm_torch
    return fn(x, residual, weight, eps, delta)


def add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    delta: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Fp8Rows]:
    """`add_rms_norm`, and its normed rows quantized as `kernels.fp8.quantize_rows` does (the
    input of an FP8 projection), in the same kernel on CUDA."""
    if x.is_cuda:
        return add_rms_norm_fp8_triton(x, residual, weight, eps, delta)
    normed, summed = add_rms_norm_torch(x, residual, weight, eps, delta)
    return normed, summed, Fp8Rows(*quantize_rows_torch(normed))


def with_delta(x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
    """x + delta rounded once to x's dtype, as an in-place LoRA expand leaves a projection's
    output (`kernels.seg_lora`: y + scale * t @ B in fp32); x itself without a delta."""
    return x if delta is None else (x.float() + delta.view(x.shape)).to(x.dtype)


def qk_norm(
    q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's RMSNorm of each head: q [T, H, D] with wq [D], k [T, KVH, D] with wk [D].
    The Triton path normalises both in place (one launch; q and k may be strided views of the
    qkv projection's output, each head's D values contiguous)."""
    fn = qk_norm_triton if q.is_cuda else qk_norm_torch
    return fn(q, k, wq, wk, eps)


def rope_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotary embedding of q [T, H, D] and k [T, KVH, D] (cos, sin: [T, 1, D // 2], HF's
    half-rotation layout); the rotated k and v [T, KVH, D] go to rows `slots` [T] of the
    paged caches [S, KVH, D]. Returns the rotated q (the Triton path rotates it in place).

    An FP8 cache (torch.float8_e4m3fn) stores each value of KV head h divided by its scale,
    `kv_scales` [2, KVH] fp32 (row 0 K's, row 1 V's; `kernels.fp8_kv`); other caches ignore
    `kv_scales`. `delta`: [T, (H + 2 KVH) * D] fp32, columns as the qkv projection's [q|k|v],
    added to q, k and v first (`with_delta`)."""
    fn = rope_cache_triton if q.is_cuda else rope_cache_torch
    return fn(q, k, v, cos, sin, k_cache, v_cache, slots, kv_scales, delta)


def silu_mul(gate_up: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up: [T, 2 * I] (columns [gate | up]) -> silu(gate) * up, [T, I]. `delta`: fp32,
    gate_up's shape, added to it first (`with_delta`)."""
    fn = silu_mul_triton if gate_up.is_cuda else silu_mul_torch
    return fn(gate_up, delta)


def silu_mul_fp8(gate_up: torch.Tensor, delta: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, Fp8Rows]:
    """`silu_mul`, and its rows quantized as `kernels.fp8.quantize_rows` does, in the same
    kernel on CUDA."""
    if gate_up.is_cuda:
        return silu_mul_fp8_triton(gate_up, delta)
    out = silu_mul_torch(gate_up, delta)
    return out, Fp8Rows(*quantize_rows_torch(out))


# --- torch references / CPU path -----------------------------------------------------------


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Semantics: weight * (x.float() * rsqrt(mean(x.float() ** 2, -1) + eps)).to(x.dtype)"""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    delta: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: r = with_delta(x, delta) + residual; (rms_norm_torch(r, weight, eps), r)"""
    r = with_delta(x, delta) + residual
    return rms_norm_torch(r, weight, eps), r


def qk_norm_torch(
    q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: for x, w in ((q, wq), (k, wk)): each head x[t, h] <- rms_norm_torch(x[t, h], w)"""
    qn = rms_norm_torch(q.reshape(-1, q.shape[-1]), wq, eps).view(q.shape)
    kn = rms_norm_torch(k.reshape(-1, k.shape[-1]), wk, eps).view(k.shape)
    return qn, kn


def rope_cache_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
) -> torch.Tensor:
    """Semantics: q, k, v = with_delta(., delta's columns of each); for x in (q, k): x1, x2 =
    halves of x's last axis;
    x <- cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin); then k_cache[slots] = k,
    v_cache[slots] = v; returns q. An FP8 cache gets, in fp32,
    k_cache[slots] = quantize_kv(k, kv_scales[0]), v_cache[slots] = quantize_kv(v, kv_scales[1])."""

    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    if delta is not None:
        dq, dk, dv = delta.split([q[0].numel(), k[0].numel(), v[0].numel()], dim=-1)
        q, k, v = with_delta(q, dq), with_delta(k, dk), with_delta(v, dv)
    if is_fp8(k_cache):
        assert kv_scales is not None, "an FP8 KV cache needs kv_scales"
        k32 = rotate(k.float(), cos.float(), sin.float())
        # As bytes: torch's CPU index_copy_ takes no float8.
        k_cache.view(torch.uint8).index_copy_(
            0, slots, quantize_kv(k32, kv_scales[0]).view(torch.uint8))
        v_cache.view(torch.uint8).index_copy_(
            0, slots, quantize_kv(v, kv_scales[1]).view(torch.uint8))
    else:
        k_cache.index_copy_(0, slots, rotate(k, cos, sin))
        v_cache.index_copy_(0, slots, v)
    return rotate(q, cos, sin)


def silu_mul_torch(gate_up: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
    """Semantics: gate, up = with_delta(gate_up, delta).chunk(2, -1); silu(gate) * up"""
    gate, up = with_delta(gate_up, delta).chunk(2, dim=-1)
    return F.silu(gate) * up


# --- Triton ---------------------------------------------------------------------------------


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as `rms_norm_torch`; one program per row."""
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    n = x.shape[-1]
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(x.shape[0],)](
        x, weight, out, x.stride(0), out.stride(0), n, eps,
        BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )
    return out


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    delta: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `add_rms_norm_torch`, in place: x gets the normed rows, residual the
    sums (both [T, N], rows contiguous)."""
    _add_rms_norm(x, residual, weight, eps, None, delta)
    return x, residual


def add_rms_norm_fp8_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    delta: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Fp8Rows]:
    """Same contract as `add_rms_norm_fp8`, x and residual written as `add_rms_norm_triton`
    writes them."""
    q, scale = _fp8_rows_out(x)
    _add_rms_norm(x, residual, weight, eps, (q, scale), delta)
    return x, residual, Fp8Rows(q.view(FP8), scale)


def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                  rows: tuple[torch.Tensor, torch.Tensor] | None,
                  delta: torch.Tensor | None) -> None:
    t, n = x.shape
    block = triton.next_power_of_2(n)
    q, scale = rows if rows is not None else (x, x)  # unused without QUANT
    d = _delta_operand(delta, x)
    _add_rms_norm_kernel[(t,)](
        x, residual, weight, q, scale, d, x.stride(0), residual.stride(0), d.stride(0), n, eps,
        BLOCK=block, QUANT=rows is not None, DELTA=delta is not None,
        num_warps=min(16, max(1, block // 256)),
    )


def _delta_operand(delta: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """A kernel's delta operand: the fp32 rows of `delta` (contiguous within a row), or
    `like` in its place when there is none (never read: DELTA is off)."""
    if delta is None:
        return like
    assert delta.dtype == torch.float32 and delta.stride(-1) == 1, "fp32 rows, contiguous"
    return delta


def _fp8_rows_out(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bytes (uint8: the interpreter takes no FP8 tensors) and scales of x's rows."""
    return (torch.empty(x.shape, dtype=torch.uint8, device=x.device),
            torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device))


def qk_norm_triton(
    q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `qk_norm_torch`, in place; one program per (token, head of q or k)."""
    heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[2]
    assert q.stride(2) == 1 and k.stride(2) == 1, "each head's values must be contiguous"
    block = triton.next_power_of_2(d)
    _qk_norm_kernel[(q.shape[0], heads + kv_heads)](
        q, k, wq, wk, q.stride(0), q.stride(1), k.stride(0), k.stride(1), heads, d, eps,
        BLOCK=block, num_warps=max(1, block // 256),
    )
    return q, k


def rope_cache_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `rope_cache_torch`, rotating q in place (q, k, v may be strided views
    of the qkv projection's output; each cache row [KVH, D] contiguous)."""
    half = q.shape[2] // 2
    k_cache, v_cache, kv_scales, s_scale, fp8 = kernel_operands(k_cache, v_cache, kv_scales)
    d = _delta_operand(delta, q)
    _rope_cache_kernel[(q.shape[0],)](
        q, k, v, cos, sin, k_cache, v_cache, slots, kv_scales, d, s_scale, q.stride(0),
        q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        sin.stride(0), k_cache.stride(0), d.stride(0), half, H=q.shape[1], KVH=k.shape[1],
        H_PAD=triton.next_power_of_2(q.shape[1]), KVH_PAD=triton.next_power_of_2(k.shape[1]),
        HALF_PAD=triton.next_power_of_2(half), FP8=fp8, DELTA=delta is not None, num_warps=4,
    )
    return q


def silu_mul_triton(gate_up: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `silu_mul_torch`."""
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(tokens, inter)
    d = _delta_operand(delta, gate_up)
    block = 1024
    _silu_mul_kernel[(tokens, triton.cdiv(inter, block))](
        gate_up, out, out, out, d, gate_up.stride(0), out.stride(0), d.stride(0), inter,
        BLOCK=block, QUANT=False, DELTA=delta is not None, num_warps=4,
    )
    return out


def silu_mul_fp8_triton(gate_up: torch.Tensor, delta: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, Fp8Rows]:
    """Same contract as `silu_mul_fp8`: one program per row (the row's scale needs all of
    it), the row in registers."""
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(tokens, inter)
    q, scale = _fp8_rows_out(out)
    d = _delta_operand(delta, gate_up)
    block = triton.next_power_of_2(inter)
    _silu_mul_kernel[(tokens, 1)](
        gate_up, out, q, scale, d, gate_up.stride(0), out.stride(0), d.stride(0), inter,
        BLOCK=block, QUANT=True, DELTA=delta is not None,
        num_warps=min(16, max(4, block // 1024)))
    return out, Fp8Rows(q.view(FP8), scale)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, s_x, s_out, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * s_x + cols, mask=ok, other=0.0)
    out = _rms_normed(x, w_ptr, cols, ok, N, eps)
    tl.store(out_ptr + row * s_out + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rms_normed(x, w_ptr, cols, ok, N, eps):
    """weight * (x / rms(x)) in fp32, x rounded to its dtype before the weight (as HF)."""
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / N + eps)
    h = (h * rstd).to(x.dtype).to(tl.float32)
    return tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32) * h


@triton.jit
def _qk_norm_kernel(q_ptr, k_ptr, wq_ptr, wk_ptr, s_qt, s_qh, s_kt, s_kh, H, N, eps,
                    BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    if h < H:  # a head of q
        ptr = q_ptr + t * s_qt + h * s_qh
        w_ptr = wq_ptr
    else:
        ptr = k_ptr + t * s_kt + (h - H) * s_kh
        w_ptr = wk_ptr
    x = tl.load(ptr + cols, mask=ok, other=0.0)
    out = _rms_normed(x, w_ptr, cols, ok, N, eps)
    tl.store(ptr + cols, out.to(ptr.dtype.element_ty), mask=ok)


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, q_ptr, scale_ptr, d_ptr, s_x, s_r, s_d, N, eps,
                         BLOCK: tl.constexpr, QUANT: tl.constexpr, DELTA: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = _plus_delta(tl.load(x_ptr + row * s_x + cols, mask=ok, other=0.0),
                    d_ptr + row * s_d + cols, ok, DELTA)
    r = tl.load(r_ptr + row * s_r + cols, mask=ok, other=0.0)
    total = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the residual stream's rounding
    tl.store(r_ptr + row * s_r + cols, total, mask=ok)
    out = _rms_normed(total, w_ptr, cols, ok, N, eps).to(x_ptr.dtype.element_ty)
    tl.store(x_ptr + row * s_x + cols, out, mask=ok)
    if QUANT:  # the normed row as stored, quantized (quantize_rows' rows are contiguous: N)
        quantize_row_into(out.to(tl.float32), ok, q_ptr + row * N, scale_ptr + row, cols)


@triton.jit
def _plus_delta(x, d_ptrs, mask, DELTA: tl.constexpr):
    """`with_delta` of a loaded tile: x + the fp32 delta at d_ptrs, rounded to x's dtype."""
    if DELTA:
        x = (x.to(tl.float32) + tl.load(d_ptrs, mask=mask, other=0.0)).to(x.dtype)
    return x


@triton.jit
def _rope_rotate(src, dst, cos, sin, s_h, s_dst_h, n_heads, HALF, scale_ptr, d_src,
                 N_PAD: tl.constexpr, HALF_PAD: tl.constexpr, FP8: tl.constexpr,
                 DELTA: tl.constexpr):
    # d_src: the heads' fp32 deltas, head after head (2 * HALF each), when DELTA.
    heads = tl.arange(0, N_PAD)
    d = tl.arange(0, HALF_PAD)
    mask = (heads < n_heads)[:, None] & (d < HALF)[None, :]
    p1 = src + heads[:, None] * s_h + d[None, :]
    dp = d_src + heads[:, None] * (2 * HALF) + d[None, :]
    x1 = _plus_delta(tl.load(p1, mask=mask, other=0.0), dp, mask, DELTA)
    x2 = _plus_delta(tl.load(p1 + HALF, mask=mask, other=0.0), dp + HALF, mask, DELTA)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    out = dst + heads[:, None] * s_dst_h + d[None, :]
    if FP8:  # dst holds E4M3 bytes: each head's values over its scale
        scale = tl.load(scale_ptr + heads, mask=heads < n_heads, other=1.0)[:, None]
        tl.store(out, fp8_e4m3_bytes(tl.math.div_rn(a * cos - b * sin, scale)), mask=mask)
        tl.store(out + HALF, fp8_e4m3_bytes(tl.math.div_rn(b * cos + a * sin, scale)),
                 mask=mask)
    else:
        tl.store(out, (a * cos - b * sin).to(dst.dtype.element_ty), mask=mask)
        tl.store(out + HALF, (b * cos + a * sin).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rope_cache_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slots_ptr, kvs_ptr, d_ptr, s_kvs,
    s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, s_cos, s_sin, s_cache, s_d, HALF,
    H: tl.constexpr, KVH: tl.constexpr, H_PAD: tl.constexpr, KVH_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr, FP8: tl.constexpr, DELTA: tl.constexpr,
):
    # One program: every q, k and v head of one token. FP8: the caches are E4M3 bytes, the
    # [KVH] scales of K at kvs_ptr, V's s_kvs further. DELTA: the token's fp32 [q|k|v] deltas
    # at d_ptr, added first.
    t = tl.program_id(0).to(tl.int64)
    dq = d_ptr + t * s_d
    dk = dq + H * 2 * HALF
    d = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_ptr + t * s_cos + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + t * s_sin + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    q = q_ptr + t * s_q_t
    _rope_rotate(q, q, cos, sin, s_q_h, s_q_h, H, HALF, None, dq, H_PAD, HALF_PAD, False,
                 DELTA)
    row = tl.load(slots_ptr + t).to(tl.int64) * s_cache  # this token's cache row
    _rope_rotate(k_ptr + t * s_k_t, kc_ptr + row, cos, sin, s_k_h, 2 * HALF, KVH, HALF, kvs_ptr,
                 dk, KVH_PAD, HALF_PAD, FP8, DELTA)
    heads = tl.arange(0, KVH_PAD)[:, None]
    d2 = tl.arange(0, 2 * HALF_PAD)[None, :]
    mask = (heads < KVH) & (d2 < 2 * HALF)
    v = _plus_delta(tl.load(v_ptr + t * s_v_t + heads * s_v_h + d2, mask=mask, other=0.0),
                    dk + KVH * 2 * HALF + heads * (2 * HALF) + d2, mask, DELTA)
    if FP8:
        scale = tl.load(kvs_ptr + s_kvs + heads, mask=heads < KVH, other=1.0)
        v = fp8_e4m3_bytes(tl.math.div_rn(v.to(tl.float32), scale))
    tl.store(vc_ptr + row + heads * (2 * HALF) + d2, v.to(vc_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(in_ptr, out_ptr, q_ptr, scale_ptr, d_ptr, s_in, s_out, s_d, INTER,
                     BLOCK: tl.constexpr, QUANT: tl.constexpr, DELTA: tl.constexpr):
    # QUANT: one program per row, the whole row in one block, its bytes and scale written too.
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < INTER
    d = d_ptr + t * s_d + cols
    gate = _plus_delta(tl.load(in_ptr + t * s_in + cols, mask=ok, other=0.0), d, ok, DELTA)
    up = _plus_delta(tl.load(in_ptr + t * s_in + INTER + cols, mask=ok, other=0.0), d + INTER,
                     ok, DELTA)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # torch rounds silu first
    out = (silu * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + t * s_out + cols, out, mask=ok)
    if QUANT:
        quantize_row_into(out.to(tl.float32), ok, q_ptr + t * INTER, scale_ptr + t, cols)
