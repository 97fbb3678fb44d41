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


@pytest.mark.parametrize("m, k, n, split_k", [(1, 256, 96, 1), (5, 300, 64, 3), (64, 512, 64, 2)])
def test_decode_gemm_matches_f_linear(m: int, k: int, n: int, split_k: int) -> None:
    """The decode-sized Triton product that captured CUDA graphs take for bf16 weights (ragged
    K and N, split K summed atomically) against the fp32 product of the same bf16 values
    (Triton on either device; the interpreter on CPU)."""
    from kernels.decode_gemm import decode_gemm

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=g).to(dev, torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(dev, torch.bfloat16)
    got = decode_gemm(x, w, torch.float32, (32, 64, split_k, 2, 4))
    torch.testing.assert_close(got, F.linear(x.float(), w.float()), rtol=1e-4, atol=1e-3)
    cast = decode_gemm(x, w, torch.bfloat16, (32, 64, split_k, 2, 4))
    assert cast.dtype == torch.bfloat16
    torch.testing.assert_close(cast.float(), got, rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 64, 65])
def test_captured_decode_products_match_cublas(rows: int) -> None:
    """In a captured CUDA graph, `linear` takes the decode-sized kernel up to 64 rows (Llama-3-8B's
    `down` shape, whose configuration splits K) and gives cuBLAS's product to bf16 rounding."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 14336, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16, generator=g) / 64
    out = torch.empty(rows, 4096, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out.copy_(linear(x, w))  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(linear(x, w))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    want = F.linear(x, w).float()
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
