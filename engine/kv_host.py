"""The host tier's KV pool: host memory under the radix tree (engine/prefix_cache.py).

Layout. Page-major, `(num_pages, num_layers, 2, page_size, kv_heads, head_dim)`: a host page
holds one device page's K and V of every layer in one block, so moving pages is one copy per
run of consecutive host pages, whatever the layer count. On the device a page is `page_size`
rows of each layer's K and V (engine/model_runner.py); copies gather or scatter those through
a device staging buffer of at most `CHUNK_PAGES` pages.

Ordering on CUDA (the pool is pinned; no copy makes the host wait):
- `offload` runs on the compute stream: behind the forwards queued before it, ahead of any
  queued after it that reuses its device pages.
- `load` runs on its own copy stream, overlapped with the forwards queued after it. It starts
  once the compute stream's queued work is done (an offload there may still be writing the
  host pages it reads, or reading the device pages it writes) and records an event: the
  request it loads for waits for that event (`done`), not the batch.
- `fence` makes the next forward, or offload, wait for every load queued so far. That wait
  is free for the loads whose requests were waiting for them anyway; it matters only when a
  load's device pages change hands before it is done (its request was aborted).
On a CPU the pool is a second tensor in memory and every copy is done when it returns.
"""

from __future__ import annotations

import time

import torch

from engine.prefix_cache import CopyStats
from kernels.upload import upload

CHUNK_PAGES = 64  # staging pages per copy (Llama-3-8B bf16: 2 MiB a page)


class HostKVPool:
    """`num_pages` host pages for the KV of `kv_caches` (per layer (K, V), each
    `((num_device_pages + 1) * page_size, kv_heads, head_dim)`); implements `HostKV`."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_pages: int,
                 page_size: int):
        k0 = kv_caches[0][0]
        self.device = k0.device
        self.num_pages = num_pages
        self.page_size = page_size
        # (num_device_pages + 1, page_size, kv_heads, head_dim) views of every layer's K and V
        self.kv = [(k.view(-1, page_size, *k.shape[1:]), v.view(-1, page_size, *v.shape[1:]))
                   for k, v in kv_caches]
        self.page_shape = (len(kv_caches), 2, page_size, *k0.shape[1:])
        cuda = self.device.type == "cuda"
        # (num_pages, num_layers, 2, page_size, kv_heads, head_dim)
        self.pool = torch.empty((num_pages, *self.page_shape), dtype=k0.dtype, pin_memory=cuda)
        self.page_bytes = self.pool[0].numel() * self.pool.element_size()
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self._unfenced: list[torch.cuda.Event] = []  # loads no forward has waited for yet
        # (to_host, bytes, start, end) events of CUDA copies not yet added to the totals
        self._timing: list[tuple[bool, int, torch.cuda.Event, torch.cuda.Event]] = []
        self._bytes = {True: 0, False: 0}  # to_host -> bytes copied
        self._seconds = {True: 0.0, False: 0.0}

    @torch.inference_mode()
    def offload(self, device_pages: list[int], host_pages: list[int]) -> None:
        """Copy device pages to host pages (queued behind the device's work)."""
        self.fence()
        with self._timed(to_host=True, num_pages=len(device_pages)):
            for i in range(0, len(device_pages), CHUNK_PAGES):
                dev, host = device_pages[i : i + CHUNK_PAGES], host_pages[i : i + CHUNK_PAGES]
                (idx,) = upload([dev], torch.long, self.device)
                staging = torch.empty((len(dev), *self.page_shape), dtype=self.pool.dtype,
                                      device=self.device)  # (n, layers, 2, page_size, H, D)
                for layer, (k, v) in enumerate(self.kv):
                    staging[:, layer, 0] = k[idx]
                    staging[:, layer, 1] = v[idx]
                for h, s, m in _runs(host):
                    self.pool[h : h + m].copy_(staging[s : s + m], non_blocking=True)

    @torch.inference_mode()
    def load(self, host_pages: list[int], device_pages: list[int]) -> torch.cuda.Event | None:
        """Start copying host pages into device pages; returns what `done` takes."""
        if self.copy_stream is None:
            self._load(host_pages, device_pages)
            return None
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            self._load(host_pages, device_pages)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        self._unfenced.append(event)
        return event

    def _load(self, host_pages: list[int], device_pages: list[int]) -> None:
        with self._timed(to_host=False, num_pages=len(device_pages)):
            for i in range(0, len(device_pages), CHUNK_PAGES):
                dev, host = device_pages[i : i + CHUNK_PAGES], host_pages[i : i + CHUNK_PAGES]
                staging = torch.empty((len(dev), *self.page_shape), dtype=self.pool.dtype,
                                      device=self.device)
                for h, s, m in _runs(host):
                    staging[s : s + m].copy_(self.pool[h : h + m], non_blocking=True)
                (idx,) = upload([dev], torch.long, self.device)
                for layer, (k, v) in enumerate(self.kv):
                    k.index_copy_(0, idx, staging[:, layer, 0])
                    v.index_copy_(0, idx, staging[:, layer, 1])

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
        """Bytes copied each way and the seconds the copies took (on CUDA: device time of the
        copies done by now)."""
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


class _Timer:
    """Times one copy: CUDA events on the current stream, or the wall clock on a CPU."""

    def __init__(self, pool: HostKVPool, to_host: bool, nbytes: int):
        self.pool, self.to_host, self.nbytes = pool, to_host, nbytes
        self.cuda = pool.device.type == "cuda"

    def __enter__(self) -> None:
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        pool = self.pool
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            pool._timing.append((self.to_host, self.nbytes, self.start, end))
        else:
            pool._bytes[self.to_host] += self.nbytes
            pool._seconds[self.to_host] += time.perf_counter() - self.t0


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
