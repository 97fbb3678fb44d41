"""The radix tree's host tier: the calls that move host pages into and out of the tree.

With a host tier (engine/kv/host.py) a node's KV lives in device pages (`pages`), in pages of a
second, host-memory pool (`host_pages`), or in both (a host copy of device KV, written through
for sessions or left behind by a load). A `RadixTree` (radix_tree.py) owns one `HostTier`, its
`host`, over the same nodes (forest.py). Device pages stay the tree's business, and so does
`RadixTree.evict`, which takes host pages in through its `offload` hook and gives back those
of the nodes it drops.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator, Sequence

from sessions.forest import Forest, RadixNode, subtree


class HostTier:
    """The host half of a `RadixTree`: host-only nodes, and host copies of device nodes.

    Host pages change hands like device pages: `insert` and `set_copy` take them, `evict` (and
    the tree's `evict` and `reset`) give them back. A request that matches a host-only node
    loads it back to the device: `path`, then `promote`.
    """

    def __init__(self, forest: Forest) -> None:
        self._forest = forest

    @property
    def cached_pages(self) -> int:
        """Host pages the tree owns."""
        return len(self._forest.host_owner)

    def iter_pages(self) -> Iterator[tuple[Hashable, int]]:
        """(namespace, host page id) for every host page the tree owns."""
        for namespace, root in self._forest.roots.items():
            for node in subtree(root):
                for page in node.host_pages:
                    yield namespace, page

    def path(self, namespace: Hashable, tokens: Sequence[int]) -> list[RadixNode]:
        """The host-only nodes on the longest cached prefix of `tokens`, root side first: the
        part of a match that `promote` must bring back to the device first. Moves nothing."""
        if not self._forest.host_owner:
            return []
        path, _ = self._forest.walk(namespace, tokens)
        return [n for n in path if n.host_only]

    def insert(self, namespace: Hashable, tokens: Sequence[int], start: int,
               host_pages: list[int]) -> list[int]:
        """Cache host pages (read from disk) for full pages `start ..` of `tokens`, below the
        tree's path for the pages before them, as a host-only leaf. Returns the host pages the
        tree did not take (it already holds those positions, or no longer holds the path up
        to `start`): the caller frees them."""
        forest = self._forest
        ps = forest.page_size
        end = start + len(host_pages)
        key = forest.full_pages(tokens)[: end * ps]
        if start * ps > len(key) or any(p in forest.host_owner for p in host_pages):
            raise ValueError("host.insert takes host pages the tree does not own, in range")
        root = forest.roots.setdefault(namespace, RadixNode((), [], None))
        path, pos = forest.walk(namespace, key)
        have = pos // ps
        if have < start or have >= end:
            forest.prune_roots()
            return list(host_pages)
        parent = path[-1] if path else root
        leaf = RadixNode(key[pos:], [], parent, forest.clock, host_pages=host_pages[have - start :])
        parent.children[leaf.key[:ps]] = leaf
        forest.host_owner.update(dict.fromkeys(leaf.host_pages, leaf))
        return host_pages[: have - start]

    def promote(self, nodes: list[RadixNode], pages: list[int]) -> None:
        """Give host-only `nodes` (from `path`, in order) the device `pages` the caller is
        loading their KV into, in order; the tree takes them. Their host copies stay."""
        if len(pages) != sum(len(n.host_pages) for n in nodes):
            raise ValueError("promote needs one device page per host page")
        i = 0
        for n in nodes:
            if not n.host_only or not n.alive:
                raise ValueError("promote takes live host-only nodes")
            self._forest.set_pages(n, pages[i : i + len(n.host_pages)])
            i += len(n.host_pages)

    def evict(self, num_pages: int, keep: RadixNode | None = None) -> list[int]:
        """Free at least `num_pages` host pages (whole nodes), least recently used first: the
        host copies of unprotected device nodes, and unprotected host-only leaves (a parent left
        childless follows). `keep` and its ancestors keep theirs. Returns the freed host page
        ids (fewer when too few are free to go)."""
        forest = self._forest
        keep_path = set(_path(keep)) if keep is not None else set()
        order = itertools.count()
        heap = [
            (n.last_access, next(order), n)
            for root in forest.roots.values()
            for n in subtree(root)
            if n not in keep_path and _evictable(n)
        ]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_pages:
            _, _, node = heapq.heappop(heap)
            if not _evictable(node):
                continue
            parent = node.parent
            assert parent is not None
            if node.host_only:
                freed += forest.drop(node)
                if parent not in keep_path and _evictable(parent) and parent.host_only:
                    heapq.heappush(heap, (parent.last_access, next(order), parent))
            else:
                freed += node.host_pages
                forest.set_host_pages(node, [])
        forest.prune_roots()
        return freed

    def set_copy(self, node: RadixNode, host_pages: list[int]) -> None:
        """Record that `host_pages` (taken from the caller) now hold a copy of device node
        `node`'s KV: its write-through or its offload ahead of eviction."""
        if node.host_pages or not node.pages or len(host_pages) != len(node.pages):
            raise ValueError("a host copy is one host page per device page of a device node")
        if any(p in self._forest.host_owner for p in host_pages):
            raise ValueError("a host page given is already owned by the tree")
        self._forest.set_host_pages(node, list(host_pages))


def _path(node: RadixNode) -> Iterator[RadixNode]:
    while node.parent is not None:
        yield node
        node = node.parent


def _evictable(node: RadixNode) -> bool:
    """Holds host pages that may go: a device node's copy, or a host-only leaf."""
    return (node.alive and bool(node.host_pages) and not node.protected
            and (not node.host_only or not node.children))
