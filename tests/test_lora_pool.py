"""The device adapter pool (`lora.slots`): rows placed per fused projection at each adapter's
own rank, freed and reused; the manager evicting idle adapters until rows fit; and the memory
sizing that shares a GPU between the pool and the KV cache (`EngineConfig.resolve`)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig, ModelConfig, ModelLoadError
from lora.adapter import LoraAdapter, LoraModule, load_adapter
from lora.manager import AdapterManager
from lora.slots import FUSED_INDEX, LoraSlots, PackedAdapter, RowAllocator, projection_ranks
from lora.validate import projection_dims
from tests import lora_files as lf
from tests.test_hostile_uploads import SMOLLM2


@dataclass(frozen=True)
class Shape:
    architecture: str = "LlamaForCausalLM"
    hidden_size: int = 32
    intermediate_size: int = 48
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8


BASE = Shape()


def adapter(rank: int, targets: tuple[str, ...], seed: int = 0, scale: float = 2.0,
            ranks: dict[str, int] | None = None) -> LoraAdapter:
    """Random LoRA of `rank` on `targets` (a module's own rank from `ranks`)."""
    g = torch.Generator().manual_seed(seed)
    dims = projection_dims(BASE)
    layers = tuple(
        {p: LoraModule(torch.randn((ranks or {}).get(p, rank), dims[p][0], generator=g),
                       torch.randn(dims[p][1], (ranks or {}).get(p, rank), generator=g), scale)
         for p in targets}
        for _ in range(BASE.num_layers))
    return LoraAdapter(f"r{rank}-{seed}", rank, scale, layers)


ATTN = ("q_proj", "v_proj")
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_row_allocator_matches_a_bitmap():
    """First fit over a bitmap of rows, under random allocations and frees."""
    rng = random.Random(0)
    rows = RowAllocator(64)
    used = [False] * 64
    held: list[tuple[int, int]] = []
    for _ in range(2000):
        if held and rng.random() < 0.45:
            start, n = held.pop(rng.randrange(len(held)))
            rows.free(start, n)
            used[start : start + n] = [False] * n
        else:
            n = rng.choice([1, 4, 8, 16, 32])
            first = next((i for i in range(64 - n + 1) if not any(used[i : i + n])), None)
            assert rows.fits(n) == (first is not None)
            start = rows.allocate(n)
            assert start == first
            if start is not None:
                used[start : start + n] = [True] * n
                held.append((start, n))
        assert rows.num_free == used.count(False)
    for start, n in held:
        rows.free(start, n)
    assert rows.allocate(64) == 0  # every run merged back into one


def test_adapters_take_rows_at_their_own_rank_per_projection():
    slots = LoraSlots(BASE, num_slots=4, pool_rows=24, max_rank=16)
    attn = adapter(8, ATTN, 1)
    full = adapter(16, ALL, 2, ranks={"v_proj": 4, "down_proj": 4})
    assert projection_ranks(full) == {"qkv_proj": 16, "o_proj": 16, "gate_up_proj": 16,
                                      "down_proj": 4}
    slots.load(0, attn)
    slots.load(1, full)
    f = FUSED_INDEX
    assert slots.ranks[:, 0].tolist() == [8, 0, 0, 0]  # attention only: no MLP rows
    assert slots.ranks[:, 1].tolist() == [16, 16, 16, 4]
    assert slots.placement(1) == {"qkv_proj": 8, "o_proj": 0, "gate_up_proj": 0,
                                  "down_proj": 0}
    # The pools hold each module at its rows: A's slice j, and B transposed beside its slices;
    # a module of a lower rank than its projection's has zeros in the rows past its own.
    layer = slots.layers[1]
    q, v = full.layers[1]["q_proj"], full.layers[1]["v_proj"]
    qkv = layer["qkv_proj"]
    torch.testing.assert_close(qkv.a[8:24, 0], q.a)
    torch.testing.assert_close(qkv.a[8:12, 2], v.a)
    assert not qkv.a[12:24, 2].any()
    n_q, n_k = qkv.sizes[0], qkv.sizes[1]
    torch.testing.assert_close(qkv.b[8:12, n_q + n_k :], v.b.T)
    assert not qkv.b[12:24, n_q + n_k :].any()
    torch.testing.assert_close(layer["down_proj"].a[0:4, 0], full.layers[1]["down_proj"].a)
    assert slots.scales[:2].tolist() == [2.0, 2.0]
    # 24 rows: no room for another rank-16 adapter in qkv until one leaves; clear frees them.
    assert not slots.fits(adapter(16, ATTN, 3))
    assert slots.fits(adapter(16, ("down_proj",), 3))  # down_proj holds 4 rows of 24
    slots.clear(0)
    assert slots.ranks[f["qkv_proj"], 0] == 0 and slots.scales[0] == 0
    assert slots.fits(adapter(8, ATTN, 3)) and not slots.fits(adapter(16, ATTN, 3))
    slots.clear(1)
    assert slots.fits(adapter(16, ALL, 3))


def test_failed_load_leaves_no_rows_taken(monkeypatch):
    slots = LoraSlots(BASE, num_slots=2, pool_rows=16, max_rank=16)

    def broken(*args, **kwargs):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(slots, "_copy", broken)
    with pytest.raises(RuntimeError):
        slots.load(0, adapter(16, ALL))
    monkeypatch.undo()
    assert slots.ranks.sum() == 0
    slots.load(1, adapter(16, ALL))  # every row came back
    with pytest.raises(ValueError, match="no 8 free rows"):
        slots.load(0, adapter(8, ATTN))
    with pytest.raises(ValueError, match="exceeds the max LoRA rank 16"):
        slots.load(0, adapter(32, ATTN))


def test_manager_evicts_idle_adapters_until_rows_fit(tmp_path: Path):
    """Four slots but 32 rows: a rank-32 adapter waits while a smaller one runs, then takes the
    rows of as many idle adapters as it needs."""
    slots = LoraSlots(BASE, num_slots=4, pool_rows=32, max_rank=32)
    mgr = AdapterManager(BASE, slots, max_cpu_loras=8)
    for name, ad in (("a", adapter(8, ALL, 1)), ("b", adapter(16, ALL, 2)),
                     ("big", adapter(32, ALL, 3))):
        mgr._registry[("t", name)] = entry = _entry_for(name, ad)
        mgr._host_put(entry, slots.pack(ad))
    a, b, big = (mgr.attach("t", n) for n in ("a", "b", "big"))
    assert mgr.admit(a) and mgr.admit(b)
    assert mgr.num_resident["device"] == 2
    assert not mgr.admit(big)  # a and b run: nothing may go
    mgr.release(b)
    assert not mgr.admit(big)  # b's 16 rows are not enough while a holds 8
    assert mgr.num_resident["device"] == 1  # b went on the way
    mgr.release(a)
    assert mgr.admit(big) and big.slot >= 0
    assert mgr.stats.evictions["device"] == 2
    assert slots.ranks[:, big.slot].tolist() == [32] * 4


def _entry_for(name: str, ad: LoraAdapter):
    from lora.manager import _Entry

    return _Entry("t", name, Path("/nonexistent"), False, ad.rank,
                  tuple(sorted(ad.target_modules)), ad.num_bytes, 0, hash(name) or 1)


LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                        max_position=8192)
GIB = 2**30


def test_cpu_keeps_the_laptop_defaults():
    cfg, why = EngineConfig(device="cpu", dtype="float32").resolve(LLAMA3_8B, "cpu")
    assert why == ""
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_loras) == (64, 512, 4)
    assert (cfg.max_cpu_loras, cfg.lora_pool_rows, cfg.max_lora_rank) == (16, 128, 128)
    two, _ = EngineConfig(device="cpu", dtype="float32", max_loras=2,
                          max_lora_rank=16).resolve(LLAMA3_8B, "cpu")
    assert (two.max_loras, two.lora_pool_rows) == (2, 32)
    page = 2 * 32 * 8 * 128 * 4 * 16
    assert cfg.num_pages == 2 * GIB // page


def test_gpu_memory_is_shared_by_the_adapter_pool_and_the_kv_cache():
    """An 80 GB GPU with 16 GB of bf16 weights loaded: 0.9 of it goes to the activations' reserve,
    a tenth of the rest to the adapter pool, and the KV cache takes what is left."""
    total, free = 80 * GIB, 64 * GIB
    base = EngineConfig(device="cuda", dtype="bfloat16")
    cfg, why = base.resolve(LLAMA3_8B, "cuda", (total, free))
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (256, 8192)
    row = base._lora_row_bytes(LLAMA3_8B)
    assert row == 81920 * 32 * 2  # lora_A and lora_B rows of the 7 projections, 32 layers
    left = int(0.9 * total) - (total - free) - base._activation_bytes(LLAMA3_8B, 256, 8192)
    assert cfg.lora_pool_rows == left // 10 // row
    assert cfg.max_loras == min(512, cfg.lora_pool_rows // 8)
    kv = left - cfg.lora_pool_rows * row
    assert cfg.num_pages == kv // base._page_bytes(LLAMA3_8B)
    used = (total - free) + base._activation_bytes(LLAMA3_8B, 256, 8192) + \
        cfg.lora_pool_rows * row + cfg.num_pages * base._page_bytes(LLAMA3_8B)
    assert 0.89 * total < used <= 0.9 * total
    assert "adapter pool" in why and "KV cache" in why
    # Flags given by hand are kept; the rest is fitted around them.
    fixed, _ = EngineConfig(device="cuda", dtype="bfloat16", max_loras=0,
                            gpu_memory_utilization=0.5).resolve(LLAMA3_8B, "cuda", (total, free))
    assert fixed.lora_pool_rows == 0 and fixed.max_loras == 0
    left = int(0.5 * total) - (total - free) - base._activation_bytes(LLAMA3_8B, 256, 8192)
    assert fixed.num_pages == left // base._page_bytes(LLAMA3_8B)
    slots, _ = EngineConfig(device="cuda", dtype="bfloat16", max_loras=64,
                            max_lora_rank=16).resolve(LLAMA3_8B, "cuda", (total, free))
    assert (slots.max_loras, slots.lora_pool_rows) == (64, 64 * 16)  # each at the largest rank
    given, _ = EngineConfig(device="cuda", dtype="bfloat16", max_loras=16, lora_pool_rows=512,
                            kv_cache_gb=10).resolve(LLAMA3_8B, "cuda", (total, free))
    assert (given.max_loras, given.lora_pool_rows) == (16, 512)
    assert given.num_pages == 10 * GIB // base._page_bytes(LLAMA3_8B)


def test_the_adapter_host_cache_fits_the_host_memory():
    """On a GPU the host cache is bounded by bytes, a quarter of the host memory available at
    start, and by no count unless --max-cpu-loras is given; a CPU keeps its 16 adapters."""
    gpu = (80 * GIB, 64 * GIB)
    cfg, why = EngineConfig(device="cuda", dtype="bfloat16").resolve(
        LLAMA3_8B, "cuda", gpu, host_available=100 * GIB)
    assert (cfg.max_cpu_loras, cfg.cpu_lora_cache_gb) == (None, 25.0)
    assert "adapter host cache 25.0 GiB (a quarter of the 100.0 GiB of host memory" in why
    given, _ = EngineConfig(device="cuda", dtype="bfloat16", max_cpu_loras=40,
                            cpu_lora_cache_gb=3).resolve(LLAMA3_8B, "cuda", gpu)
    assert (given.max_cpu_loras, given.cpu_lora_cache_gb) == (max(40, given.max_loras), 3)
    cpu, _ = EngineConfig(device="cpu", dtype="float32").resolve(LLAMA3_8B, "cpu")
    assert (cpu.max_cpu_loras, cpu.cpu_lora_cache_gb) == (16, None)


def test_the_host_cache_evicts_by_bytes(tmp_path: Path):
    """A host tier of 2.5 adapters' bytes and no count bound: four uploads leave the two least
    recently used in their folders only; a request for one reads it back, and the least
    recently used of the others leaves in turn."""
    def upload(name: str) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        for file, data in lf.adapter():
            (folder / file).write_bytes(data)
        return folder

    slots = LoraSlots(SMOLLM2, num_slots=1, pool_rows=8, max_rank=8)
    one = slots.pack(load_adapter(upload("probe"), SMOLLM2, max_rank=8)).host_bytes
    mgr = AdapterManager(SMOLLM2, slots, None, max_cpu_bytes=int(2.5 * one))
    for name in "abcd":
        mgr.add("t", name, upload(name))
    assert [a.tier for a in mgr.list("t")] == ["disk", "disk", "host", "host"]
    lease = mgr.attach("t", "a")
    assert not mgr.admit(lease)  # read from its folder in the background
    mgr.wait_for_loads(30)
    assert mgr.admit(lease)
    assert [a.tier for a in mgr.list("t")] == ["device", "disk", "disk", "host"]
    assert (mgr.stats.loads["host"], mgr.stats.evictions["host"]) == (5, 3)


def test_the_host_tier_holds_each_adapter_once():
    """The host tier keeps an adapter as the pools lay it out, not the validated tensors too
    (slots that need those to load, as tensor parallelism's do, keep them as its source); a
    device load copies from that layout what `load` of the validated adapter copies."""
    ad = adapter(16, ALL, 5)
    slots = LoraSlots(BASE, num_slots=2, pool_rows=32, max_rank=16)
    mgr = AdapterManager(BASE, slots, max_cpu_loras=4)
    mgr._registry[("t", "a")] = entry = _entry_for("a", ad)
    mgr._host_put(entry, slots.pack(ad))
    assert entry.packed is not None and entry.packed.source is None
    packed_bytes = sum(t.numel() * t.element_size()
                       for t in (*entry.packed.a.values(), *entry.packed.b.values()))
    assert entry.host_bytes == packed_bytes
    assert mgr.admit(mgr.attach("t", "a"))
    ref = LoraSlots(BASE, num_slots=2, pool_rows=32, max_rank=16)
    ref.load(entry.slot, ad)
    for got, want in zip(_pools(slots), _pools(ref), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)

    class Sourced(LoraSlots):
        keeps_source = True

    kept = Sourced(BASE, num_slots=2, pool_rows=32, max_rank=16).pack(ad)
    assert kept.source is ad and kept.host_bytes == packed_bytes + ad.num_bytes


def test_too_little_gpu_memory_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="--gpu-memory-utilization 0.2 leaves"):
        EngineConfig(device="cuda", dtype="bfloat16", gpu_memory_utilization=0.2).resolve(
            LLAMA3_8B, "cuda", (80 * GIB, 64 * GIB))
    with pytest.raises(ModelLoadError, match="adapter pool"):
        EngineConfig(device="cuda", dtype="bfloat16", lora_pool_rows=100_000).resolve(
            LLAMA3_8B, "cuda", (80 * GIB, 64 * GIB))


def _pools(slots: LoraSlots) -> list[torch.Tensor]:
    return [t.cpu() for layer in slots.layers for p in layer.values() for t in (p.a, p.b)]


@pytest.mark.gpu
def test_gpu_load_copies_on_a_stream_behind_the_queued_steps():
    """On a GPU a load is asynchronous: the slot serves once `ready`, the pools then hold what
    the synchronous CPU load writes, and the copy waits for the steps already queued (here a
    read of rows an evicted adapter left, queued behind 50 ms of work) before it overwrites
    them."""
    ref = LoraSlots(BASE, num_slots=2, pool_rows=32, max_rank=16)
    slots = LoraSlots(BASE, num_slots=2, pool_rows=32, max_rank=16, device="cuda")
    old, new = adapter(16, ALL, 1), adapter(16, ALL, 2, ranks={"k_proj": 8})
    packed = slots.pack(old)
    assert all(t.is_pinned() for t in (*packed.a.values(), *packed.b.values()))
    slots.load(0, packed)
    slots.wait()
    rows = slots.placement(0)["qkv_proj"]
    pool = slots.layers[1]["qkv_proj"].a
    torch.cuda._sleep(100_000_000)  # the compute stream is busy for a while
    seen = pool[rows : rows + 16].clone()  # queued behind it: must read `old`
    slots.clear(0)
    slots.load(1, new)  # into the rows `old` left
    assert slots.placement(1)["qkv_proj"] == rows
    assert not slots.ready(1) and slots.ranks[:, 1].tolist() == [0, 0, 0, 0]
    slots.wait()
    assert slots.ready(1) and slots.ranks[:, 1].tolist() == [16, 16, 16, 16]
    torch.testing.assert_close(seen.cpu(), packed.a["qkv_proj"][1])
    ref.load(1, new)
    for got, want in zip(_pools(slots), _pools(ref), strict=True):
        torch.testing.assert_close(got[rows : rows + 16], want[rows : rows + 16])


@pytest.mark.gpu
def test_gpu_manager_admits_once_the_copy_has_landed():
    slots = LoraSlots(BASE, num_slots=2, pool_rows=32, max_rank=16, device="cuda")
    mgr = AdapterManager(BASE, slots, max_cpu_loras=4)
    ad = adapter(16, ALL, 3)
    mgr._registry[("t", "a")] = entry = _entry_for("a", ad)
    mgr._host_put(entry, slots.pack(ad))
    lease = mgr.attach("t", "a")
    torch.cuda._sleep(100_000_000)  # the copy queues behind this
    assert not mgr.admit(lease) and lease.slot < 0 and entry.active == 0
    assert mgr.num_resident["device"] == 1 and mgr.placed(lease) == "copying"  # its copy in flight
    mgr.wait_for_copies()
    assert mgr.admit(lease) and lease.slot >= 0 and entry.active == 1
    assert mgr.placed(lease) == "ready"


class CopyInFlight(LoraSlots):
    """CPU slots whose loads land when `land()` says, as a GPU's copy stream's do (the copy
    itself is the CPU's synchronous one): the window between a load and its first request's
    admission that only a GPU has otherwise (`test_gpu_fresh_adapters_keep_their_slots`)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.in_flight: set[int] = set()

    def load(self, slot: int, adapter: LoraAdapter | PackedAdapter) -> None:
        super().load(slot, adapter)
        self.in_flight.add(slot)

    def ready(self, slot: int) -> bool:
        return slot not in self.in_flight

    def land(self) -> None:
        self.in_flight.clear()


def _manager_of(slots: LoraSlots, names: str) -> AdapterManager:
    mgr = AdapterManager(BASE, slots, max_cpu_loras=8)
    for seed, name in enumerate(names):
        ad = adapter(8, ALL, seed)
        mgr._registry[("t", name)] = entry = _entry_for(name, ad)
        mgr._host_put(entry, slots.pack(ad))
    return mgr


def test_a_fresh_adapter_keeps_its_slot_until_its_request_is_admitted():
    """Two slots, three adapters. a and b load for their waiting requests; once their copies
    land, c's request (first in the queue, say) must not evict them before their own requests
    are admitted: the loads would otherwise chase each other (2,036 loads for 512 requests on
    an H200). Once a request is admitted or gone, its adapter is an ordinary idle one again."""
    slots = CopyInFlight(BASE, num_slots=2, pool_rows=32, max_rank=16)
    mgr = _manager_of(slots, "abc")
    la, lb, lc = (mgr.attach("t", n) for n in "abc")
    assert not mgr.admit(la) and not mgr.admit(lb)  # both copies in flight
    slots.land()
    assert not mgr.admit(lc) and mgr.placed(lc) == "none"  # a and b wait for their requests
    assert mgr.admit(la) and mgr.admit(lb)
    assert mgr.stats.loads["device"] == 2 and mgr.stats.evictions["device"] == 0
    mgr.release(la)  # a is idle, admitted once since its load: c may take its slot
    assert not mgr.admit(lc) and mgr.placed(lc) == "copying"
    assert mgr.stats.evictions["device"] == 1
    mgr.release(lb)
    lb2 = mgr.attach("t", "b")
    mgr.release(lc)  # c's request went away before it ran: c waits for nobody now
    slots.land()
    assert mgr.admit(lb2) and mgr.stats.loads["device"] == 3  # b stayed
    la2 = mgr.attach("t", "a")
    assert not mgr.admit(la2) and mgr.stats.evictions["device"] == 2  # c's slot, not b's
    mgr.release(la2)
    mgr.release(la2)  # twice: counted once
    assert mgr._registry[("t", "a")].waiting == 0


@pytest.mark.gpu
def test_gpu_fresh_adapters_keep_their_slots():
    """As `test_a_fresh_adapter_keeps_its_slot_until_its_request_is_admitted`, with the real
    copy stream: the copies of a and b queue behind 50 ms of work, land, and c's request
    finds no slot to take."""
    slots = LoraSlots(BASE, num_slots=2, pool_rows=32, max_rank=16, device="cuda")
    mgr = _manager_of(slots, "abc")
    la, lb, lc = (mgr.attach("t", n) for n in "abc")
    torch.cuda._sleep(100_000_000)
    assert not mgr.admit(la) and not mgr.admit(lb)
    mgr.wait_for_copies()
    assert not mgr.admit(lc) and mgr.placed(lc) == "none"
    assert mgr.admit(la) and mgr.admit(lb) and mgr.stats.loads["device"] == 2
