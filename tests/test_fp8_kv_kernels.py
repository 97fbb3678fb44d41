"""FP8 (E4M3) KV cache with per-KV-head scales (`kernels.fp8_kv`): the RoPE + cache write and
the paged attention kernels (Triton; the interpreter on CPU) against their torch references,
the CPU decode path, and the FP8 cache's attention against the full-precision cache's.

Shapes are small: 4 query heads over 2 KV heads, head_dim 16, 16-token pages, ragged lengths,
pages scattered through the pool, free slots holding NaN. K and V have different scales per
KV head (0.05 and 0.2), so a kernel that takes the wrong head's scale, or K's for V's, fails.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels import attention_configs as ac  # noqa: E402
from kernels import fused  # noqa: E402
from kernels import paged_attention as pa  # noqa: E402
from kernels.attention import AttentionMetadata, paged_attention  # noqa: E402
from kernels.cpu_attention import DecodePlan  # noqa: E402
from kernels.fp8_kv import (  # noqa: E402
    E4M3_TILE_SCALE,
    FP8_KV,
    e4m3_keys,
    e4m3_values,
    quantize_kv,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
HEADS, KV_HEADS, DIM, PAGE = 4, 2, 16, 16
SCALE = DIM**-0.5
# Row 0: K's scale per KV head, row 1: V's.
KV_SCALES = torch.tensor([[0.05, 0.2], [0.2, 0.05]], dtype=torch.float32)
# Triton vs the torch reference on the same FP8 cache: fp32 differs only in summation order and
# where the scales are applied; bf16 rounds q, p and the output.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1.6e-2)}
# The FP8 cache's attention vs the fp32 cache's, relative error norm, measured on these inputs:
# decode 0.026-0.031 (the Triton kernel the same to 1e-7), prefill 0.035-0.037; 0.023-0.039
# for decode over 40 other seeds. E4M3 keeps 3 mantissa bits: a value's rounding error alone
# is about 2.5% rms.
FP8_VS_FP32 = 0.06


class Pool:
    """fp32 K/V for sequences whose pages are scattered through a pool (free slots NaN), and
    the same K/V in an FP8 cache."""

    def __init__(self, ctx_lens: list[int], seed: int):
        gen = torch.Generator().manual_seed(seed)
        pages = [-(-n // PAGE) for n in ctx_lens]
        num_pages = sum(pages) + 2
        order = torch.randperm(num_pages, generator=gen).tolist()
        tables, at = [], 0
        for n in pages:
            tables.append(order[at : at + n] + [0] * (max(pages) - n))
            at += n
        self.tables = torch.tensor(tables, dtype=torch.int32, device=DEVICE)
        self.lens = torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)
        shape = (num_pages * PAGE, KV_HEADS, DIM)
        self.k = torch.full(shape, float("nan"))
        self.v = torch.full(shape, float("nan"))
        used = pa.context_slots(self.tables.cpu(), PAGE)
        for row, n in enumerate(ctx_lens):
            slots = used[row, :n]
            self.k[slots] = torch.randn(n, KV_HEADS, DIM, generator=gen)
            self.v[slots] = torch.randn(n, KV_HEADS, DIM, generator=gen)
        self.k, self.v = self.k.to(DEVICE), self.v.to(DEVICE)
        self.scales = KV_SCALES.to(DEVICE)
        self.k8 = quantize_kv(self.k, self.scales[0])
        self.v8 = quantize_kv(self.v, self.scales[1])
        self.gen = gen

    def queries(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(n, HEADS, DIM, generator=self.gen).to(DEVICE, dtype)


def decode(fn, p: Pool, q: torch.Tensor, fp8: bool = True) -> torch.Tensor:
    out = torch.full_like(q, float("nan"))
    if fp8:
        fn(q, p.k8, p.v8, p.tables, p.lens, PAGE, SCALE, out, p.scales)
    else:
        fn(q, p.k, p.v, p.tables, p.lens, PAGE, SCALE, out)
    return out


def prefill(fn, p: Pool, q: torch.Tensor, q_lens: list[int], fp8: bool = True,
            **kw) -> torch.Tensor:
    starts = torch.tensor([0, *q_lens], device=DEVICE).cumsum(0).to(torch.int32)
    out = torch.full_like(q, float("nan"))
    k, v, scales = (p.k8, p.v8, p.scales) if fp8 else (p.k, p.v, None)
    fn(q, k, v, p.tables, starts, p.lens, max(q_lens), PAGE, SCALE, out, scales, **kw)
    return out


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


def assert_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert not got.isnan().any(), "unwritten output"
    atol, rtol = TOLERANCE[got.dtype]
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=rtol)


# -- RoPE + the FP8 cache write ------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_cache_fp8_torch_and_triton_store_the_same_bytes(dtype):
    tokens = 9
    gen = torch.Generator().manual_seed(3)
    # q, k, v as strided views of one qkv row, as the model passes them; k and v large enough
    # that some values clamp at +-448 (K head 0: |k| / 0.05 > 448 from |k| > 22.4).
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM, generator=gen) * 12
    qkv = qkv.to(DEVICE, dtype)
    q = qkv[:, : HEADS * DIM].view(tokens, HEADS, DIM)
    k = qkv[:, HEADS * DIM : (HEADS + KV_HEADS) * DIM].view(tokens, KV_HEADS, DIM)
    v = qkv[:, (HEADS + KV_HEADS) * DIM :].view(tokens, KV_HEADS, DIM)
    angles = torch.rand(tokens, 1, DIM // 2, generator=gen) * 6.3
    cos, sin = angles.cos().to(DEVICE, dtype), angles.sin().to(DEVICE, dtype)
    slots = torch.randperm(3 * tokens, generator=gen)[:tokens].to(DEVICE)
    scales = KV_SCALES.to(DEVICE)
    shape = (3 * tokens, KV_HEADS, DIM)

    def caches():  # free slots hold NaN's byte, so a write to the wrong slot shows
        return [torch.full(shape, 0x7F, dtype=torch.uint8, device=DEVICE).view(FP8_KV)
                for _ in range(2)]

    k_ref, v_ref = caches()
    q_ref = fused.rope_cache_torch(q, k, v, cos, sin, k_ref, v_ref, slots, scales)
    k_got, v_got = caches()
    q_got = fused.rope_cache_triton(q.clone(), k, v, cos, sin, k_got, v_got, slots, scales)
    assert torch.equal(k_got.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_got.view(torch.uint8), v_ref.view(torch.uint8))
    # q as in test_gpu_fused: against the reference on fp32 copies (the kernel rounds once).
    # The FP8 bytes come out the same from fp32 copies: that path computes in fp32 anyway.
    k32, v32 = caches()
    q_ref = fused.rope_cache_torch(q.float(), k.float(), v.float(), cos.float(), sin.float(),
                                   k32, v32, slots, scales)
    assert_close(q_got, q_ref)
    assert torch.equal(k32.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v32.view(torch.uint8), v_ref.view(torch.uint8))

    # The torch path is the stated semantics: rotated k and v over their head's scale, in fp32.
    x1, x2 = k.float().chunk(2, dim=-1)
    c, s = cos.float(), sin.float()
    k_rot = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    want_k = (k_rot / scales[0, :, None]).clamp(-448, 448).to(FP8_KV)
    want_v = (v.float() / scales[1, :, None]).clamp(-448, 448).to(FP8_KV)
    assert torch.equal(k_ref[slots].view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_ref[slots].view(torch.uint8), want_v.view(torch.uint8))
    assert (k_ref[slots].float().abs() == 448).any()  # the clamp was exercised
    others = torch.ones(shape[0], dtype=torch.bool, device=DEVICE)
    others[slots] = False
    assert (k_got.view(torch.uint8)[others] == 0x7F).all()
    assert (v_got.view(torch.uint8)[others] == 0x7F).all()

    # A cache of the model's dtype ignores kv_scales.
    plain = [torch.zeros(shape, dtype=dtype, device=DEVICE) for _ in range(4)]
    fused.rope_cache_torch(q, k, v, cos, sin, plain[0], plain[1], slots)
    fused.rope_cache_torch(q, k, v, cos, sin, plain[2], plain[3], slots, scales)
    assert torch.equal(plain[0], plain[2]) and torch.equal(plain[1], plain[3])


# -- paged attention over an FP8 cache -------------------------------------------------------


@triton.jit
def _convert(x_ptr, keys_ptr, values_ptr, N: tl.constexpr, INTERPRETED: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    tl.store(keys_ptr + i, e4m3_keys(x, INTERPRETED).to(tl.float32))
    tl.store(values_ptr + i, e4m3_values(x, INTERPRETED).to(tl.float32))


def test_e4m3_tile_conversions_are_exact():
    """Every finite E4M3 byte: K's conversion gives its value, V's its value times 2^-8 (the
    attention kernels fold the 2^8 into V's scale). On the GPU these are `cvt` and the PTX
    bit moves; on the interpreter the reference path."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F] + [0, 0], dtype=torch.uint8)
    x = codes.to(DEVICE)
    keys = torch.empty(256, dtype=torch.float32, device=DEVICE)
    values = torch.empty_like(keys)
    _convert[(1,)](x, keys, values, N=256, INTERPRETED=INTERPRET)
    want = codes.view(FP8_KV).float()
    assert torch.equal(keys.cpu(), want)
    assert torch.equal(values.cpu() * E4M3_TILE_SCALE.value, want)
    assert want.abs().max() == 448 and (want == 2.0**-9).any()  # the largest, a subnormal


# A configuration with the registers capped, as `benchmarks/attention_graphs.py --sweep` tries.
@pytest.mark.parametrize("config", [None, (64, 8, 1, 2, 64)], ids=["default", "maxnreg"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_fp8_triton_matches_torch(dtype, config):
    # One token, a page boundary, past one 64-key block, several pages and splits.
    p = Pool([1, 16, 17, 70, 150], seed=11)
    q = p.queries(5, dtype)
    got = decode(functools.partial(pa.paged_decode_triton, config=config), p, q)
    ref = decode(pa.paged_decode_torch, p, q.float())
    assert_close(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["prefill", "extend_split"])
def test_prefill_fp8_triton_matches_torch(dtype, case):
    if case == "prefill":
        # (context, new): no cache; cache ending mid-page; one new token; a chunk over pages.
        ctx_lens, q_lens, config = [9, 23, 40, 70], [9, 6, 1, 40], ac.PREFILL_CONFIG
    else:
        # Short chunks on long contexts: the context is split over programs and merged.
        ctx_lens, q_lens, config = [150, 37], [3, 1], None
        assert pa.num_splits(2 * KV_HEADS, ac.VERIFY_CONFIG[4], torch.device(DEVICE)) > 1
    p = Pool(ctx_lens, seed=len(ctx_lens))
    q = p.queries(sum(q_lens), dtype)
    got = prefill(pa.paged_prefill_triton, p, q, q_lens, config=config)
    ref = prefill(pa.paged_prefill_torch, p, q.float(), q_lens)
    assert_close(got, ref)


def test_fp8_cache_attention_stays_close_to_fp32_cache():
    for seed in range(3):
        p = Pool([1, 16, 33, 90, 200], seed=100 + seed)
        q = p.queries(5, torch.float32)
        full = decode(pa.paged_decode_torch, p, q, fp8=False)
        err = relative_error(decode(pa.paged_decode_torch, p, q), full)
        assert 0 < err < FP8_VS_FP32, err
        if seed == 0:  # the kernel too (the interpreter is slow)
            err = relative_error(decode(pa.paged_decode_triton, p, q), full)
            assert 0 < err < FP8_VS_FP32, err

        q_lens = [1, 5, 30, 12, 60]
        q = p.queries(sum(q_lens), torch.float32)
        full = prefill(pa.paged_prefill_torch, p, q, q_lens, fp8=False)
        err = relative_error(prefill(pa.paged_prefill_torch, p, q, q_lens), full)
        assert 0 < err < FP8_VS_FP32, err


# -- the CPU path --------------------------------------------------------------------------


def test_cpu_decode_plan_fp8_matches_reference():
    p = Pool([1, 16, 17, 70, 150, 300, 5], seed=5)
    k8, v8, tables, lens = p.k8.cpu(), p.v8.cpu(), p.tables.cpu(), p.lens.cpu()
    q = torch.randn(len(lens), HEADS, DIM, generator=p.gen)
    scales = KV_SCALES
    plan = DecodePlan(tables, lens, PAGE, KV_HEADS, DIM, q.dtype, FP8_KV)
    full = torch.full((len(lens) + 2, HEADS, DIM), float("nan"))
    got = full[: len(lens)]  # a strided view of a larger output, as the model passes
    plan.attend(q, k8, v8, SCALE, got, scales)
    ref = torch.empty_like(q)
    pa.paged_decode_torch(q, k8, v8, tables, lens, PAGE, SCALE, ref, scales)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert full[len(lens):].isnan().all()

    # The model's entry point on CPU: decodes through the plan, a prefill chunk after them.
    q_lens = [4, 9]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64), page_size=PAGE, num_decodes=3,
        decode_tables=tables[:3], decode_lens=lens[:3], prefill_tables=tables[3:5],
        prefill_query_start=torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32),
        prefill_lens=lens[3:5], max_prefill_len=max(q_lens),
    )
    qs = torch.randn(3 + sum(q_lens), HEADS, DIM, generator=p.gen)
    got = paged_attention(qs, k8, v8, meta, SCALE, kv_scales=scales)
    want = torch.empty_like(qs)
    pa.paged_decode_torch(qs[:3], k8, v8, tables[:3], lens[:3], PAGE, SCALE, want[:3], scales)
    pa.paged_prefill_torch(qs[3:], k8, v8, tables[3:5], meta.prefill_query_start, lens[3:5],
                           max(q_lens), PAGE, SCALE, want[3:], scales)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
