"""The radix tree's nodes: one tree of `RadixNode`s per namespace, and which node holds each
device and host page.

`Forest` holds the shape that `RadixTree` (radix_tree.py) and its host tier (host_tier.py) both
work on, with the operations that keep the page -> node maps in step with the nodes (walk and
split, page swaps, drops). It decides nothing: which pages to take, keep or give back is
theirs.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field


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


class Forest:
    """Every namespace's root, the page -> node maps of both tiers, and the LRU clock."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.roots: dict[Hashable, RadixNode] = {}
        self.owner: dict[int, RadixNode] = {}  # device page id -> the node holding it
        self.host_owner: dict[int, RadixNode] = {}  # host page id -> the node holding it
        self.clock = 0

    def root(self, namespace: Hashable) -> RadixNode:
        root = self.roots.get(namespace)
        # Not stored: an unknown namespace stays unknown.
        return root if root is not None else RadixNode((), [], None)

    def full_pages(self, tokens: Sequence[int]) -> tuple[int, ...]:
        return tuple(tokens[: len(tokens) - len(tokens) % self.page_size])

    def walk(self, namespace: Hashable, tokens: Sequence[int]) -> tuple[list[RadixNode], int]:
        """Follow `tokens`' full pages down from the namespace's root, splitting where they
        diverge mid-node; touch the path. Returns the matching nodes (root excluded) and the
        matched token count."""
        ps = self.page_size
        key = self.full_pages(tokens)
        self.clock += 1
        node, pos, path = self.root(namespace), 0, []
        while pos < len(key):
            child = node.children.get(key[pos : pos + ps])
            if child is None:
                break
            n = _common_pages(child.key, key, pos, ps)
            if n < len(child.key):
                child = self.split(child, n)
            child.last_access = self.clock
            path.append(child)
            node, pos = child, pos + n
        return path, pos

    def split(self, node: RadixNode, n: int) -> RadixNode:
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
        self.owner.update(dict.fromkeys(upper.pages, upper))
        self.host_owner.update(dict.fromkeys(upper.host_pages, upper))
        return upper

    def set_pages(self, node: RadixNode, pages: list[int]) -> None:
        """Replace an unprotected node's device pages (promote, or drop to the host copy)."""
        assert not node.protected, "a protected node keeps its device pages"
        for p in node.pages:
            if self.owner.get(p) is node:
                del self.owner[p]
        node.pages = pages
        self.owner.update(dict.fromkeys(pages, node))

    def set_host_pages(self, node: RadixNode, pages: list[int]) -> None:
        for p in node.host_pages:
            del self.host_owner[p]
        node.host_pages = pages
        self.host_owner.update(dict.fromkeys(pages, node))

    def drop(self, node: RadixNode) -> list[int]:
        """Remove unprotected `node` and its subtree (host-only: the invariant); return their
        host pages. The caller gives back `node`'s device pages itself."""
        parent = node.parent
        assert parent is not None and not node.protected
        del parent.children[node.key[: self.page_size]]
        host: list[int] = []
        for n in subtree(node):
            n.alive = False
            host += n.host_pages
            for p in n.host_pages:
                del self.host_owner[p]
        return host

    def prune_roots(self) -> None:
        self.roots = {ns: root for ns, root in self.roots.items() if root.children}

    def clear(self) -> None:
        """Drop every node and forget every page (the caller has listed them)."""
        for root in self.roots.values():
            for node in subtree(root):
                node.alive = False
        self.roots.clear()
        self.owner.clear()
        self.host_owner.clear()


def subtree(root: RadixNode) -> Iterator[RadixNode]:
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def _common_pages(node_key: tuple[int, ...], key: tuple[int, ...], pos: int, ps: int) -> int:
    """Tokens in the whole pages `node_key` shares with `key[pos:]`, given that the first page
    matches (the children dict found it); both are whole pages. Slices compare in C: a
    session's history matches its node in one comparison (a token-by-token loop took 0.4 ms
    over 4k tokens on this project's 2-core CPU), a divergence is found by bisecting over
    pages."""
    limit = min(len(node_key), len(key) - pos)
    if node_key[:limit] == key[pos : pos + limit]:
        return limit
    lo, hi = 1, limit // ps - 1  # pages known equal, pages that may be
    while lo < hi:  # the longest equal prefix of pages: equality of prefixes is monotone
        mid = (lo + hi + 1) // 2
        if node_key[lo * ps : mid * ps] == key[pos + lo * ps : pos + mid * ps]:
            lo = mid
        else:
            hi = mid - 1
    return lo * ps
