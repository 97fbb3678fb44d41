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
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.page_allocator import PageAllocator
from engine.request import Request
from sessions.pins import SessionPins
from sessions.radix_tree import RadixTree


@dataclass(frozen=True)
class PrefixCacheStats:
    hit_tokens: int = 0  # prompt tokens admitted from the cache
    miss_tokens: int = 0  # prompt tokens admitted that had to be computed
    evicted_pages: int = 0
    cached_pages: int = 0  # pages the tree owns now
    evictable_pages: int = 0  # of those, pages no running request locks and no session pins
    pinned_pages: int = 0  # pages sessions keep between turns (counted per session)


class PrefixCache:
    """`enabled=False` keeps the same calls but never matches nor stores anything.

    `session_pages`: per-tenant budget of pages that sessions may keep pinned between turns.
    """

    def __init__(
        self, allocator: PageAllocator, page_size: int, enabled: bool = True,
        session_pages: int = 0,
    ):
        self.allocator = allocator
        self.page_size = page_size
        self.enabled = enabled
        self.tree = RadixTree(page_size)
        self.pins = SessionPins(self.tree, session_pages)
        self.hit_tokens = 0
        self.miss_tokens = 0

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
        if req.session_id is not None and req.cache_node is not None and req.finished:
            self.pins.pin(req.tenant, req.session_id, req.cache_node)
        self._free_own_and_unlock(req)

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
        self.allocator.free(self.tree.evict(min(batch, self.tree.evictable_pages)))
        return True

    def release_session(self, session_id: str) -> None:
        """The session ended: its path is no longer pinned (it stays cached, evictable)."""
        self.pins.unpin(session_id)

    def reset(self) -> int:
        """Drop the whole cache (pins included); returns the pages given back. Raises while a
        running request holds a lock."""
        freed = self.tree.reset()
        self.pins.clear()
        self.allocator.free(freed)
        return len(freed)

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            hit_tokens=self.hit_tokens,
            miss_tokens=self.miss_tokens,
            evicted_pages=self.tree.evicted_pages,
            cached_pages=self.tree.cached_pages,
            evictable_pages=self.tree.evictable_pages,
            pinned_pages=self.pins.num_pages,
        )
