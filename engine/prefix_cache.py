"""The scheduler's view of the radix tree: request-level calls over `sessions.RadixTree`.

Pure Python. A request's page table is `request.pages`; its first `num_cached_pages` entries
belong to the tree (lent by `match` or handed over by `insert`) and are protected by a lock
on `request.cache_node`; the rest belong to the request. The scheduler calls:

- `attach(req)` at admission: the longest cached prefix in the request's namespace becomes
  the start of its page table and of `num_computed_tokens` (never all of it: the last prompt
  token is always computed, since sampling needs its logits). `detach(req)` undoes it when
  the admission fails.
- `commit(req)` after a prefill chunk: the request's computed full pages enter the tree.
- `release(req)` when a request finishes or is preempted: commit, then the request's own
  pages go back to the allocator and its lock is dropped (a session's path is pinned).
- `make_room(n)` when the allocator runs short: evict unlocked LRU leaves first, unpinning
  idle sessions if that is what it takes.
- `ready(req)` before admission, with a host tier: a request whose prefix is partly on the host
  has it copied back (asynchronously, `HostKV.load`) and waits, holding a lock on it, until
  the copy is done; the others go ahead meanwhile. On an idle engine it starts at once, its
  forward overlapping the copy layer by layer.

The host tier (`host`, engine/kv_host.py) sits under the tree: evicted device pages move to
host pages (their own pool and allocator here) instead of being dropped, and a session's KV is
written through to the host when its turn ends, so evicting it later copies nothing. Host pages
are evicted LRU in turn when the host pool is full.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from engine.page_allocator import PageAllocator
from engine.request import Request
from sessions.pins import SessionPins
from sessions.radix_tree import RadixNode, RadixTree

if TYPE_CHECKING:
    from engine.kv_disk import DiskKV

log = logging.getLogger(__name__)


class CopyStats(NamedTuple):
    bytes_to_host: int = 0
    seconds_to_host: float = 0.0
    bytes_to_device: int = 0
    seconds_to_device: float = 0.0


class HostKV(Protocol):
    """Copies KV pages between the device pool and the host tier's pool (engine/kv_host.py).

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

    # The disk tier's needs (engine/kv_disk.py): a private host copy of device pages and a
    # function returning once it is complete; one that returns once the copies queued so far
    # are done; writing one page read from disk into a host page.
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


@dataclass(frozen=True)
class PrefixCacheStats:
    hit_tokens: int = 0  # prompt tokens admitted from the cache
    miss_tokens: int = 0  # prompt tokens admitted that had to be computed
    evicted_pages: int = 0
    cached_pages: int = 0  # pages the tree owns now
    evictable_pages: int = 0  # of those, pages no running request locks and no session pins
    pinned_pages: int = 0  # pages sessions keep between turns (counted per session)
    host_hit_tokens: int = 0  # of hit_tokens, those whose KV was loaded from the host tier
    host_pages: int = 0  # host-tier pages the tree holds now
    host_pages_total: int = 0  # the host pool's size (0: no host tier)
    offloaded_pages: int = 0  # device pages evicted to the host tier (not dropped)
    loaded_pages: int = 0  # pages loaded back from the host tier
    copy: CopyStats = CopyStats()
    disk_hit_tokens: int = 0  # prompt tokens whose KV was read from the disk tier
    disk_pages_written: int = 0
    disk_pages_read: int = 0
    disk_pages_rejected: int = 0  # page files that did not check out (corrupt, mismatched)


class PrefixCache:
    """`enabled=False` keeps the same calls but never matches nor stores anything.

    `session_pages`: per-tenant budget of pages that sessions may keep pinned between turns.
    `host`: the host tier's copier (None: evicted KV is dropped). `disk`: the disk tier under
    it (sessions' KV as files, kept across restarts; needs `host`).
    """

    def __init__(
        self, allocator: PageAllocator, page_size: int, enabled: bool = True,
        session_pages: int = 0, host: HostKV | None = None, disk: DiskKV | None = None,
    ):
        self.allocator = allocator
        self.page_size = page_size
        self.enabled = enabled
        self.tree = RadixTree(page_size)
        self.pins = SessionPins(self.tree, session_pages)
        self.host = host if enabled else None
        self.host_allocator = PageAllocator(host.num_pages if self.host else 0)
        self._loading: dict[Request, _Load] = {}  # waiting requests whose prefix is loading
        self.disk = disk if self.host is not None else None
        self._reading: dict[Request, _Read] = {}  # waiting requests whose pages are read
        self._orphans: list[_Read] = []  # reads whose request ended first
        self._disk_checked: weakref.WeakSet[Request] = weakref.WeakSet()
        self.disk_hit_tokens = 0
        self.hit_tokens = 0
        self.miss_tokens = 0
        self.host_hit_tokens = 0
        self.loaded_pages = 0

    # -- loading from the host tier -------------------------------------------------------

    def ready(self, req: Request, overlap: bool = False) -> bool:
        """May `req` be attached now? False while the host-resident part of its cached prefix
        is being copied back to the device (started by the first call: the prefix is locked
        meanwhile), so the batch runs on without it; with `overlap` (nothing else runs, so
        there is no batch to hold up), True at once: its forward then waits for each layer's
        copy before that layer. Never False for want of room: with too few device pages for
        the copy, the request starts from its device prefix and computes the rest."""
        load = self._loading.get(req)
        if load is not None:
            assert self.host is not None
            return overlap or self.host.done(load.handle)
        if self.host is None:
            return True
        if self.disk is not None and not self._from_disk(req):
            return False
        nodes = self.tree.host_path(req.namespace, req.token_ids)
        if not nodes or not self.make_room(_num_host_pages(nodes)):
            return True
        nodes = self.tree.host_path(req.namespace, req.token_ids)  # make_room may move them
        n = _num_host_pages(nodes)
        if not nodes or n > self.allocator.num_free:
            return True
        pages = sorted(self.allocator.allocate(n))  # runs of consecutive pages copy as one
        handle = self.host.load([p for x in nodes for p in x.host_pages], pages, overlap)
        self.tree.promote(nodes, pages)
        self.tree.lock(nodes[-1])
        self._loading[req] = _Load(nodes[-1], n, handle)
        self.loaded_pages += n
        return overlap or self.host.done(handle)

    # -- reading from the disk tier -------------------------------------------------------

    def _from_disk(self, req: Request) -> bool:
        """A session turn whose prefix goes on in page files past what the tree holds reads
        them into host pages (False until done); they then join the tree as host-only nodes,
        and load like any. Checked once per request."""
        assert self.disk is not None and self.host is not None
        self._reap_orphans()
        read = self._reading.get(req)
        if read is not None:
            if not read.future.done():
                return False
            del self._reading[req]
            good = self._read_result(read)
            if good:
                given = read.host_pages[:good]
                back = self.tree.insert_host(req.namespace, req.token_ids, read.start, given)
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
        store = self.host.store
        future = self.disk.read(keys[:n], lambda i, page: store(host_pages[i], page),
                                before=self.host.host_writes_done())
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
        if self.disk is None or self.host is None or not req.num_cached_pages:
            return
        keys = self.disk.keys(req.namespace, req.token_ids, self.page_size, req.num_cached_pages)
        missing = self.disk.missing(keys)
        if missing:
            pages, ready = self.host.snapshot([req.pages[i] for i in missing])
            self.disk.write([keys[i] for i in missing], pages, ready)

    def _drop_load(self, req: Request) -> int:
        """Forget `req`'s load: it was attached, or it ended first. Either way the next forward
        may read or reuse the pages, so it waits for a copy still running (`HostKV.use`); the
        pages stay cached. Returns how many pages it loaded."""
        load = self._loading.pop(req, None)
        if load is None:
            return 0
        assert self.host is not None
        self.host.use(load.handle)
        self.tree.unlock(load.node)
        return load.num_pages

    # -- admission ------------------------------------------------------------------------

    def attach(self, req: Request) -> None:
        """Start `req` (holding no pages) from its longest cached prefix; lock that prefix."""
        assert not req.pages and req.cache_node is None, "attach a request holding no pages"
        hit = 0
        if self.enabled:
            m = self.tree.match(req.namespace, req.token_ids)
            pages = m.pages
            if m.num_tokens == req.num_tokens:  # a full hit: recompute the last page for logits
                pages = pages[:-1]
            hit = len(pages) * self.page_size
            if pages:
                self.tree.lock(m.last_node)
                req.cache_node, req.pages = m.last_node, list(pages)
                req.num_cached_pages, req.num_computed_tokens = len(pages), hit
            self.host_hit_tokens += min(self._drop_load(req) * self.page_size, hit)
        if req.num_preemptions == 0:
            req.num_cached_tokens = hit
        self.hit_tokens += hit
        self.miss_tokens += req.num_tokens - hit

    def detach(self, req: Request) -> None:
        """Undo `attach` for a request that could not be admitted after all."""
        self.hit_tokens -= req.num_computed_tokens
        self.miss_tokens -= req.num_tokens - req.num_computed_tokens
        self._free_own_and_unlock(req)
        req.num_computed_tokens = 0
        if req.num_preemptions == 0:
            req.num_cached_tokens = 0

    # -- handing pages to the tree --------------------------------------------------------

    def commit(self, req: Request) -> None:
        """Insert `req`'s computed full pages; its page table then reads the tree's pages."""
        full = req.num_computed_tokens // self.page_size
        if not self.enabled or full <= req.num_cached_pages:
            return
        res = self.tree.insert(req.namespace, req.token_ids[: full * self.page_size], req.pages)
        self.tree.lock(res.last_node)  # lock the new path before unlocking the old one
        if req.cache_node is not None:
            self.tree.unlock(req.cache_node)
        req.pages[: len(res.pages)] = res.pages
        if res.duplicates:
            self.allocator.free(res.duplicates)
        req.cache_node, req.num_cached_pages = res.last_node, len(res.pages)

    def release(self, req: Request) -> None:
        """`req` stops running (finished or preempted): keep its KV in the tree, free the rest.

        A request of a session pins its path for the next turn (see `SessionPins`).
        """
        self.commit(req)
        self._drop_load(req)  # a waiting request that ends while its prefix loads
        read = self._reading.pop(req, None)  # ... or while its pages are read from disk
        if read is not None:
            self._orphans.append(read)
        if req.session_id is not None and req.cache_node is not None and req.finished:
            self.pins.pin(req.tenant, req.session_id, req.cache_node)
            self._write_through(req.cache_node)
            self._to_disk(req)
        self._free_own_and_unlock(req)

    def _write_through(self, node: RadixNode) -> None:
        """Copy a pinned session path's KV to the host tier where it has no copy yet, so
        that evicting it later moves nothing (and a restart-safe tier could keep it)."""
        if self.host is None:
            return
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
            self.tree.set_host_copy(n, host_pages)

    def _offload(self, node: RadixNode) -> list[int] | None:
        """`RadixTree.evict`'s hook: copy `node`'s device KV to new host pages."""
        assert self.host is not None
        host_pages = self._host_room(len(node.pages), keep=node)
        if host_pages is not None:
            self.host.offload(node.pages, host_pages)
        return host_pages

    def _host_room(self, n: int, keep: RadixNode) -> list[int] | None:
        """`n` host pages, evicting LRU host pages (not `keep`'s path's) if need be; None
        when they cannot be had."""
        short = n - self.host_allocator.num_free
        if short > 0:
            self.host_allocator.free(self.tree.evict_host(short, keep))
        if not self.host_allocator.can_allocate(n):
            return None
        return self.host_allocator.allocate(n)

    def _free_own_and_unlock(self, req: Request) -> None:
        own = req.pages[req.num_cached_pages :]
        if own:
            self.allocator.free(own)
        if req.cache_node is not None:
            self.tree.unlock(req.cache_node)
        req.pages, req.cache_node, req.num_cached_pages = [], None, 0

    # -- room and reset -------------------------------------------------------------------

    def make_room(self, num_pages: int) -> bool:
        """Evict LRU unlocked tree pages until `num_pages` can be allocated; False if they
        cannot (then nothing is evicted). Session pins give way when they stand in the way:
        the least recently used sessions are unpinned first (their KV stays cached, now
        evictable), so that idle sessions never make a request wait forever."""
        short = num_pages - self.allocator.num_free
        if short <= 0:
            return True
        while short > self.tree.evictable_pages and self.pins.unpin_lru():
            pass
        if short > self.tree.evictable_pages:
            return False
        # Evicting scans the whole tree, and decode asks for a page or two at a time: take a
        # 1/64 of the pool per scan (at least what is short), so the scans stay rare.
        batch = max(short, self.allocator.num_pages // 64)
        freed = self.tree.evict(min(batch, self.tree.evictable_pages),
                                self._offload if self.host else None)
        self.allocator.free(freed.device)
        self.host_allocator.free(freed.host)
        return True

    def release_session(self, session_id: str) -> None:
        """The session ended: its path is no longer pinned (it stays cached, evictable)."""
        self.pins.unpin(session_id)

    def reset(self) -> int:
        """Drop the whole cache (pins included); returns the pages given back. Raises while a
        running request holds a lock."""
        freed = self.tree.reset()
        self.pins.clear()
        self.allocator.free(freed.device)
        self.host_allocator.free(freed.host)
        return len(freed.device)

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            hit_tokens=self.hit_tokens,
            miss_tokens=self.miss_tokens,
            evicted_pages=self.tree.evicted_pages,
            cached_pages=self.tree.cached_pages,
            evictable_pages=self.tree.evictable_pages,
            pinned_pages=self.pins.num_pages,
            host_hit_tokens=self.host_hit_tokens,
            host_pages=self.tree.host_pages,
            host_pages_total=self.host_allocator.num_pages,
            offloaded_pages=self.tree.offloaded_pages,
            loaded_pages=self.loaded_pages,
            copy=self.host.copy_stats() if self.host else CopyStats(),
            disk_hit_tokens=self.disk_hit_tokens,
            disk_pages_written=self.disk.pages_written if self.disk else 0,
            disk_pages_read=self.disk.pages_read if self.disk else 0,
            disk_pages_rejected=self.disk.rejected_pages if self.disk else 0,
        )


def _num_host_pages(nodes: list[RadixNode]) -> int:
    return sum(len(n.host_pages) for n in nodes)
