"""Paged attention: Triton decode and prefill kernels vs their torch references, and the
references vs a per-token loop.

Tiny shapes run everywhere (Triton's interpreter on CPU); the `gpu` tests use Llama-3-8B's
attention shapes in bf16. Outputs are poisoned with NaN first, so an unwritten element fails.
"""

from __future__ import annotations

import os
import zlib
from functools import partial

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

from kernels import attention_configs as ac  # noqa: E402
from kernels import paged_attention as pa  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}  # relative error norm, vs fp32 ref


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


class Paged:
    """A random KV pool and sequences whose pages are scattered through it."""

    def __init__(self, ctx_lens, heads, kv_heads, dim, page_size, dtype, device, seed):
        gen = torch.Generator().manual_seed(seed)
        self.page_size = page_size
        pages_per_seq = [-(-n // page_size) for n in ctx_lens]
        num_pages = sum(pages_per_seq) + 3
        order = torch.randperm(num_pages, generator=gen).tolist()
        width = max(pages_per_seq)
        tables, i = [], 0
        for n in pages_per_seq:
            tables.append(order[i : i + n] + [0] * (width - n))
            i += n
        self.tables = torch.tensor(tables, dtype=torch.int32, device=device)
        self.lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
        shape = (num_pages * page_size, kv_heads, dim)
        self.k = torch.randn(shape, generator=gen).to(device, dtype)
        self.v = torch.randn(shape, generator=gen).to(device, dtype)
        self.heads, self.dim, self.gen = heads, dim, gen

    def queries(self, n: int, dtype, device) -> torch.Tensor:
        return torch.randn(n, self.heads, self.dim, generator=self.gen).to(device, dtype)


def run_decode(fn, p: Paged, q: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(q, float("nan"))
    fn(q, p.k, p.v, p.tables, p.lens, p.page_size, p.dim**-0.5, out)
    return out


def run_prefill(fn, p: Paged, q: torch.Tensor, q_lens: list[int]) -> torch.Tensor:
    starts = torch.tensor([0, *q_lens], device=q.device).cumsum(0).to(torch.int32)
    out = torch.full_like(q, float("nan"))
    fn(q, p.k, p.v, p.tables, starts, p.lens, max(q_lens), p.page_size, p.dim**-0.5, out)
    return out


def upcast(p: Paged, q: torch.Tensor) -> tuple[Paged, torch.Tensor]:
    """The reference runs on fp32 copies of the same inputs."""
    ref = Paged.__new__(Paged)
    ref.__dict__.update(p.__dict__, k=p.k.float(), v=p.v.float())
    return ref, q.float()


def check_decode(ctx_lens, heads, kv_heads, dim, page_size, dtype, device):
    seed = zlib.crc32(f"{ctx_lens}{heads}{kv_heads}{dim}{page_size}{dtype}".encode())
    p = Paged(ctx_lens, heads, kv_heads, dim, page_size, dtype, device, seed)
    q = p.queries(len(ctx_lens), dtype, device)
    got = run_decode(pa.paged_decode_triton, p, q)
    ref = run_decode(pa.paged_decode_torch, *upcast(p, q))
    assert not got.isnan().any(), "unwritten output"
    assert relative_error(got, ref) < TOLERANCE[dtype]


def check_prefill(ctx_lens, q_lens, heads, kv_heads, dim, page_size, dtype, device,
                  config=None):
    seed = zlib.crc32(f"{ctx_lens}{q_lens}{heads}{kv_heads}{dim}{page_size}{dtype}".encode())
    p = Paged(ctx_lens, heads, kv_heads, dim, page_size, dtype, device, seed)
    q = p.queries(sum(q_lens), dtype, device)
    got = run_prefill(partial(pa.paged_prefill_triton, config=config), p, q, q_lens)
    ref = run_prefill(pa.paged_prefill_torch, *upcast(p, q), q_lens)
    assert not got.isnan().any(), "unwritten output"
    assert relative_error(got, ref) < TOLERANCE[dtype]


# -- tiny shapes: the interpreter on CPU, compiled on a GPU ----------------------------------

TINY = dict(heads=4, dim=16, page_size=4)
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_decode_tiny(dtype, kv_heads):
    # Lengths: one token, a page boundary, past one 64-key block, several splits.
    check_decode([1, 4, 5, 70, 150], kv_heads=kv_heads, dtype=dtype, device=DEVICE, **TINY)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_prefill_tiny(dtype, kv_heads):
    # (context, new): no cache; cache ending mid-page; one new token; a chunk over two blocks.
    ctx_lens, q_lens = [9, 23, 40, 90], [9, 6, 1, 70]
    check_prefill(ctx_lens, q_lens, kv_heads=kv_heads, dtype=dtype, device=DEVICE, **TINY)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (4, 2), (6, 2)])
@pytest.mark.parametrize("config", [None, ac.PREFILL_CONFIG], ids=["verify", "prefill"])
def test_extend_split_tiny(dtype, heads, kv_heads, config):
    # Short chunks on long contexts: few programs, so the context is split over programs and
    # merged; the last chunk's 3 queries see different numbers of keys in the last split.
    # Such chunks take `VERIFY_CONFIG` (by default) or any other tile.
    for cfg in (ac.VERIFY_CONFIG, ac.PREFILL_CONFIG):
        assert pa.num_splits(2 * kv_heads, cfg[4], torch.device(DEVICE)) > 1
    ctx_lens, q_lens = [150, 37], [3, 1]
    check_prefill(ctx_lens, q_lens, heads, kv_heads, dim=16, page_size=4, dtype=dtype,
                  device=DEVICE, config=config)


def test_references_match_token_loop():
    """The torch references equal attention written as the Semantics loop (float64)."""
    ctx_lens, q_lens, heads, kv_heads, dim, ps = [3, 9, 17], [3, 2, 5], 4, 2, 8, 4
    p = Paged(ctx_lens, heads, kv_heads, dim, ps, torch.float64, "cpu", seed=7)
    slots = pa.context_slots(p.tables, ps)

    def attend(qv, s, n_keys):  # qv: [H, D] -> [H, D]
        out = torch.empty_like(qv)
        for h in range(heads):
            kvh = h // (heads // kv_heads)
            keys = slots[s, :n_keys]
            w = torch.softmax(p.k[keys, kvh] @ qv[h] * dim**-0.5, dim=0)
            out[h] = w @ p.v[keys, kvh]
        return out

    q = p.queries(len(ctx_lens), torch.float64, "cpu")
    got = run_decode(pa.paged_decode_torch, p, q)
    for s, n in enumerate(ctx_lens):
        torch.testing.assert_close(got[s], attend(q[s], s, n))

    q = p.queries(sum(q_lens), torch.float64, "cpu")
    got = run_prefill(pa.paged_prefill_torch, p, q, q_lens)
    row = 0
    for s, (ctx, n) in enumerate(zip(ctx_lens, q_lens, strict=True)):
        for i in range(n):
            torch.testing.assert_close(got[row], attend(q[row], s, ctx - n + i + 1))
            row += 1


# -- Llama-3-8B shapes (32 heads, 8 KV heads, head_dim 128, 16-token pages), bf16 ------------


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_decode_gpu(batch):
    gen = torch.Generator().manual_seed(batch)
    lens = torch.randint(1, 2048, (batch,), generator=gen).tolist()
    lens[0] = 2048
    check_decode(lens, 32, 8, 128, 16, torch.bfloat16, "cuda")


@pytest.mark.gpu
def test_prefill_gpu():
    ctx_lens, q_lens = [512, 1000, 77, 2048, 300], [512, 13, 1, 700, 64]
    check_prefill(ctx_lens, q_lens, 32, 8, 128, 16, torch.bfloat16, "cuda")


@pytest.mark.gpu
def test_extend_split_gpu():
    # A cached session's next turn: 65 new tokens on 4k of history (the context is split).
    check_prefill([4161], [65], 32, 8, 128, 16, torch.bfloat16, "cuda")
    check_prefill([4161, 3000, 100], [65, 1, 17], 32, 8, 128, 16, torch.bfloat16, "cuda")
