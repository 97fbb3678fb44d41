"""The KV tiers under the prefix cache's device pages: a host-memory pool and, below it, page
files on disk (engine/kv/host.py and engine/kv/disk.py move the bytes; this decides what moves).

Pure Python. `PrefixCache` owns one `KVTiers` when the engine has a host tier, and calls:

- `ready(req)` before admission: a request whose cached prefix is partly on the host has it
  copied back (asynchronously, `HostKV.load`) and waits, holding a lock on it, until the copy
  is done; the others go ahead meanwhile. On an idle engine it starts at once, its forward
  overlapping the copy layer by layer. A session turn whose prefix goes on in page files past
  what the tree holds first reads them into host pages.
- `offload(node)`, `RadixTree.evict`'s hook: evicted device pages move to host pages (their own
  pool and allocator here) instead of being dropped.
- `keep(req)` when a session turn ends: its KV is written through to the host (so evicting it
  later copies nothing) and to disk.
- `attached(req)` / `ended(req)`: a waiting request's load or read is taken over or dropped.
Host pages are evicted LRU in turn when the host pool is full (`RadixTree.host.evict`).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from engine.core.request import Request
from engine.kv.page_allocator import PageAllocator
from sessions.radix_tree import RadixNode, RadixTree

if TYPE_CHECKING:
    from engine.kv.disk import DiskKV

log = logging.getLogger(__name__)


class CopyStats(NamedTuple):
    bytes_to_host: int = 0
    seconds_to_host: float = 0.0
    bytes_to_device: int = 0
    seconds_to_device: float = 0.0


class HostKV(Protocol):
    """Copies KV pages between the device pool and the host tier's pool (engine/kv/host.py).

    Copies are queued in order with the device's work: `offload` reads the device pages as
    they are once the work queued before it is done, so the caller may free and reuse them at
    once; `load` writes device pages that no forward may touch before `done(handle)`, unless
    it was an `overlap` load (every forward waits for those) or `use(handle)` was called first
    (the next forward then waits for the copy)."""

    num_pages: int  # the host pool's size

    def offload(self, device_pages: list[int], host_pages: list[int]) -> None: ...

    def load(self, host_pages: list[int], device_pages: list[int],
             overlap: bool = False) -> Any: ...

    def done(self, handle: Any) -> bool: ...

    def use(self, handle: Any) -> None: ...

    def copy_stats(self) -> CopyStats: ...

    # What the disk tier needs of it (`engine.kv.disk.HostPages`).
    def snapshot(self, device_pages: list[int]) -> tuple[Any, Callable[[], None]]: ...

    def host_writes_done(self) -> Callable[[], None]: ...

    def store(self, host_page: int, page: Any) -> None: ...


class _Read(NamedTuple):
    start: int  # the first page read (the tree held those before it)
    host_pages: list[int]  # where the pages go, ours until the read is done
    future: Future  # -> how many pages were good


class _Load(NamedTuple):
    node: RadixNode  # the loaded path's end, locked until the request attaches it
    num_pages: int
    handle: Any


class KVTiers:
    """The host tier (`host`, its pages allocated here) and the optional disk tier (`disk`)
    under `tree`, whose device pages come from `allocator`; `make_room` frees device pages
    (`PrefixCache.make_room`)."""

    def __init__(self, tree: RadixTree, allocator: PageAllocator, page_size: int,
                 make_room: Callable[[int], bool], host: HostKV, disk: DiskKV | None = None):
        self.tree, self.allocator, self.page_size = tree, allocator, page_size
        self.make_room = make_room
        self.host = host
        self.host_allocator = PageAllocator(host.num_pages)
        self.disk = disk
        self._loading: dict[Request, _Load] = {}  # waiting requests whose prefix is loading
        self._reading: dict[Request, _Read] = {}  # waiting requests whose pages are read
        self._orphans: list[_Read] = []  # reads whose request ended first
        self._disk_checked: weakref.WeakSet[Request] = weakref.WeakSet()
        self.host_hit_tokens = 0
        self.loaded_pages = 0
        self.disk_hit_tokens = 0

    def ready(self, req: Request, overlap: bool = False) -> bool:
        """May `req` be attached now? False while the host-resident part of its cached prefix
        is being copied back to the device (started by the first call: the prefix is locked
        meanwhile), so the batch runs on without it; with `overlap` (nothing else runs, so
        there is no batch to hold up), True at once: its forward then waits for each layer's
        copy before that layer. Never False for want of room: with too few device pages for
        the copy, the request starts from its device prefix and computes the rest."""
        load = self._loading.get(req)
        if load is not None:
            return overlap or self.host.done(load.handle)
        if self.disk is not None and not self._from_disk(req):
            return False
        nodes = self.tree.host.path(req.namespace, req.token_ids)
        if not nodes or not self.make_room(_num_host_pages(nodes)):
            return True
        nodes = self.tree.host.path(req.namespace, req.token_ids)  # make_room may move them
        n = _num_host_pages(nodes)
        if not nodes or n > self.allocator.num_free:
            return True
        pages = sorted(self.allocator.allocate(n))  # runs of consecutive pages copy as one
        handle = self.host.load([p for x in nodes for p in x.host_pages], pages, overlap)
        self.tree.host.promote(nodes, pages)
        self.tree.lock(nodes[-1])
        self._loading[req] = _Load(nodes[-1], n, handle)
        self.loaded_pages += n
        return overlap or self.host.done(handle)

    # -- reading from the disk tier -------------------------------------------------------

    def _from_disk(self, req: Request) -> bool:
        """A session turn whose prefix goes on in page files past what the tree holds reads
        them into host pages (False until done); they then join the tree as host-only nodes,
        and load like any. Checked once per request."""
        assert self.disk is not None
        self._reap_orphans()
        read = self._reading.get(req)
        if read is not None:
            if not read.future.done():
                return False
            del self._reading[req]
            good = self._read_result(read)
            if good:
                given = read.host_pages[:good]
                back = self.tree.host.insert(req.namespace, req.token_ids, read.start, given)
                self.host_allocator.free(back)
                self.disk_hit_tokens += (good - len(back)) * self.page_size
            return True
        if req.session_id is None or req in self._disk_checked:
            return True
        self._disk_checked.add(req)
        ps, full = self.page_size, len(req.token_ids) // self.page_size
        have = self.tree.cached_tokens(req.namespace, req.token_ids) // ps
        if not self.disk.index or have >= full:
            return True
        keys = self.disk.keys(req.namespace, req.token_ids, ps, full)[have:]
        n = self.disk.num_on_disk(keys)
        host_pages = self._host_room(n, keep=None) if n else None
        if host_pages is None:
            return True
        future = self.disk.read_into(self.host, keys[:n], host_pages)
        self._reading[req] = _Read(have, host_pages, future)
        return False

    def pending_reads(self) -> list[Future]:
        """The disk reads waiting requests wait for (an idle engine loop waits on them)."""
        return [r.future for r in self._reading.values() if not r.future.done()]

    def _read_result(self, read: _Read) -> int:
        """How many pages of a finished read are good; frees the host pages of the rest."""
        try:
            good = read.future.result()
        except Exception:  # noqa: BLE001 - a failed read costs a recompute, nothing else
            log.exception("reading KV pages from disk failed")
            good = 0
        self.host_allocator.free(read.host_pages[good:])
        return good

    def _reap_orphans(self) -> None:
        """Free the host pages of finished reads whose request ended first."""
        done = [r for r in self._orphans if r.future.done()]
        self._orphans = [r for r in self._orphans if not r.future.done()]
        for read in done:
            self.host_allocator.free(read.host_pages[: self._read_result(read)])

    def _to_disk(self, req: Request) -> None:
        """Write a finished session turn's cached pages that no file holds yet."""
        if self.disk is None or not req.num_cached_pages:
            return
        keys = self.disk.keys(req.namespace, req.token_ids, self.page_size, req.num_cached_pages)
        missing = self.disk.missing(keys)
        if missing:
            self.disk.write_from(self.host, [keys[i] for i in missing],
                                 [req.pages[i] for i in missing], req.tenant)

    def stats(self) -> dict[str, Any]:
        """The tiers' fields of `PrefixCacheStats`."""
        disk = self.disk
        return dict(
            host_hit_tokens=self.host_hit_tokens,
            host_pages=self.tree.host.cached_pages,
            host_pages_total=self.host_allocator.num_pages,
            offloaded_pages=self.tree.offloaded_pages,
            loaded_pages=self.loaded_pages,
            copy=self.host.copy_stats(),
            disk_hit_tokens=self.disk_hit_tokens,
            disk_pages_written=disk.pages_written if disk else 0,
            disk_pages_read=disk.pages_read if disk else 0,
            disk_pages_rejected=disk.rejected_pages if disk else 0,
            disk_pages_deleted=disk.pages_deleted if disk else 0,
        )

    # -- a request's part ----------------------------------------------------------------

    def attached(self, req: Request, hit: int) -> None:
        """`req` started with `hit` cached tokens: its load, if any, is taken over."""
        self.host_hit_tokens += min(self._drop_load(req) * self.page_size, hit)

    def ended(self, req: Request) -> None:
        """`req` ended (or was preempted) while it may still wait for a load or a read."""
        self._drop_load(req)
        read = self._reading.pop(req, None)
        if read is not None:
            self._orphans.append(read)

    def keep(self, req: Request) -> None:
        """A session turn ended, its path pinned at `req.cache_node`: write it through."""
        assert req.cache_node is not None, "a pinned path"
        self._write_through(req.cache_node)
        self._to_disk(req)

    def drop_loads(self) -> None:
        """Give up every waiting request's load (`PrefixCache.make_room`): the copied pages
        stay cached on the device, unlocked; each request finds them there when it starts."""
        for req in list(self._loading):
            self._drop_load(req)

    def _drop_load(self, req: Request) -> int:
        """Forget `req`'s load: it was attached, or it ended first. Either way the next forward
        may read or reuse the pages, so it waits for a copy still running (`HostKV.use`); the
        pages stay cached. Returns how many pages it loaded."""
        load = self._loading.pop(req, None)
        if load is None:
            return 0
        self.host.use(load.handle)
        self.tree.unlock(load.node)
        return load.num_pages

    # -- the host tier's pages ------------------------------------------------------------

    def _write_through(self, node: RadixNode) -> None:
        """Copy a pinned session path's KV to the host tier where it has no copy yet, so
        that evicting it later moves nothing."""
        path = []
        while node.parent is not None:
            if not node.host_pages:
                path.append(node)
            node = node.parent
        for n in reversed(path):  # root side first: a full host pool keeps the head
            host_pages = self._host_room(len(n.pages), keep=n)
            if host_pages is None:
                return
            self.host.offload(n.pages, host_pages)
            self.tree.host.set_copy(n, host_pages)

    def offload(self, node: RadixNode) -> list[int] | None:
        """`RadixTree.evict`'s hook: copy `node`'s device KV to new host pages."""
        host_pages = self._host_room(len(node.pages), keep=node)
        if host_pages is not None:
            self.host.offload(node.pages, host_pages)
        return host_pages

    def _host_room(self, n: int, keep: RadixNode | None) -> list[int] | None:
        """`n` host pages, evicting LRU host pages (not `keep`'s path's) if need be; None
        when they cannot be had."""
        short = n - self.host_allocator.num_free
        if short > 0:
            self.host_allocator.free(self.tree.host.evict(short, keep))
        if not self.host_allocator.can_allocate(n):
            return None
        return self.host_allocator.allocate(n)


def _num_host_pages(nodes: list[RadixNode]) -> int:
    return sum(len(n.host_pages) for n in nodes)
