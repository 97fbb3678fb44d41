"""SGMV/BGMV: Triton kernels vs the torch references, and the references vs a per-token loop.

On CPU the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set before triton is
imported); with CUDA they run compiled on the GPU unless TRITON_INTERPRET=1. Sizes are tiny:
the interpreter executes every program instance in numpy.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

from kernels import bgmv, sgmv  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
NUM_SLOTS, HIDDEN, OUT, Y_WIDTH, OFFSET = 6, 72, 40, 72, 24
SEQ_LENS = [3, 1, 0, 20, 2, 5]  # one empty sequence; one longer than a 16-row tile
DECODES = 10
TOLERANCE = {  # (atol, rtol): bf16 rounds t and y once per kernel, at different points
    torch.float32: (2e-5, 1e-5),
    torch.bfloat16: (4e-2, 2e-2),
}
DTYPES = [torch.float32, torch.bfloat16]
RANKS = [8, 16, 64]
DISTRIBUTIONS = ["distinct", "uniform", "skewed", "identical", "base_only"]


def slots_for(dist: str, n: int, gen: torch.Generator) -> list[int]:
    """Adapter slot per sequence (-1 = no adapter); `uniform`/`skewed` include base rows."""
    if dist == "distinct":
        return torch.randperm(NUM_SLOTS, generator=gen)[:n].tolist() + [-1] * max(0, n - NUM_SLOTS)
    if dist == "uniform":
        return (torch.randint(-1, NUM_SLOTS, (n,), generator=gen)).tolist()
    if dist == "skewed":  # most requests on one hot adapter
        hot = torch.rand(n, generator=gen) < 0.75
        other = torch.randint(-1, NUM_SLOTS, (n,), generator=gen)
        return torch.where(hot, 2, other).tolist()
    if dist == "identical":
        return [3] * n
    return [-1] * n


def make_weights(rank: int, dtype: torch.dtype, gen: torch.Generator):
    """Stacked A/B with each slot's real rank padded to `rank` with zeros, and per-slot scales."""
    a = torch.randn(NUM_SLOTS, rank, HIDDEN, generator=gen) / HIDDEN**0.5
    b = torch.randn(NUM_SLOTS, OUT, rank, generator=gen) / rank**0.5
    for s in range(NUM_SLOTS):
        real = max(1, rank >> (s % 3))  # mixed ranks: rank, rank/2, rank/4
        a[s, real:] = 0
        b[s, :, real:] = 0
    scales = torch.rand(NUM_SLOTS, generator=gen) * 2 + 0.25
    return a.to(DEVICE, dtype), b.to(DEVICE, dtype), scales.to(DEVICE)


def segments(slots: list[int]) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """SGMV inputs for SEQ_LENS with these slots, plus the per-token slots."""
    indptr = torch.tensor([0, *SEQ_LENS]).cumsum(0)
    token_slots = torch.repeat_interleave(torch.tensor(slots), torch.tensor(SEQ_LENS))
    as_int = dict(dtype=torch.int32, device=DEVICE)
    return (
        indptr.to(**as_int),
        torch.tensor(slots, **as_int),
        max(SEQ_LENS),
        token_slots.to(**as_int),
    )


def loop_shrink(x, a_stack, token_slots):
    t = torch.zeros(x.shape[0], a_stack.shape[1], dtype=torch.float64)
    for i, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            t[i] = a_stack[slot].double().cpu() @ x[i].double().cpu()
    return t


def loop_expand(y, t, b_stack, token_slots, scales, offset):
    y = y.double().cpu().clone()
    n = b_stack.shape[1]
    for i, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            delta = b_stack[slot].double().cpu() @ t[i].double().cpu()
            y[i, offset : offset + n] += scales[slot].item() * delta
    return y


def inputs(kind: str, dtype: torch.dtype, rank: int, dist: str):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{kind}{dtype}{rank}{dist}".encode()))
    a, b, scales = make_weights(rank, dtype, gen)
    if kind == "sgmv":
        indptr, seg_slots, max_len, token_slots = segments(slots_for(dist, len(SEQ_LENS), gen))
        args = (indptr, seg_slots, max_len)
    else:
        token_slots = torch.tensor(slots_for(dist, DECODES, gen), dtype=torch.int32, device=DEVICE)
        args = (token_slots,)
    num_tokens = token_slots.shape[0]
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(DEVICE, dtype)
    y = torch.randn(num_tokens, Y_WIDTH, generator=gen).to(DEVICE, dtype)
    # expand reads a column view, as for one slice of a fused shrink output
    t_fused = torch.randn(num_tokens, 2 * rank, generator=gen).to(DEVICE, dtype)
    return x, y, t_fused[:, rank:], a, b, scales, args, token_slots


def ops(kind: str, backend: str):
    mod = sgmv if kind == "sgmv" else bgmv
    return getattr(mod, f"{kind}_shrink_{backend}"), getattr(mod, f"{kind}_expand_{backend}")


def expand_call(expand, y, t, b, scales, args, kind):
    if kind == "sgmv":
        indptr, seg_slots, max_len = args
        expand(y, t, b, indptr, seg_slots, scales, max_len, OFFSET)
    else:
        expand(y, t, b, args[0], scales, OFFSET)


def assert_close(actual, expected, dtype):
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), atol=atol, rtol=rtol)


@pytest.fixture(scope="module")
def triton_ready():
    if not INTERPRET and not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 and no CUDA device")
    if INTERPRET and type(sgmv._sgmv_kernel).__name__ != "InterpretedFunction":
        pytest.skip("kernels were imported before TRITON_INTERPRET=1 was set")
    try:
        x = torch.ones(2, 16, device=DEVICE)
        bgmv.bgmv_shrink_triton(
            x,
            torch.ones(1, 16, 16, device=DEVICE),
            torch.zeros(2, dtype=torch.int32, device=DEVICE),
        )
    except Exception as e:  # noqa: BLE001 - any failure means this machine cannot run Triton
        pytest.skip(f"Triton cannot run here: {type(e).__name__}: {e}")


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["sgmv", "bgmv"])
def test_triton_matches_torch(triton_ready, kind, dtype, rank, dist):
    x, y, t, a, b, scales, args, _ = inputs(kind, dtype, rank, dist)
    shrink_tri, expand_tri = ops(kind, "triton")
    shrink_ref, expand_ref = ops(kind, "torch")
    assert_close(shrink_tri(x, a, *args), shrink_ref(x, a, *args), dtype)
    y_tri, y_ref = y.clone(), y.clone()
    expand_call(expand_tri, y_tri, t, b, scales, args, kind)
    expand_call(expand_ref, y_ref, t, b, scales, args, kind)
    assert_close(y_tri, y_ref, dtype)
    untouched = torch.ones(Y_WIDTH, dtype=torch.bool)
    untouched[OFFSET : OFFSET + OUT] = False
    assert torch.equal(y_tri[:, untouched], y[:, untouched])


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["sgmv", "bgmv"])
def test_torch_matches_token_loop(kind, dtype, rank, dist):
    x, y, t, a, b, scales, args, token_slots = inputs(kind, dtype, rank, dist)
    shrink, expand = ops(kind, "torch")
    y0 = y.clone()
    assert_close(shrink(x, a, *args), loop_shrink(x, a, token_slots), dtype)
    expected = loop_expand(y, t, b, token_slots, scales, OFFSET)
    expand_call(expand, y, t, b, scales, args, kind)
    assert_close(y, expected, dtype)
    base_rows = (token_slots < 0).cpu()
    assert torch.equal(y[base_rows].cpu(), y0[base_rows].cpu())


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("dist", ["distinct", "uniform"])
def test_bgmv_expand_slices(triton_ready, dtype, dist):
    """One launch over a fused [q|k|v]-like output equals one expand per slice."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"slices{dtype}{dist}".encode()))
    rank, sizes = 16, (40, 24, 8)
    b = (torch.randn(NUM_SLOTS, sum(sizes), rank, generator=gen) / rank**0.5).to(DEVICE, dtype)
    t = torch.randn(DECODES, 3 * rank, generator=gen).to(DEVICE, dtype)
    y = torch.randn(DECODES, sum(sizes), generator=gen).to(DEVICE, dtype)
    idx = torch.tensor(slots_for(dist, DECODES, gen), dtype=torch.int32, device=DEVICE)
    scales = (torch.rand(NUM_SLOTS, generator=gen) + 0.5).to(DEVICE)
    y_tri, y_ref = y.clone(), y.clone()
    bgmv.bgmv_expand_slices_triton(y_tri, t, b, sizes, idx, scales)
    bgmv.bgmv_expand_slices_torch(y_ref, t, b, sizes, idx, scales)
    assert_close(y_tri, y_ref, dtype)
    expected = y.clone()
    offset = 0
    for j, n in enumerate(sizes):
        part = loop_expand(y[:, offset : offset + n], t[:, j * rank : (j + 1) * rank],
                           b[:, offset : offset + n], idx, scales, 0)
        expected[:, offset : offset + n] = part.to(dtype)
        offset += n
    assert_close(y_ref, expected, dtype)


def test_padding_to_max_rank_changes_nothing():
    """A rank-4 adapter stored in a rank-64 slot gives the unpadded product."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, HIDDEN, generator=gen)
    a4, b4 = torch.randn(4, HIDDEN, generator=gen), torch.randn(OUT, 4, generator=gen)
    a_stack, b_stack = torch.zeros(1, 64, HIDDEN), torch.zeros(1, OUT, 64)
    a_stack[0, :4], b_stack[0, :, :4] = a4, b4
    idx = torch.zeros(5, dtype=torch.int32)
    y = torch.zeros(5, OUT)
    bgmv.bgmv_expand(y, bgmv.bgmv_shrink(x, a_stack, idx), b_stack, idx, torch.tensor([0.5]))
    torch.testing.assert_close(y, 0.5 * (x @ a4.T) @ b4.T, atol=1e-5, rtol=1e-5)


def test_empty_batch():
    x, y = torch.zeros(0, HIDDEN), torch.zeros(0, OUT)
    a, b = torch.zeros(2, 8, HIDDEN), torch.zeros(2, OUT, 8)
    idx, indptr = torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    t = bgmv.bgmv_shrink(x, a, idx)
    bgmv.bgmv_expand(y, t, b, idx, torch.ones(2))
    assert t.shape == (0, 8)
    t = sgmv.sgmv_shrink(x, a, indptr, idx, 0)
    sgmv.sgmv_expand(y, t, b, indptr, idx, torch.ones(2), 0)
    assert t.shape == (0, 8)
