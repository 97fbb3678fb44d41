"""Sessions keep their KV pinned in the radix tree between turns, within a per-tenant budget.

Pure Python. Each session pins at most one node: the end of its latest turn's path (the
prompt plus the reply, full pages). Pinning a new turn unpins the previous one. When a tenant's
pinned pages exceed the budget, its least recently used sessions are unpinned until it fits:
their KV stays cached but becomes evictable. When the KV pool runs short, the least recently
used sessions of any tenant are unpinned too (`unpin_lru`): pins are a cache, and must never
keep a request from running. A session's history lives in the session store and is never
dropped here; a session whose KV is gone simply re-prefills.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from sessions.radix_tree import RadixNode, RadixTree


class _Pin(NamedTuple):
    tenant: str
    node: RadixNode
    num_pages: int  # pages on the path root -> node, counted for the tenant's budget


class SessionPins:
    def __init__(self, tree: RadixTree, budget_pages: int):
        self.tree = tree
        self.budget_pages = budget_pages
        self._pins: OrderedDict[str, _Pin] = OrderedDict()  # session id -> pin, LRU first
        self._used: dict[str, int] = {}  # tenant -> pinned pages

    @property
    def num_pages(self) -> int:
        return sum(self._used.values())

    def pages_of(self, tenant: str) -> int:
        return self._used.get(tenant, 0)

    def is_pinned(self, session_id: str) -> bool:
        return session_id in self._pins

    def pin(self, tenant: str, session_id: str, node: RadixNode) -> None:
        """Pin `node` (alive, e.g. locked by the finishing request) for `session_id`, as the
        tenant's most recent session; then unpin the tenant's LRU sessions over budget."""
        self.unpin(session_id)
        self.tree.pin(node)
        pin = _Pin(tenant, node, _path_pages(node))
        self._pins[session_id] = pin
        self._used[tenant] = self._used.get(tenant, 0) + pin.num_pages
        while self._used.get(tenant, 0) > self.budget_pages:
            lru = next(s for s, p in self._pins.items() if p.tenant == tenant)
            self.unpin(lru)

    def unpin(self, session_id: str) -> None:
        pin = self._pins.pop(session_id, None)
        if pin is None:
            return
        self.tree.unpin(pin.node)
        left = self._used[pin.tenant] - pin.num_pages
        if left:
            self._used[pin.tenant] = left
        else:
            del self._used[pin.tenant]

    def unpin_lru(self) -> bool:
        """Unpin the least recently used session of any tenant (the pool ran short); False
        when no session is pinned."""
        if not self._pins:
            return False
        self.unpin(next(iter(self._pins)))
        return True

    def clear(self) -> None:
        """Forget every pin without touching the tree (after `RadixTree.reset`)."""
        self._pins.clear()
        self._used.clear()


def _path_pages(node: RadixNode) -> int:
    n = 0
    while node.parent is not None:
        n += len(node.pages)
        node = node.parent
    return n
