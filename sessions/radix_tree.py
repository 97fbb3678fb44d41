"""Radix tree over KV pages: the prefix cache, one tree per namespace.

Pure Python, no torch: the tree stores token ids and integer page ids, never KV tensors.

Ownership. Every page of the engine's KV pool belongs to exactly one party at a time:
the allocator (free), a running request (pages it allocated and has not handed over), or this
tree (pages stored in a node). Pages move between parties only through these calls:

- `insert` takes the caller's pages for positions the tree does not hold yet. For positions
  it already holds, the tree keeps its own page; the caller's differing page is returned in
  `InsertResult.duplicates` and stays the caller's, to free once its page table reads
  `InsertResult.pages` instead.
- `evict` and `reset` give tree pages back; the caller returns them to the allocator.
- `match` moves nothing: it lends tree pages, and the loan is safe only while the caller holds
  a `lock` (or `pin`) on `MatchResult.last_node`.

A node may be evicted only while neither it nor any descendant is locked or pinned (counts
propagate from a node to the root), and only as a leaf: the least recently used first.

Tiers. With a host tier (engine/kv/host.py) a node's KV lives in device pages (`pages`), in
pages of a second, host-memory pool (`host_pages`), or in both (a host copy of device KV,
written through for sessions or left behind by a load). Host pages change hands the same way:
`evict`'s `offload` hook hands them in, `host.evict`, `evict` and `reset` give them back.
Evicting a device leaf then keeps the node with its KV on the host; a request that matches it
loads it back (`host.path`, then `host.promote`). Invariant: a namespace's device-resident
nodes form a subtree at its root (children lose their device pages before their parent), so a
match is a device prefix followed by host-only nodes, and protected nodes are on the device.

Layout. The nodes and the page -> node maps are forest.py's `Forest`; the host-tier calls are
host_tier.py's `HostTier`, the tree's `host`; this module holds the device side, eviction and
the lock and pin counts.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import NamedTuple

from sessions.forest import Forest, RadixNode, subtree
from sessions.host_tier import HostTier

__all__ = ["Freed", "InsertResult", "MatchResult", "Offload", "RadixNode", "RadixTree"]


class MatchResult(NamedTuple):
    num_tokens: int  # cached prefix length on the device, a multiple of page_size
    pages: list[int]  # the tree's device pages for that prefix (lent, see `lock`)
    last_node: RadixNode  # lock this to keep `pages` from being evicted


class InsertResult(NamedTuple):
    num_cached: int  # tokens that were already in the tree before this insert
    pages: list[int]  # the tree's pages for the inserted full-page prefix: the new page table
    duplicates: list[int]  # caller's pages the tree did not take: the caller frees them
    last_node: RadixNode  # the node ending the inserted prefix


class Freed(NamedTuple):
    """Pages the tree gave back: the caller frees them in their pools."""

    device: list[int]
    host: list[int]


# Moves a device node's KV to the host: the host pages now holding it, or None (no room).
Offload = Callable[["RadixNode"], "list[int] | None"]


class RadixTree:
    """Longest-prefix cache of KV pages, keyed by (namespace, token ids).

    KV is never shared across namespaces (a namespace is any hashable, e.g. (tenant, adapter)).
    Only full pages are stored; a trailing partial page is never cached nor matched.
    Single-threaded: the scheduler owns the tree.
    """

    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.page_size = page_size
        self._forest = Forest(page_size)  # the nodes and which node holds each page
        self.host = HostTier(self._forest)  # the host-tier calls, over the same nodes
        self._protected_pages = 0
        self.hit_tokens = 0
        self.miss_tokens = 0
        self.evicted_pages = 0  # device pages evicted (dropped or moved to the host)
        self.offloaded_pages = 0  # of those, moved to the host

    # -- queries ---------------------------------------------------------------------------

    @property
    def cached_pages(self) -> int:
        """Device pages the tree owns."""
        return len(self._forest.owner)

    @property
    def protected_pages(self) -> int:
        """Tree pages on a locked or pinned path: never evicted."""
        return self._protected_pages

    @property
    def evictable_pages(self) -> int:
        """Device pages `evict` could free now (every unprotected node becomes a leaf in time)."""
        return len(self._forest.owner) - self._protected_pages

    def iter_pages(self) -> Iterator[tuple[Hashable, int]]:
        """(namespace, page id) for every device page the tree owns, for metrics and checks."""
        for namespace, root in self._forest.roots.items():
            for node in subtree(root):
                for page in node.pages:
                    yield namespace, page

    def match(self, namespace: Hashable, tokens: Sequence[int]) -> MatchResult:
        """Longest full-page prefix of `tokens` in `namespace` whose KV is on the device.

        Splits a node at the page boundary where the match ends, so `last_node`'s path holds
        exactly `pages`. Nothing changes hands: lock `last_node` before the next `evict`.
        Refreshes LRU recency and counts hit/miss tokens (so call it once per admission).
        """
        path, _ = self._forest.walk(namespace, tokens)
        node, pages = self._forest.root(namespace), []
        for n in path:
            if n.host_only:
                break
            node = n
            pages += n.pages
        pos = len(pages) * self.page_size
        self.hit_tokens += pos
        self.miss_tokens += len(tokens) - pos
        return MatchResult(pos, pages, node)

    def cached_tokens(self, namespace: Hashable, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` the tree holds, on either tier. Moves nothing."""
        return self._forest.walk(namespace, tokens)[1]

    # -- ownership transfers ---------------------------------------------------------------

    def insert(
        self, namespace: Hashable, tokens: Sequence[int], pages: Sequence[int]
    ) -> InsertResult:
        """Cache the full pages of `tokens`, whose KV lies in `pages` (page i: tokens of page i).

        `pages` needs at least len(tokens) // page_size entries; further ones (a partial tail
        page) are ignored and stay the caller's. For each full page position:
        - not yet in the tree, or held there on the host only: the tree takes the caller's page
          (the caller stops owning it);
        - in the tree with the same page id (the caller got it from `match`): nothing moves;
        - in the tree with another page id: the tree keeps its own; the caller's page is
          listed in `duplicates` and the caller must free it.
        The new pages are evictable at once: a request that keeps running must `lock` the
        returned `last_node` (then unlock its previous node) and switch its page table to
        `pages` before freeing `duplicates`. Raises ValueError, with nothing transferred, when
        a caller page is already owned by the tree at another position or is listed twice.
        """
        forest = self._forest
        key = forest.full_pages(tokens)
        given = list(pages[: len(key) // self.page_size])
        if len(given) * self.page_size != len(key):
            raise ValueError(f"{len(key) // self.page_size} full pages need as many page ids")
        if len(set(given)) != len(given):
            raise ValueError("a page id is listed twice")
        forest.roots.setdefault(namespace, RadixNode((), [], None))
        path, pos = forest.walk(namespace, key)
        tree_pages: list[int] = []
        taken: list[tuple[RadixNode, list[int]]] = []  # host-only nodes given device pages
        for n in path:
            if n.host_only:
                n_pages = given[len(tree_pages) : len(tree_pages) + len(n.host_pages)]
                taken.append((n, n_pages))
                tree_pages += n_pages
            else:
                tree_pages += n.pages
        done = pos // self.page_size
        duplicates = [c for c, t in zip(given[:done], tree_pages, strict=True) if c != t]
        rest = given[done:]
        if any(p in forest.owner for p in duplicates + rest + [p for _, ps in taken for p in ps]):
            raise ValueError("a page given to insert is already owned by the tree elsewhere")
        for n, n_pages in taken:
            forest.set_pages(n, n_pages)
        node = path[-1] if path else forest.roots[namespace]
        if rest:
            leaf = RadixNode(key[pos:], rest, node, forest.clock)
            node.children[leaf.key[: self.page_size]] = leaf
            forest.owner.update(dict.fromkeys(rest, leaf))
            node = leaf
        return InsertResult(pos, tree_pages + rest, duplicates, node)

    def evict(self, num_pages: int, offload: Offload | None = None) -> Freed:
        """Free up to `num_pages` device pages, least recently used unprotected leaves of the
        device subtree first.

        A leaf larger than what is still needed is split and loses only its tail. A leaf whose
        KV has a host copy, or that `offload` copies to the host, stays in the tree on the
        host; any other is dropped with its (host-only) subtree. A parent whose children are
        all off the device becomes a candidate in turn. Returns the freed device pages (fewer
        than asked when too little is evictable) and host pages of dropped nodes.
        """
        forest = self._forest
        order = itertools.count()  # tie-break, so nodes themselves are never compared
        heap = [
            (n.last_access, next(order), n)
            for root in forest.roots.values()
            for n in subtree(root)
            if _is_evictable_leaf(n)
        ]
        heapq.heapify(heap)
        freed = Freed([], [])
        while heap and len(freed.device) < num_pages:
            _, _, leaf = heapq.heappop(heap)
            if not _is_evictable_leaf(leaf):  # an offload dropped its host subtree meanwhile
                continue
            take = min(num_pages - len(freed.device), len(leaf.pages))
            if take < len(leaf.pages):  # only the tail goes: `leaf` keeps it, a parent the rest
                forest.split(leaf, (len(leaf.pages) - take) * self.page_size)
            parent = leaf.parent
            assert parent is not None
            freed.device.extend(leaf.pages)
            host = leaf.host_pages or (offload(leaf) if offload is not None else None)
            if host:
                forest.set_host_pages(leaf, host)
                self.offloaded_pages += len(leaf.pages)
                forest.set_pages(leaf, [])
            else:
                freed.host.extend(forest.drop(leaf))
            if _is_evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        for page in freed.device:
            forest.owner.pop(page, None)
        forest.prune_roots()
        self.evicted_pages += len(freed.device)
        return freed

    def reset(self) -> Freed:
        """Drop every node, pins included; returns all tree pages for the caller to free.

        Raises RuntimeError while a node is locked (a running request still reads its pages).
        """
        forest = self._forest
        if any(n.lock_ref for root in forest.roots.values() for n in subtree(root)):
            raise RuntimeError("cannot reset the radix tree while requests hold locks")
        freed = Freed(list(forest.owner), list(forest.host_owner))
        forest.clear()
        self._protected_pages = 0
        return freed

    # -- protection ------------------------------------------------------------------------

    def lock(self, node: RadixNode) -> None:
        """Protect `node` and its ancestors from eviction while a request runs on them."""
        self._adjust(node, "lock_ref", +1)

    def unlock(self, node: RadixNode) -> None:
        """Undo one `lock(node)`; the path becomes evictable when no lock or pin remains."""
        self._adjust(node, "lock_ref", -1)

    def pin(self, node: RadixNode) -> None:
        """Keep a session's path cached between turns (like `lock`, counted apart)."""
        self._adjust(node, "pin_ref", +1)

    def unpin(self, node: RadixNode) -> None:
        """Undo one `pin(node)`."""
        self._adjust(node, "pin_ref", -1)

    def _adjust(self, node: RadixNode, count: str, delta: int) -> None:
        """Add `delta` to `count` ("lock_ref" or "pin_ref") from `node` up to the root."""
        if not node.alive:
            raise ValueError("node was evicted or reset; lock right after match/insert")
        if node.host_only:
            raise ValueError("a node on the host only cannot be locked; promote it first")
        if delta < 0 and node.parent is not None and getattr(node, count) == 0:
            raise ValueError(f"{count.removesuffix('_ref')} count would go below zero")
        while node.parent is not None:  # the root is never evicted: not counted
            was = node.protected
            setattr(node, count, getattr(node, count) + delta)
            if was != node.protected:
                self._protected_pages += len(node.pages) if node.protected else -len(node.pages)
            node = node.parent


def _is_evictable_leaf(node: RadixNode) -> bool:
    """A leaf of the device subtree that nothing protects."""
    return (node.alive and node.parent is not None and bool(node.pages) and not node.protected
            and not any(c.pages for c in node.children.values()))
