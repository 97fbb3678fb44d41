"""Counter-based random numbers: every value is a hash of integers (a seed, a position, an
index), so the same numbers come out on every device and in any batch, with no generator state
to carry. Integer arithmetic is exact everywhere, and so is the one float conversion below (at
most 24 significant bits, scaled by a power of two).

Used by the synthetic weights (`engine.runner.synthetic`) and the sampler's noise
(`engine.sampling.sampler`).
"""

from __future__ import annotations

import torch

M32 = 0xFFFFFFFF


def hash32(x):
    """A 32-bit integer mix of `x`'s low 32 bits: a Python int, or an int64 tensor or numpy
    array (a new one).

    lowbias32's shape, with multipliers below 2**31 so that no int64 product overflows.
    """
    x = x & M32  # on a tensor: a copy, so the in-place steps below leave the caller's alone
    x ^= x >> 16
    x *= 0x7FEB352D
    x &= M32
    x ^= x >> 15
    x *= 0x5BD1E995
    x &= M32
    x ^= x >> 16
    return x


def mix(*words: int) -> int:
    """One 32-bit key from a few integers (each taken mod 2**32), on the host."""
    key = 0
    for w in words:
        key = hash32(key ^ hash32(w))
    return key


def open_uniform(h: torch.Tensor) -> torch.Tensor:
    """Uniform fp32 in (0, 1) from 32-bit hashes (int64): the top 23 bits b give
    (2b + 1) / 2**24, exact in fp32 and never 0 or 1."""
    return ((h >> 8) | 1).to(torch.float32) * 2.0**-24
