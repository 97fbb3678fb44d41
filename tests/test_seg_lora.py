"""Segmented LoRA (the decode graphs' kernels) over the unified adapter pool: the Triton path
against the torch reference, the reference against a per-token loop over each adapter's dense
A and B, and both blind to pool rows no resident adapter owns. On CPU the Triton kernels run in
the interpreter, as in tests/test_lora_kernels.py; the `gpu` test replays a CUDA graph over
changing adapter mixes."""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

from kernels import fused, seg_lora  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
HIDDEN = 72
# Slot ranks: 0 is an empty slot; 12 and 40 are no multiple of a 16-column tile.
RANKS = (16, 64, 8, 0, 12, 40)
# Rows sorted by adapter as the decode graphs see them, plus base rows between segments: a run
# of 18 (longer than a 16-row tile), one-token segments, a row of the empty slot 3, and unused
# trailing table entries.
ROW_SLOTS = [-1] + [1] * 18 + [3] + [-1] * 2 + [0] * 4 + [4] + [2] * 2 + [5]
CAPACITY = len(ROW_SLOTS) + 2
TOLERANCE = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (4e-2, 2e-2)}  # (atol, rtol)
SIZES = {"qkv": (40, 24, 8), "gate_up": (32, 48), "o": (56,)}
# name: (max_rank, shrink config, expand config, max_rows). "small": 2 splits of K = 72, shrink
# tiles inside one slice (those past a low rank exit early), expand tiles straddling slices;
# "straddle": R = 80, so some 64-column shrink tiles hold the end of one slice (all at i >= a
# low rank) and the start of the next.
CONFIGS = {
    "small": (64, (32, 32, 48, 4, 1), (32, 4), 16),
    "default": (64, seg_lora.SHRINK_CONFIG, seg_lora.EXPAND_CONFIG, 32),
    "straddle": (80, (64, 32, 48, 4, 1), (64, 4), 16),
}


@dataclass(frozen=True)
class Pool:
    """A projection's adapter pool with the slots' adapters at scattered starts."""

    a: torch.Tensor  # [U, S, K]
    b: torch.Tensor  # [U, N]
    starts: torch.Tensor  # [num_slots] int32
    ranks: torch.Tensor  # [num_slots] int32
    scales: torch.Tensor  # [num_slots] fp32
    owned: torch.Tensor  # [U] bool: rows of a resident adapter

    def args(self, sizes, max_rank):
        return self.a, self.b, sizes, self.starts, self.ranks, max_rank

    def with_free_rows(self, fill) -> Pool:
        """The same adapters, with `fill(shape)` in every pool row no adapter owns."""
        a, b = self.a.clone(), self.b.clone()
        free = ~self.owned
        a[free] = fill(a[free].shape).to(a)
        b[free] = fill(b[free].shape).to(b)
        return replace(self, a=a, b=b)


def make_pool(sizes, ranks, k, dtype, gen, device=DEVICE) -> Pool:
    """Adapters laid out in a shuffled order with gaps of free rows between them; the empty
    slots start mid-pool. Free rows hold large finite garbage."""
    order = torch.randperm(len(ranks), generator=gen).tolist()
    starts, u = [0] * len(ranks), 3
    for s in order:
        if ranks[s]:
            starts[s] = u
            u += ranks[s] + int(torch.randint(1, 6, (), generator=gen))
    for s in order:
        if not ranks[s]:
            starts[s] = u // 2
    owned = torch.zeros(u, dtype=torch.bool)
    for s, r in enumerate(ranks):
        owned[starts[s] : starts[s] + r] = True
    a = torch.randn(u, len(sizes), k, generator=gen) / k**0.5
    b = torch.randn(u, sum(sizes), generator=gen) / 8
    a[~owned] = torch.randn(a[~owned].shape, generator=gen) * 1e3
    b[~owned] = torch.randn(b[~owned].shape, generator=gen) * 1e3
    scales = torch.rand(len(ranks), generator=gen) * 2 + 0.25
    as_int = dict(dtype=torch.int32, device=device)
    return Pool(a.to(device, dtype), b.to(device, dtype), torch.tensor(starts, **as_int),
                torch.tensor(ranks, **as_int), scales.to(device), owned.to(device))


def make_case(dtype: torch.dtype, sizes: tuple[int, ...], seed: str):
    gen = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
    pool = make_pool(sizes, RANKS, HIDDEN, dtype, gen)
    x = torch.randn(len(ROW_SLOTS), HIDDEN, generator=gen)
    y = torch.randn(len(ROW_SLOTS), sum(sizes), generator=gen)
    return x.to(DEVICE, dtype), y.to(DEVICE, dtype), pool


def table(max_rows: int, row_slots=ROW_SLOTS, capacity=CAPACITY, device=DEVICE):
    indptr, slots = seg_lora.segment_table(row_slots, capacity, max_rows)
    as_int = dict(dtype=torch.int32, device=device)
    return torch.tensor(indptr, **as_int), torch.tensor(slots, **as_int)


def dense_adapters(pool: Pool, sizes) -> dict[int, tuple[list, list]]:
    """slot -> ([A_j [r, K]], [B_j [N_j, r]]) per slice, copied out of the pool's views."""
    bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
    adapters = {}
    for slot, (u, r) in enumerate(zip(pool.starts.tolist(), pool.ranks.tolist(), strict=True)):
        if r:
            a = [pool.a[u : u + r, j].clone() for j in range(len(sizes))]
            b = [pool.b[u : u + r, lo:hi].t().clone()
                 for lo, hi in zip(bounds, bounds[1:], strict=False)]
            adapters[slot] = (a, b)
    return adapters


def per_token(y, x, pool: Pool, sizes, token_slots) -> torch.Tensor:
    """y + LoRA(x) token by token over the dense adapters, in fp32."""
    out, adapters = y.float().clone(), dense_adapters(pool, sizes)
    bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
    for i, slot in enumerate(token_slots):
        if slot in adapters:
            for j, (a, b) in enumerate(zip(*adapters[slot], strict=True)):
                t = a.float() @ x[i].float()
                out[i, bounds[j] : bounds[j + 1]] += pool.scales[slot] * (b.float() @ t)
    return out


def shrink_reference(x, pool: Pool, max_rank: int, num_slices: int):
    """(t [T, S * R] fp32 with NaN where the shrink writes nothing, written mask)."""
    t = torch.full((len(ROW_SLOTS), num_slices * max_rank), float("nan"), device=DEVICE)
    for row, slot in enumerate(ROW_SLOTS):
        r = int(pool.ranks[slot]) if slot >= 0 else 0
        u = int(pool.starts[slot]) if slot >= 0 else 0
        for j in range(num_slices):
            t[row, j * max_rank : j * max_rank + r] = pool.a[u : u + r, j].float() @ x[row].float()
    return t, ~t.isnan()


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
@pytest.mark.parametrize("proj", list(SIZES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_matches_torch(triton_ready, dtype, proj, config):
    sizes = SIZES[proj]
    max_rank, shrink_cfg, expand_cfg, max_rows = CONFIGS[config]
    x, y, pool = make_case(dtype, sizes, f"{dtype}{proj}{config}")
    indptr, slots = table(max_rows)
    splits = -(-HIDDEN // seg_lora._k_split(HIDDEN, shrink_cfg))
    # poisoned: entries the shrink does not write (rows without an adapter, i >= rank) stay NaN,
    # and the expand must never read them
    partials = torch.full((splits, len(ROW_SLOTS), len(sizes) * max_rank), float("nan"),
                          device=DEVICE)
    seg_lora.seg_shrink_triton(x, pool.a, pool.starts, pool.ranks, max_rank, indptr, slots,
                               max_rows, partials, shrink_cfg)
    t_ref, written = shrink_reference(x, pool, max_rank, len(sizes))
    assert_close(partials.sum(0)[written], t_ref[written], dtype)
    assert partials[:, ~written].isnan().all()
    y_tri, y_ref = y.clone(), y.clone()
    seg_lora.seg_expand_triton(y_tri, partials, pool.b, sizes, pool.starts, pool.ranks, max_rank,
                               indptr, slots, pool.scales, max_rows, expand_cfg)
    seg_lora.seg_lora_torch(y_ref, x, *pool.args(sizes, max_rank), indptr, slots, pool.scales,
                            max_rows)
    assert_close(y_tri, y_ref, dtype)
    untouched = torch.tensor([s < 0 or RANKS[s] == 0 for s in ROW_SLOTS])
    assert torch.equal(y_tri[untouched], y[untouched])


@pytest.mark.parametrize("proj", list(SIZES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_expand_into_an_fp32_delta(triton_ready, dtype, proj):
    """Expanded into zeros in fp32 (`LoraSlots.delta`, a decode graph's deferred LoRA), then
    added by the consumer (`fused.with_delta`), the result is the in-place expand's: the same
    fp32 sum, exactly where nothing contracts y + scale * acc into one FMA (the interpreter),
    rounded once to y's dtype (within one bf16 ulp: the interpreter's bf16 rounding is not
    torch's)."""
    sizes = SIZES[proj]
    max_rank, shrink_cfg, expand_cfg, max_rows = CONFIGS["small"]
    x, y, pool = make_case(dtype, sizes, f"delta{dtype}{proj}")
    indptr, slots = table(max_rows)
    partials = seg_lora.seg_shrink(x, pool.a, pool.starts, pool.ranks, max_rank, indptr, slots,
                                   max_rows, shrink_cfg)
    args = (pool.b, sizes, pool.starts, pool.ranks, max_rank, indptr, slots, pool.scales,
            max_rows, expand_cfg)
    y_in_place = y.clone()
    seg_lora.seg_expand_triton(y_in_place, partials, *args)
    delta = torch.zeros(y.shape, dtype=torch.float32, device=DEVICE)
    seg_lora.seg_expand_triton(delta, partials, *args)
    untouched = torch.tensor([s < 0 or RANKS[s] == 0 for s in ROW_SLOTS])
    assert (delta[untouched] == 0).all() and (delta[~untouched] != 0).any()
    got = fused.with_delta(y, delta)
    if INTERPRET and dtype == torch.float32:
        assert torch.equal(got, y_in_place)
    else:
        ulp = 2.0**-7 if dtype == torch.bfloat16 else 2e-6
        torch.testing.assert_close(got.float(), y_in_place.float(), rtol=ulp, atol=1e-6)


@pytest.mark.parametrize("proj", list(SIZES))
def test_torch_matches_per_token_loop(proj):
    """The segmented reference equals a per-token loop over each adapter's dense A_j and B_j."""
    sizes = SIZES[proj]
    x, y, pool = make_case(torch.float32, sizes, proj)
    indptr, slots = table(16)
    y_seg = y.clone()
    seg_lora.seg_lora_torch(y_seg, x, *pool.args(sizes, 64), indptr, slots, pool.scales)
    torch.testing.assert_close(y_seg, per_token(y, x, pool, sizes, ROW_SLOTS), atol=1e-5,
                               rtol=1e-5)
    y_dispatch = y.clone()  # off CUDA, `seg_lora` is the reference; on CUDA, Triton's
    seg_lora.seg_lora(y_dispatch, x, *pool.args(sizes, 64), indptr, slots, pool.scales)
    if y.is_cuda:
        assert_close(y_dispatch, y_seg, torch.float32)
    else:
        assert torch.equal(y_dispatch, y_seg)


@pytest.mark.parametrize("proj, config", [("qkv", "straddle"), ("gate_up", "small")])
def test_free_pool_rows_are_never_read(triton_ready, proj, config):
    """Results are bit-identical whatever the rows outside the resident adapters hold (their
    garbage, zeros, NaN); the one-call Triton form (its own partials) matches the reference."""
    sizes, (max_rank, shrink_cfg, expand_cfg, max_rows) = SIZES[proj], CONFIGS[config]
    x, y, pool = make_case(torch.float32, sizes, f"free{proj}")
    indptr, slots = table(max_rows)
    fills = {"zeros": torch.zeros, "nan": lambda shape: torch.full(shape, float("nan"))}
    results = {}
    for name, p in [("pool", pool)] + [(n, pool.with_free_rows(f)) for n, f in fills.items()]:
        y_ref, y_tri = y.clone(), y.clone()
        seg_lora.seg_lora_torch(y_ref, x, *p.args(sizes, max_rank), indptr, slots, p.scales,
                                max_rows)
        seg_lora.seg_lora_triton(y_tri, x, *p.args(sizes, max_rank), indptr, slots, p.scales,
                                 max_rows, shrink_cfg, expand_cfg)
        results[name] = y_ref, y_tri
    assert_close(results["pool"][1], results["pool"][0], torch.float32)
    for name in fills:
        assert torch.equal(results[name][0], results["pool"][0]), name
        assert torch.equal(results[name][1], results["pool"][1]), name


@pytest.mark.gpu
def test_graph_replays_follow_the_adapter_mix():
    """One CUDA graph of four projections' LoRA (fused qkv and gate_up) over static segment
    buffers (as the decode graphs capture it), replayed over changing adapter mixes, equals the
    per-token loop."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    batch, max_rank, hidden, inter = 64, 64, 256, 640
    gen = torch.Generator().manual_seed(0)
    ranks = [(8, 16, 64)[i % 3] for i in range(15)] + [0]  # slot 15 is empty
    shapes = {"qkv": (hidden, (256, 128, 128)), "o": (256, (hidden,)),
              "gate_up": (hidden, (inter, inter)), "down": (inter, (hidden,))}
    pools = {f: make_pool(sizes, ranks, k, torch.bfloat16, gen, "cuda")
             for f, (k, sizes) in shapes.items()}
    xs = {f: torch.randn(batch, k, generator=gen).cuda().bfloat16()
          for f, (k, _) in shapes.items()}
    base = {f: torch.randn(batch, sum(sizes), generator=gen).cuda().bfloat16()
            for f, (_, sizes) in shapes.items()}
    ys = {f: y.clone() for f, y in base.items()}
    indptr = torch.zeros(batch + 1, dtype=torch.int32, device="cuda")
    seg_slots = torch.full((batch,), -1, dtype=torch.int32, device="cuda")

    def forward():
        for f, (_, sizes) in shapes.items():
            p, y = pools[f], ys[f]
            y.copy_(base[f])
            if f in ("qkv", "o"):
                seg_lora.seg_lora(y, xs[f], *p.args(sizes, max_rank), indptr, seg_slots,
                                  p.scales)
            else:  # the two halves, as a graph runs the shrink on a side stream
                t = seg_lora.seg_shrink(xs[f], p.a, p.starts, p.ranks, max_rank, indptr,
                                        seg_slots)
                seg_lora.seg_expand_triton(y, t, p.b, sizes, p.starts, p.ranks, max_rank, indptr,
                                           seg_slots, p.scales, seg_lora.MAX_ROWS)

    forward()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    mixes = {"one": [1] * batch, "eight": [i // 8 for i in range(batch)],
             "distinct": list(range(16)) * 4, "base rows": [-1] * 5 + [7] * 40 + [2] * 9,
             "partial batch": [1] * 3 + [4] * 20, "empty slot": [0] * 10 + [15] * 30}
    for name, rows in mixes.items():
        rows = sorted(rows)
        table_indptr, table_slots = table(seg_lora.MAX_ROWS, rows, batch, "cuda")
        indptr.copy_(table_indptr)
        seg_slots.copy_(table_slots)
        graph.replay()
        token_slots = rows + [-1] * (batch - len(rows))
        for f, (_, sizes) in shapes.items():
            expected = per_token(base[f], xs[f], pools[f], sizes, token_slots)
            assert_close(ys[f], expected, torch.bfloat16, msg=f"{name}: {f}")
