"""Segmented LoRA (the decode graphs' kernels) against the torch reference, and the reference
against a per-token loop. On CPU the Triton kernels run in the interpreter, as in
tests/test_lora_kernels.py; the `gpu` test replays a CUDA graph over changing adapter mixes."""

from __future__ import annotations

import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

from kernels import seg_lora  # noqa: E402
from kernels.bgmv import bgmv_expand_slices_torch, bgmv_shrink_torch  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
NUM_SLOTS, HIDDEN = 6, 72
# Rows sorted by adapter as the decode graphs see them, plus base rows between segments: a run
# of 20 (longer than a 16-row tile), one-token segments, and unused trailing table entries.
ROW_SLOTS = [-1] * 2 + [3] * 20 + [1] + [-1] * 3 + [0] * 5 + [4] + [2] * 2 + [5]
CAPACITY = len(ROW_SLOTS) + 4
TOLERANCE = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (4e-2, 2e-2)}  # (atol, rtol)
SMALL = ((16, 16, 32, 4, 1), (16, 4))  # 3 splits of K = 72; tiles straddle slices
CONFIGS = {"small": SMALL, "default": (seg_lora.SHRINK_CONFIG, seg_lora.EXPAND_CONFIG)}
SIZES = {"qkv": (40, 24, 8), "gate_up": (32, 48), "o": (56,)}


def make_case(dtype: torch.dtype, sizes: tuple[int, ...], rank: int, seed: str):
    gen = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
    n = sum(sizes)
    a = torch.randn(NUM_SLOTS, len(sizes) * rank, HIDDEN, generator=gen) / HIDDEN**0.5
    b = torch.randn(NUM_SLOTS, n, rank, generator=gen) / rank**0.5
    x = torch.randn(len(ROW_SLOTS), HIDDEN, generator=gen)
    y = torch.randn(len(ROW_SLOTS), n, generator=gen)
    scales = torch.rand(NUM_SLOTS, generator=gen) * 2 + 0.25
    return (x.to(DEVICE, dtype), y.to(DEVICE, dtype), a.to(DEVICE, dtype), b.to(DEVICE, dtype),
            scales.to(DEVICE))


def table(max_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    indptr, slots = seg_lora.segment_table(ROW_SLOTS, CAPACITY, max_rows)
    as_int = dict(dtype=torch.int32, device=DEVICE)
    return torch.tensor(indptr, **as_int), torch.tensor(slots, **as_int)


def assert_close(actual, expected, dtype, msg=None):
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), atol=atol, rtol=rtol,
                               msg=msg)


def test_segment_table():
    indptr, slots = seg_lora.segment_table([-1, -1, 2, 2, 2, 2, 2, 0, -1, 1], 12, max_rows=2)
    assert indptr == [0, 2, 4, 6, 7, 8, 9, 10, 10, 10, 10, 10, 10]
    assert slots == [-1, 2, 2, 2, 0, -1, 1, -1, -1, -1, -1, -1]
    assert seg_lora.segment_table([], 2) == ([0, 0, 0], [-1, -1])
    with pytest.raises(AssertionError, match="exceed the capacity"):
        seg_lora.segment_table([0, 1, 2], 2)


@pytest.fixture(scope="module")
def triton_ready():
    if not INTERPRET and not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 and no CUDA device")
    if INTERPRET and type(seg_lora._shrink_kernel).__name__ != "InterpretedFunction":
        pytest.skip("kernels were imported before TRITON_INTERPRET=1 was set")


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("max_rows", [16, 32])
@pytest.mark.parametrize("proj", list(SIZES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_matches_torch(triton_ready, dtype, proj, max_rows, config):
    sizes, rank = SIZES[proj], 16 if proj == "qkv" else 8
    x, y, a, b, scales = make_case(dtype, sizes, rank, f"{dtype}{proj}{max_rows}")
    indptr, slots = table(max_rows)
    shrink_cfg, expand_cfg = CONFIGS[config]
    splits = -(-HIDDEN // seg_lora._k_split(HIDDEN, shrink_cfg))
    # poisoned: rows without an adapter keep NaN partials, which the expand must never read
    partials = torch.full((splits, len(ROW_SLOTS), a.shape[1]), float("nan"), device=DEVICE)
    seg_lora.seg_shrink_triton(x, a, indptr, slots, max_rows, partials, shrink_cfg)
    lora_rows = torch.tensor(ROW_SLOTS) >= 0
    t_ref = bgmv_shrink_torch(x, a, torch.tensor(ROW_SLOTS, device=DEVICE))
    assert_close(partials.sum(0)[lora_rows], t_ref[lora_rows], dtype)
    assert partials[:, ~lora_rows].isnan().all()
    y_tri, y_ref = y.clone(), y.clone()
    seg_lora.seg_expand_triton(y_tri, partials, b, sizes, indptr, slots, scales, max_rows,
                               expand_cfg)
    seg_lora.seg_lora_torch(y_ref, x, a, b, sizes, indptr, slots, scales, max_rows)
    assert_close(y_tri, y_ref, dtype)
    assert torch.equal(y_tri[~lora_rows], y[~lora_rows])
    y_fused = y.clone()  # the one-call form allocates its own partials
    seg_lora.seg_lora_triton(y_fused, x, a, b, sizes, indptr, slots, scales, max_rows,
                             shrink_cfg, expand_cfg)
    assert torch.equal(y_fused, y_tri)


@pytest.mark.parametrize("proj", list(SIZES))
def test_torch_matches_per_token_reference(proj):
    """The segmented reference equals BGMV's (one slot per token) on the same rows."""
    x, y, a, b, scales = make_case(torch.float32, SIZES[proj], 8, proj)
    indptr, slots = table(16)
    token_slots = torch.tensor(ROW_SLOTS, dtype=torch.int32, device=DEVICE)
    y_seg, y_tok = y.clone(), y.clone()
    seg_lora.seg_lora_torch(y_seg, x, a, b, SIZES[proj], indptr, slots, scales)
    bgmv_expand_slices_torch(y_tok, bgmv_shrink_torch(x, a, token_slots), b, SIZES[proj],
                             token_slots, scales)
    torch.testing.assert_close(y_seg, y_tok, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_graph_replays_follow_the_adapter_mix():
    """One CUDA graph of every projection's LoRA over static segment buffers (as the decode
    graphs capture it), replayed over changing adapter mixes, equals the per-token torch path."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from engine.config import ModelConfig
    from lora.batch import LoraBatchInfo
    from lora.slots import LoraSlots

    cfg = ModelConfig(vocab_size=1, hidden_size=256, intermediate_size=640, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=64, max_position=1)
    batch, gen = 64, torch.Generator(device="cuda").manual_seed(0)
    slots = LoraSlots(cfg, 16, 16, torch.bfloat16, "cuda")
    for stack in slots.layers[0].values():
        stack.a.normal_(0, stack.a.shape[2] ** -0.5, generator=gen)
        stack.b.normal_(0, 0.25, generator=gen)
    slots.scales.uniform_(0.5, 2.0, generator=gen)
    proj = slots.layers[0]
    xs = {f: torch.randn(batch, s.a.shape[2], device="cuda", generator=gen).bfloat16()
          for f, s in proj.items()}
    base = {f: torch.randn(batch, s.b.shape[1], device="cuda", generator=gen).bfloat16()
            for f, s in proj.items()}
    ys = {f: y.clone() for f, y in base.items()}
    indptr = torch.zeros(batch + 1, dtype=torch.int32, device="cuda")
    seg_slots = torch.full((batch,), -1, dtype=torch.int32, device="cuda")
    info = LoraBatchInfo.segmented(indptr, seg_slots)

    def forward():
        for f, y in ys.items():
            y.copy_(base[f])
            slots.apply(y, xs[f], 0, f, info)

    forward()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    mixes = {"one": [3] * batch, "eight": [i // 8 for i in range(batch)],
             "distinct": list(range(16)) * 4, "base rows": [-1] * 5 + [7] * 40 + [2] * 9,
             "partial batch": [1] * 3 + [4] * 20}
    for name, rows in mixes.items():
        rows = sorted(rows)
        table_indptr, table_slots = seg_lora.segment_table(rows, batch)
        indptr.copy_(torch.tensor(table_indptr))
        seg_slots.copy_(torch.tensor(table_slots))
        graph.replay()
        token_slots = torch.tensor(rows + [-1] * (batch - len(rows)), dtype=torch.int32,
                                   device="cuda")
        for f, s in proj.items():
            expected = base[f].clone()
            t = bgmv_shrink_torch(xs[f], s.a, token_slots)
            bgmv_expand_slices_torch(expected, t, s.b, s.sizes, token_slots, slots.scales)
            assert_close(ys[f], expected, torch.bfloat16, msg=f"{name}: {f}")
