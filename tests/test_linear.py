"""kernels/linear.py against its reference, `F.linear`: the weight-first CPU product gives the
same values (to float rounding) for every row count, with and without bias, for flat and
batched inputs; other dtypes take `F.linear` itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.linear import Linear, linear


@pytest.mark.parametrize("rows", [1, 2, 5, 17, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_weight_first_matches_f_linear(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 64, generator=g)
    got = linear(x, w, b)
    assert got.shape == (rows, 96) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_batched_input_and_the_module() -> None:
    g = torch.Generator().manual_seed(0)
    layer = Linear(32, 48, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48, 32, generator=g))
        layer.bias.copy_(torch.randn(48, generator=g))
    x = torch.randn(3, 1, 32, generator=g)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias),
                               rtol=1e-5, atol=1e-5)
    assert isinstance(layer, torch.nn.Linear)  # loaders and the LoRA wrapper see a Linear


def test_other_dtypes_take_f_linear() -> None:
    w = torch.randn(8, 4, dtype=torch.bfloat16)
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    assert torch.equal(linear(x, w), F.linear(x, w))
