"""Fused RMSNorm (alone, after the residual add, and per head of q and k), RoPE with the K/V
cache write, and SiLU-and-mul: Triton vs the torch references (tiny shapes in the interpreter
on CPU; Llama-3-8B shapes in bf16 on a GPU)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

from kernels import fused  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
# vs the reference on fp32 copies of the inputs: the kernels round once (bf16: half an ulp),
# and twice in RMSNorm and SiLU-mul where HF rounds an intermediate.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1.6e-2)}


def assert_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert not got.isnan().any(), "unwritten output"
    atol, rtol = TOLERANCE[got.dtype]
    torch.testing.assert_close(got.float(), ref, atol=atol, rtol=rtol)


def poison(shape, dtype) -> None:
    """Leave NaN in the caching allocator's next block of this size: a kernel that skips an
    element of its freshly allocated output then fails the comparison."""
    del_me = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    del del_me


def check(tokens, hidden, heads, kv_heads, head_dim, inter, dtype):
    gen = torch.Generator().manual_seed(tokens + hidden)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    x, w = randn(tokens, hidden), randn(hidden)
    poison((tokens, hidden), dtype)
    ref = fused.rms_norm_torch(x.float(), w.float(), 1e-5)
    assert_close(fused.rms_norm_triton(x, w, 1e-5), ref)

    r = randn(tokens, hidden)
    normed_ref, sum_ref = fused.add_rms_norm_torch(x.float(), r.float(), w.float(), 1e-5)
    normed, total = fused.add_rms_norm_triton(x.clone(), r.clone(), w, 1e-5)
    assert_close(total, sum_ref)
    assert_close(normed, fused.rms_norm_torch(total.float(), w.float(), 1e-5))
    assert_close(normed, normed_ref)

    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim)  # q, k, v: strided views
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    wq, wk = randn(head_dim), randn(head_dim)
    q_ref, k_ref = fused.qk_norm_torch(q.float(), k.float(), wq.float(), wk.float(), 1e-6)
    qkv_normed = qkv.clone()  # q and k normed in place, v untouched
    q_n = qkv_normed[:, : heads * head_dim].view(tokens, heads, head_dim)
    k_n = qkv_normed[:, heads * head_dim : (heads + kv_heads) * head_dim]
    fused.qk_norm_triton(q_n, k_n.view(tokens, kv_heads, head_dim), wq, wk, 1e-6)
    assert_close(q_n, q_ref)
    assert_close(k_n.view(tokens, kv_heads, head_dim), k_ref)
    assert torch.equal(qkv_normed[:, (heads + kv_heads) * head_dim :], v.reshape(tokens, -1))

    angles = torch.rand(tokens, 1, head_dim // 2, generator=gen) * 6.3
    cos, sin = angles.cos().to(DEVICE, dtype), angles.sin().to(DEVICE, dtype)
    slots = torch.randperm(2 * tokens + 3, generator=gen)[:tokens].to(DEVICE)
    shape = (2 * tokens + 3, kv_heads, head_dim)
    k_ref, v_ref = torch.zeros(shape, device=DEVICE), torch.zeros(shape, device=DEVICE)
    q_ref = fused.rope_cache_torch(q.float(), k.float(), v.float(), cos.float(), sin.float(),
                                   k_ref, v_ref, slots)
    k_cache, v_cache = (torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
                        for _ in range(2))
    kv_before = qkv[:, heads * head_dim :].clone()
    q_got = fused.rope_cache_triton(q, k, v, cos, sin, k_cache, v_cache, slots)
    assert_close(q_got, q_ref)
    assert_close(k_cache[slots], k_ref[slots])
    assert torch.equal(v_cache[slots], v)
    assert torch.equal(qkv[:, heads * head_dim :], kv_before)  # k and v are read, not rotated
    others = torch.ones(shape[0], dtype=torch.bool, device=DEVICE)
    others[slots] = False
    assert k_cache[others].isnan().all() and v_cache[others].isnan().all()

    gate_up = randn(tokens, 2 * inter) * 3
    poison((tokens, inter), dtype)
    assert_close(fused.silu_mul_triton(gate_up), fused.silu_mul_torch(gate_up.float()))


def check_delta(tokens, hidden, heads, kv_heads, head_dim, inter, dtype):
    """Given a projection's deferred LoRA output (an fp32 delta, `lora.layers.LoraLinear.
    deferred`), each consumer kernel reads its input plus the delta rounded once: exactly
    the outputs of the same kernel given that sum (`fused.with_delta`), and close to the
    torch references' with the delta."""
    gen = torch.Generator().manual_seed(7 * tokens + hidden)

    def randn(*shape, dtype=dtype):
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    def rounded(x, delta):
        """`fused.with_delta` as the kernels round: the interpreter rounds fp32 to bf16 by
        dropping the low 16 bits, not to nearest."""
        if not (INTERPRET and x.dtype == torch.bfloat16):
            return fused.with_delta(x, delta)
        bits = (x.float() + delta).view(torch.int32) & ~0xFFFF
        return bits.view(torch.float32).to(torch.bfloat16)

    # the references round to nearest: compared where the kernels do too
    to_nearest = not INTERPRET or dtype == torch.float32
    x, r, w = randn(tokens, hidden), randn(tokens, hidden), randn(hidden)
    d = randn(tokens, hidden, dtype=torch.float32)
    normed, total = fused.add_rms_norm_triton(x.clone(), r.clone(), w, 1e-5, d)
    want = fused.add_rms_norm_triton(rounded(x, d), r.clone(), w, 1e-5)
    assert torch.equal(normed, want[0]) and torch.equal(total, want[1])
    if to_nearest:
        ref = fused.add_rms_norm_torch(x, r, w, 1e-5, d)  # in x's dtype: the kernel's roundings
        assert_close(total, ref[1].float())
        assert_close(normed, ref[0].float())
    normed8, total8, rows = fused.add_rms_norm_fp8_triton(x.clone(), r.clone(), w, 1e-5, d)
    want8 = fused.add_rms_norm_fp8_triton(rounded(x, d), r.clone(), w, 1e-5)
    assert torch.equal(normed8, want8[0]) and torch.equal(total8, want8[1])
    assert torch.equal(rows.q.view(torch.uint8), want8[2].q.view(torch.uint8))

    gate_up = randn(tokens, 2 * inter) * 3
    d = randn(tokens, 2 * inter, dtype=torch.float32)
    out = fused.silu_mul_triton(gate_up, d)
    assert torch.equal(out, fused.silu_mul_triton(rounded(gate_up, d)))
    if to_nearest:
        assert_close(out, fused.silu_mul_torch(gate_up, d).float())
    out8, _ = fused.silu_mul_fp8_triton(gate_up, d)
    assert torch.equal(out8, fused.silu_mul_fp8_triton(rounded(gate_up, d))[0])

    width = (heads + 2 * kv_heads) * head_dim
    qkv, d = randn(tokens, width), randn(tokens, width, dtype=torch.float32)
    angles = torch.rand(tokens, 1, head_dim // 2, generator=gen) * 6.3
    cos, sin = angles.cos().to(DEVICE, dtype), angles.sin().to(DEVICE, dtype)
    slots = torch.randperm(2 * tokens + 3, generator=gen)[:tokens].to(DEVICE)
    shape = (2 * tokens + 3, kv_heads, head_dim)

    def rope(qkv, delta=None, fn=fused.rope_cache_triton):
        """(rotated q, k cache, v cache) of q, k and v as views of `qkv`."""
        q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
        k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim]
        v = qkv[:, (heads + kv_heads) * head_dim :]
        caches = [torch.zeros(shape, dtype=qkv.dtype, device=DEVICE) for _ in range(2)]
        q = fn(q, k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim), cos,
               sin, *caches, slots, None, delta)
        return q, *caches

    got = rope(qkv.clone(), d)
    for a, b in zip(got, rope(rounded(qkv, d)), strict=True):
        assert torch.equal(a, b)
    # the kernel rotates in fp32, as the fp32 reference does
    ref = rope(rounded(qkv, d).float(), None, fused.rope_cache_torch)
    if dtype == torch.float32:
        ref = rope(qkv.clone(), d, fused.rope_cache_torch)
    for a, b in zip(got, ref, strict=True):
        assert_close(a, b.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_tiny(dtype):
    check(tokens=5, hidden=72, heads=4, kv_heads=2, head_dim=16, inter=40, dtype=dtype)
    check_delta(tokens=5, hidden=72, heads=4, kv_heads=2, head_dim=16, inter=40, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_fused_gpu(tokens):
    check(tokens, 4096, 32, 8, 128, 14336, torch.bfloat16)
    check_delta(tokens, 4096, 32, 8, 128, 14336, torch.bfloat16)
