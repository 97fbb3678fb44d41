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
`evict`'s `offload` hook hands them in, `evict_host`, `evict` and `reset` give them back.
Evicting a device leaf then keeps the node with its KV on the host; a request that matches it
loads it back (`host_path`, then `promote`). Invariant: a namespace's device-resident nodes
form a subtree at its root (children lose their device pages before their parent), so a
match is a device prefix followed by host-only nodes, and protected nodes are on the device.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass(eq=False, slots=True)
class RadixNode:
    """A run of full pages: `key` holds len(pages) * page_size tokens. The root has none."""

    key: tuple[int, ...]
    pages: list[int]  # device pages; [] while the KV is on the host only
    parent: RadixNode | None = field(repr=False)
    last_access: int = 0  # LRU clock tick of the last match/insert through this node
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict, repr=False)
    lock_ref: int = 0  # running requests using this node or a descendant
    pin_ref: int = 0  # sessions keeping this node or a descendant between turns
    alive: bool = True  # False once evicted or reset
    host_pages: list[int] = field(default_factory=list)  # host-tier copy; [] when none

    @property
    def protected(self) -> bool:
        return self.lock_ref > 0 or self.pin_ref > 0

    @property
    def host_only(self) -> bool:
        return not self.pages and self.parent is not None


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
        self._roots: dict[Hashable, RadixNode] = {}
        self._owner: dict[int, RadixNode] = {}  # device page id -> the node holding it
        self._host_owner: dict[int, RadixNode] = {}  # host page id -> the node holding it
        self._protected_pages = 0
        self._clock = 0
        self.hit_tokens = 0
        self.miss_tokens = 0
        self.evicted_pages = 0  # device pages evicted (dropped or moved to the host)
        self.offloaded_pages = 0  # of those, moved to the host

    # -- queries ---------------------------------------------------------------------------

    @property
    def cached_pages(self) -> int:
        """Device pages the tree owns."""
        return len(self._owner)

    @property
    def host_pages(self) -> int:
        """Host pages the tree owns."""
        return len(self._host_owner)

    @property
    def protected_pages(self) -> int:
        """Tree pages on a locked or pinned path: never evicted."""
        return self._protected_pages

    @property
    def evictable_pages(self) -> int:
        """Device pages `evict` could free now (every unprotected node becomes a leaf in time)."""
        return len(self._owner) - self._protected_pages

    def iter_pages(self) -> Iterator[tuple[Hashable, int]]:
        """(namespace, page id) for every device page the tree owns, for metrics and checks."""
        for namespace, root in self._roots.items():
            for node in _subtree(root):
                for page in node.pages:
                    yield namespace, page

    def iter_host_pages(self) -> Iterator[tuple[Hashable, int]]:
        """(namespace, host page id) for every host page the tree owns."""
        for namespace, root in self._roots.items():
            for node in _subtree(root):
                for page in node.host_pages:
                    yield namespace, page

    def match(self, namespace: Hashable, tokens: Sequence[int]) -> MatchResult:
        """Longest full-page prefix of `tokens` in `namespace` whose KV is on the device.

        Splits a node at the page boundary where the match ends, so `last_node`'s path holds
        exactly `pages`. Nothing changes hands: lock `last_node` before the next `evict`.
        Refreshes LRU recency and counts hit/miss tokens (so call it once per admission).
        """
        path, _ = self._walk(namespace, tokens)
        node, pages = self._root(namespace), []
        for n in path:
            if n.host_only:
                break
            node = n
            pages += n.pages
        pos = len(pages) * self.page_size
        self.hit_tokens += pos
        self.miss_tokens += len(tokens) - pos
        return MatchResult(pos, pages, node)

    def host_path(self, namespace: Hashable, tokens: Sequence[int]) -> list[RadixNode]:
        """The host-only nodes on the longest cached prefix of `tokens`, root side first: the
        part of a match that `promote` must bring back to the device first. Moves nothing."""
        if not self._host_owner:
            return []
        path, _ = self._walk(namespace, tokens)
        return [n for n in path if n.host_only]

    def cached_tokens(self, namespace: Hashable, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` the tree holds, on either tier. Moves nothing."""
        return self._walk(namespace, tokens)[1]

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
        key = self._full_pages(tokens)
        given = list(pages[: len(key) // self.page_size])
        if len(given) * self.page_size != len(key):
            raise ValueError(f"{len(key) // self.page_size} full pages need as many page ids")
        if len(set(given)) != len(given):
            raise ValueError("a page id is listed twice")
        self._roots.setdefault(namespace, RadixNode((), [], None))
        path, pos = self._walk(namespace, key)
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
        if any(p in self._owner for p in duplicates + rest + [p for _, ps in taken for p in ps]):
            raise ValueError("a page given to insert is already owned by the tree elsewhere")
        for n, n_pages in taken:
            self._set_pages(n, n_pages)
        node = path[-1] if path else self._roots[namespace]
        if rest:
            leaf = RadixNode(key[pos:], rest, node, self._clock)
            node.children[leaf.key[: self.page_size]] = leaf
            self._owner.update(dict.fromkeys(rest, leaf))
            node = leaf
        return InsertResult(pos, tree_pages + rest, duplicates, node)

    def insert_host(self, namespace: Hashable, tokens: Sequence[int], start: int,
                    host_pages: list[int]) -> list[int]:
        """Cache host pages (read from disk) for full pages `start ..` of `tokens`, below the
        tree's path for the pages before them, as a host-only leaf. Returns the host pages the
        tree did not take (it already holds those positions, or no longer holds the path up
        to `start`): the caller frees them."""
        ps = self.page_size
        end = start + len(host_pages)
        key = self._full_pages(tokens)[: end * ps]
        if start * ps > len(key) or any(p in self._host_owner for p in host_pages):
            raise ValueError("insert_host takes host pages the tree does not own, in range")
        root = self._roots.setdefault(namespace, RadixNode((), [], None))
        path, pos = self._walk(namespace, key)
        have = pos // ps
        if have < start or have >= end:
            self._prune_roots()
            return list(host_pages)
        parent = path[-1] if path else root
        leaf = RadixNode(key[pos:], [], parent, self._clock, host_pages=host_pages[have - start :])
        parent.children[leaf.key[:ps]] = leaf
        self._host_owner.update(dict.fromkeys(leaf.host_pages, leaf))
        return host_pages[: have - start]

    def promote(self, nodes: list[RadixNode], pages: list[int]) -> None:
        """Give host-only `nodes` (from `host_path`, in order) the device `pages` the caller is
        loading their KV into, in order; the tree takes them. Their host copies stay."""
        if len(pages) != sum(len(n.host_pages) for n in nodes):
            raise ValueError("promote needs one device page per host page")
        i = 0
        for n in nodes:
            if not n.host_only or not n.alive:
                raise ValueError("promote takes live host-only nodes")
            self._set_pages(n, pages[i : i + len(n.host_pages)])
            i += len(n.host_pages)

    def evict(self, num_pages: int, offload: Offload | None = None) -> Freed:
        """Free up to `num_pages` device pages, least recently used unprotected leaves of the
        device subtree first.

        A leaf larger than what is still needed is split and loses only its tail. A leaf whose
        KV has a host copy, or that `offload` copies to the host, stays in the tree on the
        host; any other is dropped with its (host-only) subtree. A parent whose children are
        all off the device becomes a candidate in turn. Returns the freed device pages (fewer
        than asked when too little is evictable) and host pages of dropped nodes.
        """
        order = itertools.count()  # tie-break, so nodes themselves are never compared
        heap = [
            (n.last_access, next(order), n)
            for root in self._roots.values()
            for n in _subtree(root)
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
                self._split(leaf, (len(leaf.pages) - take) * self.page_size)
            parent = leaf.parent
            assert parent is not None
            freed.device.extend(leaf.pages)
            host = leaf.host_pages or (offload(leaf) if offload is not None else None)
            if host:
                self._set_host_pages(leaf, host)
                self.offloaded_pages += len(leaf.pages)
                self._set_pages(leaf, [])
            else:
                freed.host.extend(self._drop(leaf))
            if _is_evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        for page in freed.device:
            self._owner.pop(page, None)
        self._prune_roots()
        self.evicted_pages += len(freed.device)
        return freed

    def evict_host(self, num_pages: int, keep: RadixNode | None = None) -> list[int]:
        """Free at least `num_pages` host pages (whole nodes), least recently used first: the
        host copies of unprotected device nodes, and unprotected host-only leaves (a parent left
        childless follows). `keep` and its ancestors keep theirs. Returns the freed host page
        ids (fewer when too few are free to go)."""
        keep_path = set(_path(keep)) if keep is not None else set()
        order = itertools.count()
        heap = [
            (n.last_access, next(order), n)
            for root in self._roots.values()
            for n in _subtree(root)
            if n not in keep_path and _host_evictable(n)
        ]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_pages:
            _, _, node = heapq.heappop(heap)
            if not _host_evictable(node):
                continue
            parent = node.parent
            assert parent is not None
            if node.host_only:
                freed += self._drop(node)
                if parent not in keep_path and _host_evictable(parent) and parent.host_only:
                    heapq.heappush(heap, (parent.last_access, next(order), parent))
            else:
                freed += node.host_pages
                self._set_host_pages(node, [])
        self._prune_roots()
        return freed

    def set_host_copy(self, node: RadixNode, host_pages: list[int]) -> None:
        """Record that `host_pages` (taken from the caller) now hold a copy of device node
        `node`'s KV: its write-through or its offload ahead of eviction."""
        if node.host_pages or not node.pages or len(host_pages) != len(node.pages):
            raise ValueError("a host copy is one host page per device page of a device node")
        if any(p in self._host_owner for p in host_pages):
            raise ValueError("a host page given is already owned by the tree")
        self._set_host_pages(node, list(host_pages))

    def reset(self) -> Freed:
        """Drop every node, pins included; returns all tree pages for the caller to free.

        Raises RuntimeError while a node is locked (a running request still reads its pages).
        """
        if any(n.lock_ref for root in self._roots.values() for n in _subtree(root)):
            raise RuntimeError("cannot reset the radix tree while requests hold locks")
        freed = Freed(list(self._owner), list(self._host_owner))
        for root in self._roots.values():
            for node in _subtree(root):
                node.alive = False
        self._roots.clear()
        self._owner.clear()
        self._host_owner.clear()
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

    def _root(self, namespace: Hashable) -> RadixNode:
        root = self._roots.get(namespace)
        # Not stored: an unknown namespace stays unknown.
        return root if root is not None else RadixNode((), [], None)

    def _full_pages(self, tokens: Sequence[int]) -> tuple[int, ...]:
        return tuple(tokens[: len(tokens) - len(tokens) % self.page_size])

    def _walk(self, namespace: Hashable, tokens: Sequence[int]) -> tuple[list[RadixNode], int]:
        """Follow `tokens`' full pages down from the namespace's root, splitting where they
        diverge mid-node; touch the path. Returns the matching nodes (root excluded) and the
        matched token count."""
        ps = self.page_size
        key = self._full_pages(tokens)
        self._clock += 1
        node, pos, path = self._root(namespace), 0, []
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
            path.append(child)
            node, pos = child, pos + n
        return path, pos

    def _split(self, node: RadixNode, n: int) -> RadixNode:
        """Cut `node` after `n` tokens; the new upper part is returned, `node` keeps the rest.

        `node` stays the same object, so locks held on it still end at the same page.
        """
        parent = node.parent
        assert parent is not None
        ps, k = self.page_size, n // self.page_size
        upper = RadixNode(node.key[:n], node.pages[:k], parent, node.last_access,
                          host_pages=node.host_pages[:k])
        upper.lock_ref, upper.pin_ref = node.lock_ref, node.pin_ref
        parent.children[upper.key[:ps]] = upper
        node.key, node.parent = node.key[n:], upper
        node.pages, node.host_pages = node.pages[k:], node.host_pages[k:]
        upper.children[node.key[:ps]] = node
        self._owner.update(dict.fromkeys(upper.pages, upper))
        self._host_owner.update(dict.fromkeys(upper.host_pages, upper))
        return upper

    def _set_pages(self, node: RadixNode, pages: list[int]) -> None:
        """Replace an unprotected node's device pages (promote, or drop to the host copy)."""
        assert not node.protected, "a protected node keeps its device pages"
        for p in node.pages:
            if self._owner.get(p) is node:
                del self._owner[p]
        node.pages = pages
        self._owner.update(dict.fromkeys(pages, node))

    def _set_host_pages(self, node: RadixNode, pages: list[int]) -> None:
        for p in node.host_pages:
            del self._host_owner[p]
        node.host_pages = pages
        self._host_owner.update(dict.fromkeys(pages, node))

    def _drop(self, node: RadixNode) -> list[int]:
        """Remove unprotected `node` and its subtree (host-only: the invariant); return their
        host pages. The caller gives back `node`'s device pages itself."""
        parent = node.parent
        assert parent is not None and not node.protected
        del parent.children[node.key[: self.page_size]]
        host: list[int] = []
        for n in _subtree(node):
            n.alive = False
            host += n.host_pages
            for p in n.host_pages:
                del self._host_owner[p]
        return host

    def _prune_roots(self) -> None:
        self._roots = {ns: root for ns, root in self._roots.items() if root.children}

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


def _subtree(root: RadixNode) -> Iterator[RadixNode]:
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def _path(node: RadixNode) -> Iterator[RadixNode]:
    while node.parent is not None:
        yield node
        node = node.parent


def _is_evictable_leaf(node: RadixNode) -> bool:
    """A leaf of the device subtree that nothing protects."""
    return (node.alive and node.parent is not None and bool(node.pages) and not node.protected
            and not any(c.pages for c in node.children.values()))


def _host_evictable(node: RadixNode) -> bool:
    """Holds host pages that may go: a device node's copy, or a host-only leaf."""
    return (node.alive and bool(node.host_pages) and not node.protected
            and (not node.host_only or not node.children))
