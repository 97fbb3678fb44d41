"""The host tier's KV pool: host memory under the radix tree (engine/kv/prefix_cache.py).

Layout. `(num_layers, 2, num_pages, page_size, kv_heads, head_dim)`, the device pool's
(`ModelRunner.kv_pool`, `(num_layers, 2, rows, kv_heads, head_dim)`): a run of pages that are
consecutive both here and on the device is one block per layer and K/V on both sides, so a
load copies it straight into the device pool, layer by layer, and the forward that reads it
waits for each layer's copy just before that layer (`fenced`), not for the whole load. Pages
that are not (a fragmented load) go through a staging buffer and a scatter kernel.

Streams on CUDA (the pool is pinned; no copy makes the host wait). Every host<->device transfer
runs on one copy stream, in the order queued, each run of pages as one strided copy over the
layers it spans (`kernels.copy2d.copy_rows`: all layers' K and V for an offload, a layer's K
and V for a load), not a copy per layer. Two staging buffers each way let one chunk's
transfer overlap the neighbouring chunk's gather or scatter kernel.
- `offload` gathers each chunk of pages (all layers, one kernel) on the compute stream (behind
  the forwards queued before it, ahead of any queued after it that reuses its device pages);
  the copy stream sends it to the host. The compute stream waits only for a staging buffer.
- `load` starts once the compute stream's queued work is done (it may still read the device
  pages the load writes): layer by layer, the copy stream brings the runs up (a fragmented
  load: through staging chunks a scatter stream writes into the pool), recording an event
  per layer. Few host operations per layer matter here: queuing the load must not take
  longer than the transfer. Its request either waits for the last event (`done`) while the
  batch runs on, or, on an idle engine, starts at once (`overlap`): the load then also records
  `layer_ready`, which every forward waits for before each layer (the CUDA graphs too: they
  were captured waiting on these external events), so the copy overlaps the forward. A load
  whose request ended first, or started before its copy was done, is `use`d: the next
  forward runs eagerly and waits for its layers (`layers`).
On a CPU the pool is a second tensor in memory and every copy is done when it returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from engine.kv.tiers import CopyStats
from kernels.copy2d import copy_rows
from kernels.upload import upload

CHUNK_PAGES = 64  # pages per offload staging buffer (loads: 8x, one layer at a time)

KV = tuple[torch.Tensor, torch.Tensor]


@dataclass
class LoadHandle:
    events: list[torch.cuda.Event]  # one per layer: that layer's pages are on the device
    overlapped: bool = False  # also recorded into the pool's `layer_ready` events


class HostKVPool:
    """`num_pages` host pages for the KV of `kv_pool`, the device pool of every layer's K and
    V, `(num_layers, 2, (num_device_pages + 1) * page_size, kv_heads, head_dim)`; implements
    `HostKV`."""

    def __init__(self, kv_pool: torch.Tensor, num_pages: int, page_size: int,
                 chunk_pages: int = CHUNK_PAGES):
        layers, _, rows, heads, dim = kv_pool.shape
        if kv_pool.dtype == torch.float8_e4m3fn:  # moved as its bytes: torch has no
            kv_pool = kv_pool.view(torch.uint8)   # index_copy for float8 types
        self.device = kv_pool.device
        self.num_pages = num_pages
        self.page_size = page_size
        self.chunk = chunk_pages
        # (num_layers, 2, num_device_pages + 1, page_size, kv_heads, head_dim)
        self.kv = kv_pool.view(layers, 2, rows // page_size, page_size, heads, dim)
        self.cuda = self.device.type == "cuda"
        # (num_layers, 2, num_pages, page_size, kv_heads, head_dim)
        self.pool = torch.empty((layers, 2, num_pages, page_size, heads, dim),
                                dtype=kv_pool.dtype, pin_memory=self.cuda)
        self.page_bytes = self.pool[:, :, 0].numel() * self.pool.element_size()
        self._due: list[LoadHandle] = []  # loads the next forward must wait for, per layer
        self._overlapped = False  # an overlapped load no eager forward has waited for yet
        # (to_host, bytes, start, end, the end of the copy queued before) of CUDA copies not
        # yet added to the totals
        self._timing: list[tuple[bool, int, torch.cuda.Event, torch.cuda.Event,
                                 torch.cuda.Event | None]] = []
        self._last_end: torch.cuda.Event | None = None
        self._bytes = {True: 0, False: 0}  # to_host -> bytes copied
        self._seconds = {True: 0.0, False: 0.0}
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(self.device)
            self.scatter_stream = torch.cuda.Stream(self.device)
            # Every forward waits, before layer i, for the latest record of `layer_ready[i]`:
            # the end of layer i's copy of the overlapped loads (recorded in their order on the
            # scatter stream, so the latest covers the earlier ones). External events: captured
            # into the CUDA graphs as wait nodes, so an overlapped load keeps them.
            self.layer_ready = [torch.cuda.Event(external=True) for _ in range(layers)]
            for event in self.layer_ready:
                event.record()  # done from the start (a never-recorded event is not waited)
            # (num_layers, 2, chunk, page_size, H, D) and (2, 8 * chunk, page_size, H, D)
            shape = self.pool.shape
            self._out = [_Buffer((layers, 2, chunk_pages, *shape[3:]), self.pool.dtype,
                                 self.device) for _ in range(2)]
            self._in = [_Buffer((2, 8 * chunk_pages, *shape[3:]), self.pool.dtype,
                                self.device) for _ in range(2)]

    @torch.inference_mode()
    def offload(self, device_pages: list[int], host_pages: list[int]) -> None:
        """Copy device pages to host pages (queued behind the device's work)."""
        if not self.cuda:
            with self._timed(True, len(device_pages)):
                self.pool.index_copy_(2, torch.tensor(host_pages),
                                      self.kv.index_select(2, torch.tensor(device_pages)))
            return
        compute = torch.cuda.current_stream(self.device)
        (idx,) = upload([device_pages], torch.long, self.device)
        start = _record(compute, timing=True)
        for i, (at, dev, host) in enumerate(_chunks(device_pages, host_pages, self.chunk)):
            buf = self._out[i % 2]
            compute.wait_event(buf.free)
            staging = buf.data[:, :, : len(dev)]  # (L, 2, n, page_size, H, D)
            staging.copy_(self.kv.index_select(2, idx[at : at + len(dev)]))
            self.copy_stream.wait_event(_record(compute))
            for h, s, m in _runs(host):  # every layer's K and V: one strided copy
                copy_rows(self.pool[:, :, h : h + m].flatten(0, 1),
                          staging[:, :, s : s + m].flatten(0, 1), self.copy_stream)
            buf.free.record(self.copy_stream)
        self._time(True, len(device_pages), start, _record(self.copy_stream, timing=True))

    @torch.inference_mode()
    def load(self, host_pages: list[int], device_pages: list[int],
             overlap: bool = False) -> LoadHandle | None:
        """Start copying host pages into device pages, layer by layer; returns what `done`
        and `use` take. With `overlap`, every forward from now on waits for each layer's copy
        before that layer (`layer_ready`), so its request may start at once."""
        if not self.cuda:
            with self._timed(False, len(device_pages)):
                self.kv.index_copy_(2, torch.tensor(device_pages),
                                    self.pool.index_select(2, torch.tensor(host_pages)))
            return None
        compute = torch.cuda.current_stream(self.device)
        self.copy_stream.wait_stream(compute)
        start = _record(self.copy_stream, timing=True)
        runs = _paired_runs(host_pages, device_pages)
        if len(runs) > 4:  # fragmented: through staging and a scatter kernel
            events = self._load_scattered(host_pages, device_pages, compute)
        else:
            events = []
            for layer in range(self.pool.shape[0]):
                for h, d, m in runs:  # K and V: one strided copy
                    copy_rows(self.kv[layer, :, d : d + m], self.pool[layer, :, h : h + m],
                              self.copy_stream)
                events.append(_record(self.copy_stream, timing=layer == len(self.kv) - 1))
        self._time(False, len(device_pages), start, events[-1])
        if overlap:
            for ready, event in zip(self.layer_ready, events, strict=True):
                self.scatter_stream.wait_event(event)
                ready.record(self.scatter_stream)
            self._overlapped = True
        return LoadHandle(events, overlap)

    def _load_scattered(self, host_pages: list[int], device_pages: list[int],
                        compute: torch.cuda.Stream) -> list[torch.cuda.Event]:
        self.scatter_stream.wait_stream(compute)
        with torch.cuda.stream(self.scatter_stream):  # up front: the copy engine is busy next
            (idx,) = upload([device_pages], torch.long, self.device)
        events, i = [], 0
        for layer in range(self.pool.shape[0]):
            for at, dev, host in _chunks(device_pages, host_pages, 8 * self.chunk):
                buf = self._in[i % 2]
                i += 1
                staging = buf.data[:, : len(dev)]  # (2, n, page_size, H, D)
                self.copy_stream.wait_event(buf.free)
                for h, s, m in _runs(host):  # K and V: one strided copy
                    copy_rows(staging[:, s : s + m], self.pool[layer, :, h : h + m],
                              self.copy_stream)
                self.scatter_stream.wait_event(_record(self.copy_stream))
                with torch.cuda.stream(self.scatter_stream):
                    self.kv[layer].index_copy_(1, idx[at : at + len(dev)], staging)
                    buf.free.record(self.scatter_stream)
            events.append(_record(self.scatter_stream, timing=layer == len(self.kv) - 1))
        return events

    @torch.inference_mode()
    def snapshot(self, device_pages: list[int]) -> tuple[torch.Tensor, Callable[[], None]]:
        """A private host copy of device pages, `(n, num_layers, 2, page_size, H, D)`, and a
        function that returns once the copy is complete (to call off the engine thread)."""
        if not self.cuda:
            return self.kv.index_select(2, torch.tensor(device_pages)).permute(
                2, 0, 1, 3, 4, 5).contiguous(), lambda: None
        (idx,) = upload([device_pages], torch.long, self.device)
        staged = self.kv.index_select(2, idx).permute(2, 0, 1, 3, 4, 5).contiguous()
        host = torch.empty(staged.shape, dtype=staged.dtype, pin_memory=True)
        self.copy_stream.wait_event(_record(torch.cuda.current_stream(self.device)))
        with torch.cuda.stream(self.copy_stream):
            host.copy_(staged, non_blocking=True)
            done = _record(self.copy_stream)
        staged.record_stream(self.copy_stream)
        return host, done.synchronize

    def host_writes_done(self) -> Callable[[], None]:
        """A function that returns once the copies queued so far are done: before the host
        side writes host pages a queued copy may still touch (a disk read into reused ones)."""
        if not self.cuda:
            return lambda: None
        return _record(self.copy_stream).synchronize

    def store(self, host_page: int, page: torch.Tensor) -> None:
        """Write one page `(num_layers, 2, page_size, H, D)` into host page `host_page` (from
        the host: a disk read)."""
        self.pool[:, :, host_page].copy_(page)

    @staticmethod
    def done(handle: LoadHandle | None) -> bool:
        return handle is None or handle.events[-1].query()

    def use(self, handle: LoadHandle | None) -> None:
        """The next forward reads, or reuses, the device pages `handle`'s load writes: unless
        the load was overlapped (every forward waits for those), the next forward runs
        eagerly and waits for each layer's copy before that layer (`layers`)."""
        if not self.done(handle):
            assert handle is not None
            if not handle.overlapped:
                self._due.append(handle)

    def graph_ok(self) -> bool:
        """May the next forward replay a CUDA graph? Not while a load it must wait for was
        not overlapped (its events are not the ones the graphs wait on)."""
        return not self._due

    def layers(self, kv_caches: Sequence[KV]) -> Sequence[KV]:
        """The per-layer KV an eager forward iterates: iterating it queues, before layer i, the
        waits for layer i's copies of the loads `use`d and the loads overlapped since the last
        eager forward (after it, the compute stream's order covers them). As given when there
        are none."""
        waits = [h.events for h in self._due] + ([self.layer_ready] if self._overlapped else [])
        self._due, self._overlapped = [], False
        return _FencedLayers(kv_caches, waits) if waits else kv_caches

    def graph_layers(self, kv_caches: Sequence[KV]) -> Sequence[KV]:
        """The per-layer KV the CUDA graphs are captured with: waits on `layer_ready` before
        each layer, always (replayed, a wait on an event recorded long ago costs nothing)."""
        return _FencedLayers(kv_caches, [self.layer_ready]) if self.cuda else kv_caches

    def _time(self, to_host: bool, num_pages: int, start: torch.cuda.Event,
              end: torch.cuda.Event) -> None:
        self._timing.append((to_host, num_pages * self.page_bytes, start, end, self._last_end))
        self._last_end = _record(self.copy_stream, timing=True)  # its transfers' end

    def copy_stats(self) -> CopyStats:
        """Bytes copied each way and the seconds the copies took (on CUDA: from the copy's
        first queued work starting, or the copy before it on the copy stream finishing if
        that is later, to its last finishing; for the copies done by now)."""
        pending = []
        for to_host, nbytes, start, end, before in self._timing:
            if end.query():
                busy = start.elapsed_time(end)  # ms; less the time spent queued behind `before`
                if before is not None:
                    busy -= max(0.0, start.elapsed_time(before))
                self._bytes[to_host] += nbytes
                self._seconds[to_host] += busy / 1000
            else:
                pending.append((to_host, nbytes, start, end, before))
        self._timing = pending
        return CopyStats(self._bytes[True], self._seconds[True], self._bytes[False],
                         self._seconds[False])

    def _timed(self, to_host: bool, num_pages: int) -> _Timer:
        return _Timer(self, to_host, num_pages * self.page_bytes)


class _FencedLayers(Sequence[KV]):
    """Per-layer KV whose iteration makes the current stream (a capturing one too) wait for
    `waits[j][i]`, for every j, before layer i."""

    def __init__(self, kv_caches: Sequence[KV], waits: list[list[torch.cuda.Event]]):
        self.kv_caches, self.waits = kv_caches, waits

    def __len__(self) -> int:
        return len(self.kv_caches)

    def __getitem__(self, i):  # type: ignore[override]
        return self.kv_caches[i]

    def __iter__(self) -> Iterator[KV]:
        stream = torch.cuda.current_stream()
        for i, kv in enumerate(self.kv_caches):
            for events in self.waits:
                stream.wait_event(events[i])
            yield kv


class _Buffer:
    """A staging buffer on the device and the event after which it may be written again."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.data = torch.empty(shape, dtype=dtype, device=device)
        self.free = torch.cuda.Event()
        self.free.record()  # free from the start


def _record(stream: torch.cuda.Stream, timing: bool = False) -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=timing)
    event.record(stream)
    return event


def _chunks(device_pages: list[int], host_pages: list[int],
            n: int) -> Iterator[tuple[int, list[int], list[int]]]:
    for i in range(0, len(device_pages), n):
        yield i, device_pages[i : i + n], host_pages[i : i + n]


class _Timer:
    """Times one copy on a CPU (CUDA copies are timed with events)."""

    def __init__(self, pool: HostKVPool, to_host: bool, nbytes: int):
        self.pool, self.to_host, self.nbytes = pool, to_host, nbytes

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.pool._bytes[self.to_host] += self.nbytes
        self.pool._seconds[self.to_host] += time.perf_counter() - self.t0


def _paired_runs(host: list[int], device: list[int]) -> list[tuple[int, int, int]]:
    """(first host page, first device page, length) of each run consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for h, d in zip(host, device, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == h and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((h, d, 1))
    return runs


def _runs(pages: list[int]) -> list[tuple[int, int, int]]:
    """(first page, index in `pages`, length) of each run of consecutive page ids."""
    runs: list[tuple[int, int, int]] = []
    for i, p in enumerate(pages):
        if runs and runs[-1][0] + runs[-1][2] == p:
            h, s, m = runs[-1]
            runs[-1] = (h, s, m + 1)
        else:
            runs.append((p, i, 1))
    return runs
