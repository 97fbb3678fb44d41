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
  idle sessions, then giving up waiting requests' loads from the host tier, if that is what
  it takes.
- `ready(req)` before admission: False while the part of its prefix on a lower tier is brought
  back (engine/kv/tiers.py, when the engine has a host tier: evicted KV then moves there
  instead of being dropped).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.core.request import Request
from engine.kv.page_allocator import PageAllocator
from engine.kv.tiers import CopyStats, HostKV, KVTiers
from sessions.pins import SessionPins
from sessions.radix_tree import RadixTree

if TYPE_CHECKING:
    from engine.kv.disk import DiskKV


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
    disk_pages_deleted: int = 0  # page files removed to keep the tier within its size


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
        # A load's own room never comes from other loads (they would take turns dropping
        # each other's).
        self.tiers = (KVTiers(self.tree, allocator, page_size,
                              lambda n: self.make_room(n, drop_loads=False), host, disk)
                      if host is not None and enabled else None)
        self.hit_tokens = 0
        self.miss_tokens = 0

    def ready(self, req: Request, overlap: bool = False) -> bool:
        """May `req` be attached now? (`KVTiers.ready`: not while its prefix is brought back
        from a lower tier, unless `overlap`.)"""
        return self.tiers is None or self.tiers.ready(req, overlap)

    def pending_reads(self) -> list[Future]:
        """Disk reads that waiting requests wait for (an idle engine loop waits on them)."""
        return self.tiers.pending_reads() if self.tiers is not None else []

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
            if self.tiers is not None:
                self.tiers.attached(req, hit)
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
        if self.tiers is not None:
            self.tiers.ended(req)
        if req.session_id is not None and req.cache_node is not None and req.finished:
            self.pins.pin(req.tenant, req.session_id, req.cache_node)
            if self.tiers is not None:
                self.tiers.keep(req)
        self._free_own_and_unlock(req)

    def _free_own_and_unlock(self, req: Request) -> None:
        own = req.pages[req.num_cached_pages :]
        if own:
            self.allocator.free(own)
        if req.cache_node is not None:
            self.tree.unlock(req.cache_node)
        req.pages, req.cache_node, req.num_cached_pages = [], None, 0

    # -- room and reset -------------------------------------------------------------------

    def make_room(self, num_pages: int, drop_loads: bool = True) -> bool:
        """Evict LRU unlocked tree pages until `num_pages` can be allocated; False if they
        cannot (then nothing is evicted). Session pins give way when they stand in the way:
        the least recently used sessions are unpinned first (their KV stays cached, now
        evictable), so that idle sessions never make a request wait forever. So do the loads
        of waiting requests from the host tier (`drop_loads`): a prefix copied back for a
        request that waits locks its pages until that request starts, and the request ahead
        of it in the queue, or a running one, must not wait for it (it would wait forever
        when the queue's head needs those pages)."""
        short = num_pages - self.allocator.num_free
        if short <= 0:
            return True
        while short > self.tree.evictable_pages and self.pins.unpin_lru():
            pass
        if short > self.tree.evictable_pages and drop_loads and self.tiers is not None:
            self.tiers.drop_loads()
        if short > self.tree.evictable_pages:
            return False
        # Evicting scans the whole tree, and decode asks for a page or two at a time: take a
        # 1/64 of the pool per scan (at least what is short), so the scans stay rare.
        batch = max(short, self.allocator.num_pages // 64)
        tiers = self.tiers
        freed = self.tree.evict(min(batch, self.tree.evictable_pages),
                                tiers.offload if tiers is not None else None)
        self.allocator.free(freed.device)
        if tiers is not None:
            tiers.host_allocator.free(freed.host)
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
        if self.tiers is not None:
            self.tiers.host_allocator.free(freed.host)
        return len(freed.device)

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            hit_tokens=self.hit_tokens,
            miss_tokens=self.miss_tokens,
            evicted_pages=self.tree.evicted_pages,
            cached_pages=self.tree.cached_pages,
            evictable_pages=self.tree.evictable_pages,
            pinned_pages=self.pins.num_pages,
            **(self.tiers.stats() if self.tiers is not None else {}),
        )

