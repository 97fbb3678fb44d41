"""The device tier: resident adapters in one pool per projection, each at its own rank.

The base model fuses projections (`qkv_proj` rows `[q|k|v]`, `gate_up_proj` rows `[gate|up]`).
Each layer keeps, per fused projection of S slices, a pool of `U` rank rows (S-LoRA's unified
memory, without pages: an adapter takes one contiguous run of rows):

    a: [U, S, in_features]     row u + i, slice j: row i of that slice's lora_A
    b: [U, sum_j out_features_j]   row u + i: row i of lora_B^T, slices side by side

A resident adapter has a slot (an index into `starts`, `ranks`, `scales`), and in each fused
projection it targets the rows `starts[f, slot] : starts[f, slot] + ranks[f, slot]`, where the
rank is its largest over that projection's slices (a slice it does not target, or of a lower
rank, is zeros there). A projection it does not target takes no rows (rank 0), so an attention
only adapter costs nothing in the MLP's pools. `scales[slot]` is the adapter's alpha / r; a
module whose own scale differs (PEFT's rank/alpha patterns) has the ratio folded into its B.
Every layer places an adapter at the same rows, so one allocator per fused projection serves
all layers. The kernels read an adapter's own rows only (`kernels.sgmv`), so the rest of a pool
may hold anything.

Loading: `pack` lays an adapter out as the pools hold it (on a GPU in pinned host memory, done
off the engine thread by the manager's loader; the manager's host tier keeps it so), and `load`
copies it into its rows. On a GPU
that copy runs on a copy stream, behind the steps already queued (which may still read rows an
evicted adapter left) and beside the ones after: no step waits for it. `ready(slot)` says
when it has landed; the slot table names the adapter only from then.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lora.adapter import LoraAdapter
from lora.batch import (
    LoraBatchInfo,
    SlotTable,
    lora_shrink_expand,
    projection_expand,
    projection_shrink,
)
from lora.shape import BaseShape
from lora.validate import projection_dims

# (projection, a [r, in], b [out, r]) -> this rank's (a, b)
Shard = Callable[[str, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
FUSED_INDEX = {fused: f for f, fused in enumerate(FUSED)}


@dataclass(frozen=True)
class PackedAdapter:
    """An adapter in the pools' layout, on the host: for each fused projection it targets,
    `a[fused]` [layers, rank, slices, in_features] and `b[fused]` [layers, rank, out_features]
    (lora_B^T, each module's scale relative to `scale` folded in; what a slice lacks is zeros),
    `rank` that projection's largest over its slices. `source`: the validated adapter it was
    packed from, kept only where loading needs it too (`LoraSlots.keeps_source`)."""

    name: str
    a: dict[str, torch.Tensor]
    b: dict[str, torch.Tensor]
    scale: float
    source: LoraAdapter | None = None

    @property
    def ranks(self) -> dict[str, int]:
        return {fused: a.shape[1] for fused, a in self.a.items()}

    @property
    def host_bytes(self) -> int:
        """What it holds in host memory, its source's tensors included."""
        packed = (*self.a.values(), *self.b.values())
        return (sum(t.numel() * t.element_size() for t in packed)
                + (self.source.num_bytes if self.source is not None else 0))


@dataclass
class _Copy:
    """A load in flight on the copy stream."""

    done: torch.cuda.Event
    rows: dict[str, tuple[int, int]]
    scale: float


@dataclass(frozen=True)
class ProjectionPool:
    """The LoRA weights of one (fused) projection of one layer, for every resident adapter."""

    a: torch.Tensor  # (U, num_slices, in_features)
    b: torch.Tensor  # (U, sum(sizes)): lora_B^T, slice j's columns after slices 0..j-1
    sizes: tuple[int, ...]  # out_features of each slice


class RowAllocator:
    """First fit over `total` rows; freed runs merge with their free neighbours."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._free: list[tuple[int, int]] = [(0, total)] if total else []  # (start, length)

    def allocate(self, n: int) -> int | None:
        """The first row of a free run of `n` rows, now taken; None when no run is long enough."""
        for i, (start, length) in enumerate(self._free):
            if length >= n:
                self._free[i : i + 1] = [(start + n, length - n)] if length > n else []
                return start
        return None

    def fits(self, n: int) -> bool:
        return any(length >= n for _, length in self._free)

    def free(self, start: int, n: int) -> None:
        i = bisect.bisect(self._free, (start, n))
        runs = self._free
        if i < len(runs) and runs[i][0] == start + n:  # merge with the next run
            n += runs.pop(i)[1]
        if i > 0 and runs[i - 1][0] + runs[i - 1][1] == start:  # and with the previous one
            start, n = runs[i - 1][0], runs[i - 1][1] + n
            runs.pop(i - 1)
            i -= 1
        runs.insert(i, (start, n))

    @property
    def num_free(self) -> int:
        return sum(length for _, length in self._free)


def projection_ranks(adapter: LoraAdapter) -> dict[str, int]:
    """The rows `adapter` needs in each fused projection's pool (0: untargeted)."""
    return {
        fused: max((m.rank for layer in adapter.layers for p in parts
                    if (m := layer.get(p)) is not None), default=0)
        for fused, parts in FUSED.items()
    }


def pool_row_bytes(base: BaseShape, dtype: torch.dtype) -> int:
    """Bytes of one rank row in all four fused projections' pools, over every layer: an
    adapter of rank r targeting every projection takes r of them."""
    dims = projection_dims(base)
    per_layer = sum(len(parts) * dims[parts[0]][0] + sum(dims[p][1] for p in parts)
                    for parts in FUSED.values())
    return per_layer * base.num_layers * torch.empty((), dtype=dtype).element_size()


class LoraSlots:
    """The device pools and the slot table; the adapter manager decides which adapter sits in
    which slot, this class where its rows go."""

    keeps_source = False  # whether `load` needs the validated adapter beside the packed one

    def __init__(
        self,
        base: BaseShape,
        num_slots: int,
        pool_rows: int,
        max_rank: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        shard: Shard | None = None,
    ) -> None:
        """`pool_rows` rank rows in each fused projection's pool; adapters up to `max_rank`
        (the width of the kernels' shrink output). Under tensor parallelism `base` is this
        rank's shapes, and `shard(projection, a, b)` cuts a whole adapter's LoRA to this rank's
        (`engine.parallel.partition.Partition.cut_lora`)."""
        self.num_slots, self.pool_rows, self.shard = num_slots, pool_rows, shard
        self.max_rank = min(max_rank, pool_rows)
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self._copying: dict[int, _Copy] = {}
        dims = projection_dims(base)

        def zeros(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.layers: list[dict[str, ProjectionPool]] = [
            {
                fused: ProjectionPool(
                    a=zeros(pool_rows, len(parts), dims[parts[0]][0]),
                    b=zeros(pool_rows, sum(dims[p][1] for p in parts)),
                    sizes=tuple(dims[p][1] for p in parts),
                )
                for fused, parts in FUSED.items()
            }
            for _ in range(base.num_layers)
        ]
        self.starts = zeros(len(FUSED), num_slots, dtype=torch.int32)
        self.ranks = zeros(len(FUSED), num_slots, dtype=torch.int32)
        self.scales = zeros(num_slots, dtype=torch.float32)
        self.tables = {fused: SlotTable(self.starts[f], self.ranks[f], self.scales, self.max_rank)
                       for fused, f in FUSED_INDEX.items()}
        self._rows = {fused: RowAllocator(pool_rows) for fused in FUSED}
        self._placed: dict[int, dict[str, tuple[int, int]]] = {}  # slot -> fused -> rows

    def fits(self, adapter: LoraAdapter | PackedAdapter) -> bool:
        """Whether `adapter` can be loaded now without evicting anything."""
        ranks = adapter.ranks if isinstance(adapter, PackedAdapter) else projection_ranks(adapter)
        return all(self._rows[f].fits(r) for f, r in ranks.items() if r)

    def load(self, slot: int, adapter: LoraAdapter | PackedAdapter) -> None:
        """Place an adapter (validated, or as `pack` laid it out) in free rows and copy it into
        `slot` (empty, or whatever it held is cleared first). On a GPU the copy is
        asynchronous: the slot serves once `ready(slot)`. Raises ValueError when its rows do
        not fit now."""
        packed = adapter if isinstance(adapter, PackedAdapter) else self.pack(adapter)
        rank = max(packed.ranks.values(), default=0)
        if rank > self.max_rank:
            raise ValueError(f"adapter rank {rank} exceeds the max LoRA rank {self.max_rank}")
        if any(a.shape[0] != len(self.layers) for a in packed.a.values()):
            raise ValueError("adapter was packed for a different base model")
        self.clear(slot)
        placed: dict[str, tuple[int, int]] = {}
        try:
            for fused, rank in packed.ranks.items():
                start = self._rows[fused].allocate(rank)
                if start is None:
                    raise ValueError(f"no {rank} free rows in the {fused} adapter pool")
                placed[fused] = (start, rank)
            if self.copy_stream is None:
                self._write(slot, packed, placed)
            else:
                # Behind the steps queued so far: they may still read rows just freed.
                self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.copy_stream):
                    self._copy(packed, placed)
                    done = torch.cuda.Event()
                    done.record()
                self._copying[slot] = _Copy(done, placed, packed.scale)
        except BaseException:
            for fused, (start, rank) in placed.items():
                self._rows[fused].free(start, rank)
            self._set(slot, {}, 0.0)
            raise
        self._placed[slot] = placed

    def ready(self, slot: int) -> bool:
        """Whether `slot`'s adapter has landed on the device (always, off a GPU)."""
        copy = self._copying.get(slot)
        if copy is None:
            return True
        if not copy.done.query():
            return False
        del self._copying[slot]
        self._set(slot, copy.rows, copy.scale)
        return True

    def wait(self) -> None:
        """Block until every load in flight has landed."""
        for slot in list(self._copying):
            self._copying[slot].done.synchronize()
            self.ready(slot)

    def write(self, slot: int, adapter: LoraAdapter, starts: dict[str, int]) -> None:
        """Copy `adapter` into `slot` at the first rows `starts[fused]` of each fused projection
        it targets, in order with this device's steps (a tensor-parallel worker is told the
        rows rank 0's `load` placed it at)."""
        packed = self.pack(adapter)
        self._write(slot, packed, {f: (start, packed.ranks[f]) for f, start in starts.items()})

    def _write(self, slot: int, packed: PackedAdapter, rows: dict[str, tuple[int, int]]) -> None:
        self._copy(packed, rows)
        self._set(slot, rows, packed.scale)

    def pack(self, adapter: LoraAdapter) -> PackedAdapter:
        """`adapter` in the pools' layout and dtype (this rank's shard of it under tensor
        parallelism), in pinned memory on a GPU: the host half of `load`, for any thread.
        Raises ValueError for an adapter of another base model's depth."""
        if len(adapter.layers) != len(self.layers):
            raise ValueError("adapter was validated against a different base model")
        layer0, pin = self.layers[0], self.copy_stream is not None
        a: dict[str, torch.Tensor] = {}
        b: dict[str, torch.Tensor] = {}
        for fused, rank in projection_ranks(adapter).items():
            if rank:
                pa, pb = layer0[fused].a, layer0[fused].b
                a[fused] = torch.zeros(len(self.layers), rank, *pa.shape[1:], dtype=pa.dtype,
                                       pin_memory=pin)
                b[fused] = torch.zeros(len(self.layers), rank, pb.shape[1], dtype=pb.dtype,
                                       pin_memory=pin)
        for i, modules in enumerate(adapter.layers):
            for fused in a:
                col = 0
                for j, (part, width) in enumerate(zip(FUSED[fused], layer0[fused].sizes,
                                                      strict=True)):
                    m = modules.get(part)
                    if m is not None:
                        ma, mb = (m.a, m.b) if self.shard is None else self.shard(part, m.a, m.b)
                        a[fused][i, : m.rank, j].copy_(ma)
                        b[fused][i, : m.rank, col : col + width].copy_(
                            (mb * (m.scale / adapter.scale)).T)
                    col += width
        return PackedAdapter(adapter.name, a, b, adapter.scale,
                             adapter if self.keeps_source else None)

    def _copy(self, packed: PackedAdapter, rows: dict[str, tuple[int, int]]) -> None:
        """Packed weights into their pool rows, every layer (asynchronous from pinned memory)."""
        for layer, pools in enumerate(self.layers):
            for fused, (start, rank) in rows.items():
                pool = pools[fused]
                pool.a[start : start + rank].copy_(packed.a[fused][layer], non_blocking=True)
                pool.b[start : start + rank].copy_(packed.b[fused][layer], non_blocking=True)

    def clear(self, slot: int) -> None:
        """Empty `slot`: its rows go back to the pools (a load in flight into them is ordered
        before any later one, on the same copy stream)."""
        self._copying.pop(slot, None)
        for fused, (start, rank) in self._placed.pop(slot, {}).items():
            self._rows[fused].free(start, rank)
        self._set(slot, {}, 0.0)

    def placement(self, slot: int) -> dict[str, int]:
        """The first row of `slot`'s adapter in each fused projection it targets."""
        return {f: start for f, (start, _) in self._placed.get(slot, {}).items()}

    def _set(self, slot: int, rows: dict[str, tuple[int, int]], scale: float) -> None:
        # fill_, not `t[i] = x`: on a GPU, assigning a Python number waits for the steps queued.
        for fused, f in FUSED_INDEX.items():
            start, rank = rows.get(fused, (0, 0))
            self.starts[f, slot].fill_(start)
            self.ranks[f, slot].fill_(rank)
        self.scales[slot].fill_(scale)

    def apply(
        self, y: torch.Tensor, x: torch.Tensor, layer: int, fused: str, info: LoraBatchInfo
    ) -> None:
        """y += LoRA(x) for projection `fused` ("qkv_proj", "o_proj", "gate_up_proj",
        "down_proj") of `layer`, each token with its own slot's adapter.

        Args:
            y: [T, out_features] the base projection's output, updated in place.
            x: [T, in_features] the projection's input.
        """
        if not info.has_lora:
            return
        pool = self.layers[layer][fused]
        lora_shrink_expand(y, x, pool.a, pool.b, pool.sizes, self.tables[fused], info)

    def shrink(self, x: torch.Tensor, layer: int, fused: str, info: LoraBatchInfo):
        """`apply` in two halves (`expand(y, shrink(x))`), for a CUDA graph to run the shrink
        on a side stream; needs `info.has_lora`."""
        return projection_shrink(x, self.layers[layer][fused].a, self.tables[fused], info)

    def expand(self, y: torch.Tensor, t, layer: int, fused: str, info: LoraBatchInfo) -> None:
        pool = self.layers[layer][fused]
        projection_expand(y, t, pool.b, pool.sizes, self.tables[fused], info)

    def delta(self, x: torch.Tensor, layer: int, fused: str, info: LoraBatchInfo
              ) -> torch.Tensor:
        """What `apply` adds to the base output, alone and unrounded: fp32 [T, out_features],
        zero on rows without an adapter (`kernels.fused.with_delta(y, delta)` is then `apply`'s
        y, bit for bit); needs `info.has_lora`."""
        d = x.new_zeros(x.shape[0], self.layers[layer][fused].b.shape[1], dtype=torch.float32)
        self.expand(d, self.shrink(x, layer, fused, info), layer, fused, info)
        return d
