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
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass(eq=False, slots=True)
class RadixNode:
    """A run of full pages: `key` holds len(pages) * page_size tokens. The root has none."""

    key: tuple[int, ...]
    pages: list[int]
    parent: RadixNode | None = field(repr=False)
    last_access: int = 0  # LRU clock tick of the last match/insert through this node
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict, repr=False)
    lock_ref: int = 0  # running requests using this node or a descendant
    pin_ref: int = 0  # sessions keeping this node or a descendant between turns
    alive: bool = True  # False once evicted or reset

    @property
    def protected(self) -> bool:
        return self.lock_ref > 0 or self.pin_ref > 0


class MatchResult(NamedTuple):
    num_tokens: int  # cached prefix length, a multiple of page_size
    pages: list[int]  # the tree's pages for that prefix (lent, see `lock`)
    last_node: RadixNode  # lock this to keep `pages` from being evicted


class InsertResult(NamedTuple):
    num_cached: int  # tokens that were already in the tree before this insert
    pages: list[int]  # the tree's pages for the inserted full-page prefix: the new page table
    duplicates: list[int]  # caller's pages the tree did not take: the caller frees them
    last_node: RadixNode  # the node ending the inserted prefix


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
        self._roots: dict[Hashable, RadixNode] = {}
        self._owner: dict[int, RadixNode] = {}  # page id -> the node holding it
        self._protected_pages = 0
        self._clock = 0
        self.hit_tokens = 0
        self.miss_tokens = 0
        self.evicted_pages = 0

    # -- queries ---------------------------------------------------------------------------

    @property
    def cached_pages(self) -> int:
        """Pages the tree owns."""
        return len(self._owner)

    @property
    def protected_pages(self) -> int:
        """Tree pages on a locked or pinned path: never evicted."""
        return self._protected_pages

    @property
    def evictable_pages(self) -> int:
        """Pages `evict` could free now (every unprotected node becomes a leaf in time)."""
        return len(self._owner) - self._protected_pages

    def iter_pages(self) -> Iterator[tuple[Hashable, int]]:
        """(namespace, page id) for every page the tree owns, for metrics and checks."""
        for namespace, root in self._roots.items():
            for node in _subtree(root):
                for page in node.pages:
                    yield namespace, page

    def match(self, namespace: Hashable, tokens: Sequence[int]) -> MatchResult:
        """Longest cached full-page prefix of `tokens` in `namespace`.

        Splits a node at the page boundary where the match ends, so `last_node`'s path holds
        exactly `pages`. Nothing changes hands: lock `last_node` before the next `evict`.
        Refreshes LRU recency and counts hit/miss tokens (so call it once per admission).
        """
        root = self._roots.get(namespace)
        if root is None:
            root = RadixNode((), [], None)  # not stored: an unknown namespace stays unknown
        key = self._full_pages(tokens)
        node, pos, pages = self._walk(root, key)
        self.hit_tokens += pos
        self.miss_tokens += len(tokens) - pos
        return MatchResult(pos, pages, node)

    # -- ownership transfers ---------------------------------------------------------------

    def insert(
        self, namespace: Hashable, tokens: Sequence[int], pages: Sequence[int]
    ) -> InsertResult:
        """Cache the full pages of `tokens`, whose KV lies in `pages` (page i: tokens of page i).

        `pages` needs at least len(tokens) // page_size entries; further ones (a partial tail
        page) are ignored and stay the caller's. For each full page position:
        - not yet in the tree: the tree takes the caller's page (the caller stops owning it);
        - in the tree with the same page id (the caller got it from `match`): nothing moves;
        - in the tree with another page id: the tree keeps its own; the caller's page is
          listed in `duplicates` and the caller must free it.
        The new pages are evictable at once: a request that keeps running must `lock` the
        returned `last_node` (then unlock its previous node) and switch its page table to
        `pages` before freeing `duplicates`. Raises ValueError, with nothing transferred, when
        a caller page is already owned by the tree at another position or is listed twice.
        """
        key = self._full_pages(tokens)
        given = list(pages[: len(key) // self.page_size])
        if len(given) * self.page_size != len(key):
            raise ValueError(f"{len(key) // self.page_size} full pages need as many page ids")
        if len(set(given)) != len(given):
            raise ValueError("a page id is listed twice")
        root = self._roots.setdefault(namespace, RadixNode((), [], None))
        node, pos, tree_pages = self._walk(root, key)
        done = pos // self.page_size
        duplicates = [c for c, t in zip(given[:done], tree_pages, strict=True) if c != t]
        rest = given[done:]
        if any(p in self._owner for p in duplicates + rest):
            raise ValueError("a page given to insert is already owned by the tree elsewhere")
        if rest:
            leaf = RadixNode(key[pos:], rest, node, self._clock)
            node.children[leaf.key[: self.page_size]] = leaf
            self._owner.update(dict.fromkeys(rest, leaf))
            node = leaf
        return InsertResult(pos, tree_pages + rest, duplicates, node)

    def evict(self, num_pages: int) -> list[int]:
        """Free up to `num_pages` tree pages, least recently used unprotected leaves first.

        A leaf larger than what is still needed loses only its tail pages; a parent whose
        children are all gone becomes a leaf and a candidate in turn. Returns the freed page
        ids (fewer than asked when too little is evictable); the caller frees them.
        """
        order = itertools.count()  # tie-break, so nodes themselves are never compared
        heap = [
            (n.last_access, next(order), n)
            for root in self._roots.values()
            for n in _subtree(root)
            if _is_evictable_leaf(n)
        ]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_pages:
            _, _, leaf = heapq.heappop(heap)
            take = min(num_pages - len(freed), len(leaf.pages))
            if take < len(leaf.pages):  # trim the tail; the leaf keeps its first page
                freed += leaf.pages[-take:]
                leaf.pages = leaf.pages[:-take]
                leaf.key = leaf.key[: len(leaf.pages) * self.page_size]
                break
            freed += leaf.pages
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[: self.page_size]]
            leaf.alive = False
            if _is_evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        for page in freed:
            del self._owner[page]
        self._roots = {ns: root for ns, root in self._roots.items() if root.children}
        self.evicted_pages += len(freed)
        return freed

    def reset(self) -> list[int]:
        """Drop every node, pins included; returns all tree pages for the caller to free.

        Raises RuntimeError while a node is locked (a running request still reads its pages).
        """
        if any(n.lock_ref for root in self._roots.values() for n in _subtree(root)):
            raise RuntimeError("cannot reset the radix tree while requests hold locks")
        freed = list(self._owner)
        for root in self._roots.values():
            for node in _subtree(root):
                node.alive = False
        self._roots.clear()
        self._owner.clear()
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

    # -- internals -------------------------------------------------------------------------

    def _full_pages(self, tokens: Sequence[int]) -> tuple[int, ...]:
        return tuple(tokens[: len(tokens) - len(tokens) % self.page_size])

    def _walk(self, root: RadixNode, key: tuple[int, ...]) -> tuple[RadixNode, int, list[int]]:
        """Follow `key` down from `root`, splitting where it diverges mid-node; touch the path.

        Returns the deepest matching node, the matched token count and the matched pages.
        """
        ps = self.page_size
        self._clock += 1
        node, pos = root, 0
        pages: list[int] = []
        while pos < len(key):
            child = node.children.get(key[pos : pos + ps])
            if child is None:
                break
            n = 0
            limit = min(len(child.key), len(key) - pos)
            while n < limit and child.key[n] == key[pos + n]:
                n += 1
            n -= n % ps  # >= ps: the first page matched through the children dict
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = self._clock
            pages += child.pages
            node, pos = child, pos + n
        return node, pos, pages

    def _split(self, node: RadixNode, n: int) -> RadixNode:
        """Cut `node` after `n` tokens; the new upper part is returned, `node` keeps the rest.

        `node` stays the same object, so locks held on it still end at the same page.
        """
        parent = node.parent
        assert parent is not None
        ps = self.page_size
        upper = RadixNode(node.key[:n], node.pages[: n // ps], parent, node.last_access)
        upper.lock_ref, upper.pin_ref = node.lock_ref, node.pin_ref
        parent.children[upper.key[:ps]] = upper
        node.key, node.pages, node.parent = node.key[n:], node.pages[n // ps :], upper
        upper.children[node.key[:ps]] = node
        self._owner.update(dict.fromkeys(upper.pages, upper))
        return upper

    def _adjust(self, node: RadixNode, count: str, delta: int) -> None:
        """Add `delta` to `count` ("lock_ref" or "pin_ref") from `node` up to the root."""
        if not node.alive:
            raise ValueError("node was evicted or reset; lock right after match/insert")
        if delta < 0 and node.parent is not None and getattr(node, count) == 0:
            raise ValueError(f"{count.removesuffix('_ref')} count would go below zero")
        while node.parent is not None:  # the root is never evicted: not counted
            was = node.protected
            setattr(node, count, getattr(node, count) + delta)
            if was != node.protected:
                self._protected_pages += len(node.pages) if node.protected else -len(node.pages)
            node = node.parent


def _subtree(root: RadixNode) -> Iterator[RadixNode]:
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def _is_evictable_leaf(node: RadixNode) -> bool:
    return node.parent is not None and not node.children and not node.protected
