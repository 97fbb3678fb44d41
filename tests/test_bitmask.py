"""Token-bitmask apply: the Triton kernel vs the torch reference vs the Semantics loop.

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported); with CUDA it runs compiled unless TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import triton  # noqa: E402

from kernels import bitmask as bm  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
VOCABS = [1, 31, 32, 100, 5003]  # mostly not multiples of 32; 5003 spans two kernel blocks


@pytest.fixture(autouse=True)
def interpreted_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Re-jit the kernel for the interpreter if triton was imported before the env var."""
    from triton.runtime.interpreter import InterpretedFunction

    kernel = bm._apply_bitmask_kernel
    if INTERPRET and not isinstance(kernel, InterpretedFunction):
        monkeypatch.setattr(bm, "_apply_bitmask_kernel", triton.jit(kernel.fn))


def semantics_loop(logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int] | None):
    """The reference docstring's loop, literally."""
    batch, vocab = logits.shape
    for b in range(batch) if indices is None else indices:
        for v in range(vocab):
            if (int(bitmask[b, v // 32]) >> (v % 32)) & 1 == 0:
                logits[b, v] = float("-inf")


def random_case(batch: int, vocab: int, dtype: torch.dtype, density: float, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen).to(dtype)
    allowed = torch.rand(batch, (vocab + 31) // 32 * 32, generator=gen) < density
    weights = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)
    words = (allowed.view(batch, -1, 32).long() * weights).sum(-1)  # (B, W) as uint32 values
    bitmask = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return logits, bitmask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("indices", [None, [2], [0, 3], []])
def test_triton_matches_reference(dtype: torch.dtype, vocab: int, indices: list[int] | None):
    density = 0.5 if vocab > 32 else 0.9
    logits, bitmask = random_case(4, vocab, dtype, density, seed=vocab)
    want = logits.clone()
    bm.apply_token_bitmask_inplace_torch(want, bitmask, indices)
    got = logits.to(DEVICE)
    bm.apply_token_bitmask_inplace_triton(got, bitmask.to(DEVICE), indices)
    assert torch.equal(got.cpu(), want)  # only -inf is written: exact in every dtype
    untouched = [b for b in range(4) if indices is not None and b not in indices]
    assert torch.equal(want[untouched], logits[untouched])


@pytest.mark.parametrize("vocab", [33, 70])
def test_reference_matches_semantics_loop(vocab: int):
    logits, bitmask = random_case(3, vocab, torch.float32, 0.5, seed=1)
    want = logits.clone()
    semantics_loop(want, bitmask, [0, 2])
    bm.apply_token_bitmask_inplace_torch(logits, bitmask, [0, 2])
    assert torch.equal(logits, want)


def test_edge_bits_and_full_rows():
    """Bit 31 (the sign bit), an all-ones row (nothing masked) and an all-zeros row."""
    logits = torch.zeros(3, 64)
    # Row 0 allows only token 31: word 0 is 0x80000000, i.e. -2**31 as int32.
    bitmask = torch.tensor([[-(1 << 31), 0], [-1, -1], [0, 0]], dtype=torch.int32)
    bm.apply_token_bitmask_inplace(logits, bitmask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [31]
    assert torch.isfinite(logits[1]).all()
    assert torch.isinf(logits[2]).all()


def test_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="does not fit"):
        bm.apply_token_bitmask_inplace(torch.zeros(2, 64), torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        bm.apply_token_bitmask_inplace(torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="out of range"):
        bm.apply_token_bitmask_inplace(
            torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32), [2]
        )
