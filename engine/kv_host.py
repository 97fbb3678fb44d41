"""The host tier's KV pool: host memory under the radix tree (engine/prefix_cache.py).

Layout. Page-major, `(num_pages, num_layers, 2, page_size, kv_heads, head_dim)`: a host page
holds one device page's K and V of every layer in one block, so moving pages is one copy per
run of consecutive host pages, whatever the layer count. On the device a page is `page_size`
rows of each layer's K and V (engine/model_runner.py); copies gather or scatter those through
staging buffers of `CHUNK_PAGES` pages.

Streams on CUDA (the pool is pinned; no copy makes the host wait). Every host<->device
transfer runs on one copy stream, so transfers touching the same host pages run in the order
they were queued. Two staging buffers each way let chunk i+1's transfer overlap chunk i's
gather or scatter kernels.
- `offload` gathers each chunk on the compute stream (behind the forwards queued before it,
  ahead of any queued after it that reuses its device pages), and the copy stream sends it
  to the host; the compute stream waits only for a staging buffer to come free.
- `load` starts once the compute stream's queued work is done (it may still be reading the
  device pages the load writes): the copy stream brings each chunk up, a scatter stream
  writes it into the KV pool, and an event says when all is done. The request it loads for
  waits for that event (`done`), not the batch.
- `fence` makes the next forward wait for every load queued so far: free for the loads whose
  requests waited for them anyway; it matters only when a load's device pages change hands
  before it is done (its request was aborted). An offload never reads such pages: a loaded
  node keeps its host copy, so evicting it copies nothing.
On a CPU the pool is a second tensor in memory and every copy is done when it returns.
"""

from __future__ import annotations

import time

import torch

from engine.prefix_cache import CopyStats
from kernels.upload import upload

CHUNK_PAGES = 32  # pages per staging buffer (Llama-3-8B bf16: 2 MiB a page)


class HostKVPool:
    """`num_pages` host pages for the KV of `kv_pool`, the device pool of every layer's K and
    V, `(num_layers, 2, (num_device_pages + 1) * page_size, kv_heads, head_dim)`; implements
    `HostKV`."""

    def __init__(self, kv_pool: torch.Tensor, num_pages: int, page_size: int,
                 chunk_pages: int = CHUNK_PAGES):
        layers, _, rows, heads, dim = kv_pool.shape
        self.device = kv_pool.device
        self.num_pages = num_pages
        self.page_size = page_size
        self.chunk = chunk_pages
        # (num_layers, 2, num_device_pages + 1, page_size, kv_heads, head_dim)
        self.kv = kv_pool.view(layers, 2, rows // page_size, page_size, heads, dim)
        self.page_shape = (layers, 2, page_size, heads, dim)
        self.cuda = self.device.type == "cuda"
        # (num_pages, num_layers, 2, page_size, kv_heads, head_dim)
        self.pool = torch.empty((num_pages, *self.page_shape), dtype=kv_pool.dtype,
                                pin_memory=self.cuda)
        self.page_bytes = self.pool[0].numel() * self.pool.element_size()
        self._unfenced: list[torch.cuda.Event] = []  # loads no forward has waited for yet
        # (to_host, bytes, start, end) events of CUDA copies not yet added to the totals
        self._timing: list[tuple[bool, int, torch.cuda.Event, torch.cuda.Event]] = []
        self._bytes = {True: 0, False: 0}  # to_host -> bytes copied
        self._seconds = {True: 0.0, False: 0.0}
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(self.device)
            self.scatter_stream = torch.cuda.Stream(self.device)
            self._staging = {to_host: [_Buffer(self, chunk_pages) for _ in range(2)]
                             for to_host in (True, False)}

    @torch.inference_mode()
    def offload(self, device_pages: list[int], host_pages: list[int]) -> None:
        """Copy device pages to host pages (queued behind the device's work)."""
        if not self.cuda:
            with self._timed(True, len(device_pages)):
                for dev, host in _chunks(device_pages, host_pages, self.chunk):
                    staging = torch.empty((len(dev), *self.page_shape), dtype=self.pool.dtype)
                    self._gather(torch.tensor(dev), staging)
                    self._to_host(staging, host)
            return
        compute = torch.cuda.current_stream(self.device)
        start = _record(compute)
        (idx,) = upload([device_pages], torch.long, self.device)
        for i, (dev, host) in enumerate(_chunks(device_pages, host_pages, self.chunk)):
            buf = self._staging[True][i % 2]
            compute.wait_event(buf.free)
            self._gather(idx[i * self.chunk : i * self.chunk + len(dev)], buf.data[: len(dev)])
            self.copy_stream.wait_event(_record(compute))
            with torch.cuda.stream(self.copy_stream):
                self._to_host(buf.data[: len(dev)], host)
                buf.free.record(self.copy_stream)
        self._timing.append((True, len(device_pages) * self.page_bytes, start,
                             _record(self.copy_stream)))

    @torch.inference_mode()
    def load(self, host_pages: list[int], device_pages: list[int]) -> torch.cuda.Event | None:
        """Start copying host pages into device pages; returns what `done` takes."""
        if not self.cuda:
            with self._timed(False, len(device_pages)):
                for dev, host in _chunks(device_pages, host_pages, self.chunk):
                    staging = torch.empty((len(dev), *self.page_shape), dtype=self.pool.dtype)
                    self._from_host(host, staging)
                    self._scatter(staging, torch.tensor(dev))
            return None
        compute = torch.cuda.current_stream(self.device)
        self.scatter_stream.wait_stream(compute)
        with torch.cuda.stream(self.scatter_stream):  # up front: the copy engine is busy next
            (idx,) = upload([device_pages], torch.long, self.device)
        start = _record(self.copy_stream)
        for i, (dev, host) in enumerate(_chunks(device_pages, host_pages, self.chunk)):
            buf = self._staging[False][i % 2]
            self.copy_stream.wait_event(buf.free)
            with torch.cuda.stream(self.copy_stream):
                self._from_host(host, buf.data[: len(dev)])
            self.scatter_stream.wait_event(_record(self.copy_stream))
            with torch.cuda.stream(self.scatter_stream):
                self._scatter(buf.data[: len(dev)],
                              idx[i * self.chunk : i * self.chunk + len(dev)])
                buf.free.record(self.scatter_stream)
        done = _record(self.scatter_stream, timing=True)
        self._timing.append((False, len(device_pages) * self.page_bytes, start, done))
        self._unfenced.append(done)
        return done

    def _gather(self, idx: torch.Tensor, out: torch.Tensor) -> None:
        """`out[i]` (layers, 2, page_size, H, D) <- device page `idx[i]`: two kernels, whatever
        the layer count."""
        out.copy_(self.kv.index_select(2, idx).permute(2, 0, 1, 3, 4, 5))

    def _scatter(self, src: torch.Tensor, idx: torch.Tensor) -> None:
        """Device page `idx[i]` <- `src[i]` (layers, 2, page_size, H, D): one kernel."""
        self.kv.index_copy_(2, idx, src.permute(1, 2, 0, 3, 4, 5))

    def _to_host(self, staging: torch.Tensor, host_pages: list[int]) -> None:
        for h, s, m in _runs(host_pages):
            self.pool[h : h + m].copy_(staging[s : s + m], non_blocking=True)

    def _from_host(self, host_pages: list[int], staging: torch.Tensor) -> None:
        for h, s, m in _runs(host_pages):
            staging[s : s + m].copy_(self.pool[h : h + m], non_blocking=True)

    @staticmethod
    def done(handle: torch.cuda.Event | None) -> bool:
        return handle is None or handle.query()

    def fence(self) -> None:
        """Make the work queued next on the compute stream wait for every load queued so far."""
        if self._unfenced:
            stream = torch.cuda.current_stream(self.device)
            for event in self._unfenced:
                stream.wait_event(event)
            self._unfenced.clear()

    def copy_stats(self) -> CopyStats:
        """Bytes copied each way and the seconds the copies took (on CUDA: from the copy's
        first queued work starting to its last finishing, for the copies done by now)."""
        pending = []
        for to_host, nbytes, start, end in self._timing:
            if end.query():
                self._bytes[to_host] += nbytes
                self._seconds[to_host] += start.elapsed_time(end) / 1000
            else:
                pending.append((to_host, nbytes, start, end))
        self._timing = pending
        return CopyStats(self._bytes[True], self._seconds[True], self._bytes[False],
                         self._seconds[False])

    def _timed(self, to_host: bool, num_pages: int) -> _Timer:
        return _Timer(self, to_host, num_pages * self.page_bytes)


class _Buffer:
    """A staging buffer on the device and the event after which it may be written again."""

    def __init__(self, pool: HostKVPool, num_pages: int):
        self.data = torch.empty((num_pages, *pool.page_shape), dtype=pool.pool.dtype,
                                device=pool.device)
        self.free = torch.cuda.Event()
        self.free.record()  # free from the start


def _record(stream: torch.cuda.Stream, timing: bool = True) -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=timing)
    event.record(stream)
    return event


def _chunks(device_pages: list[int], host_pages: list[int], n: int):
    for i in range(0, len(device_pages), n):
        yield device_pages[i : i + n], host_pages[i : i + n]


class _Timer:
    """Times one copy on a CPU (CUDA copies are timed with events)."""

    def __init__(self, pool: HostKVPool, to_host: bool, nbytes: int):
        self.pool, self.to_host, self.nbytes = pool, to_host, nbytes

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.pool._bytes[self.to_host] += self.nbytes
        self.pool._seconds[self.to_host] += time.perf_counter() - self.t0


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
