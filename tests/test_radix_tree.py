"""Radix-tree prefix store: unit tests, then a hypothesis state machine against a page allocator."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from sessions.radix_tree import InsertResult, RadixNode, RadixTree

A = ("tenant-a", None)
B = ("tenant-b", None)
A_LORA = ("tenant-a", "lora-1")


def test_match_empty_tree() -> None:
    tree = RadixTree(page_size=4)
    m = tree.match(A, list(range(10)))
    assert (m.num_tokens, m.pages) == (0, [])
    tree.lock(m.last_node)  # locking the root is allowed and protects nothing
    tree.unlock(m.last_node)
    assert tree.cached_pages == tree.evictable_pages == 0
    assert (tree.hit_tokens, tree.miss_tokens) == (0, 10)


def test_insert_then_match() -> None:
    tree = RadixTree(page_size=2)
    res = tree.insert(A, [1, 2, 3, 4, 5, 6], [10, 11, 12])
    assert res == InsertResult(0, [10, 11, 12], [], res.last_node)
    assert tree.cached_pages == 3
    m = tree.match(A, [1, 2, 3, 4, 5, 6, 7, 8])
    assert (m.num_tokens, m.pages, m.last_node) == (6, [10, 11, 12], res.last_node)
    assert tree.match(A, [1, 2, 3]).pages == [10]
    assert tree.match(A, [2, 2]).pages == []


def test_partial_page_tail_ignored() -> None:
    tree = RadixTree(page_size=4)
    res = tree.insert(A, list(range(10)), [7, 8, 9])  # 2 full pages; page 9 holds the tail
    assert res.pages == [7, 8] and tree.cached_pages == 2
    assert tree.match(A, list(range(10))).num_tokens == 8
    assert tree.match(A, list(range(7))).num_tokens == 4
    with pytest.raises(ValueError):
        tree.insert(B, list(range(8)), [1])  # too few page ids


def test_split_on_partial_match() -> None:
    tree = RadixTree(page_size=2)
    first = tree.insert(A, [1, 2, 3, 4, 5, 6], [10, 11, 12])
    m = tree.match(A, [1, 2, 3, 4, 9, 9])  # diverges at a page boundary
    assert (m.num_tokens, m.pages) == (4, [10, 11])
    assert m.last_node.pages == [10, 11] and m.last_node.children
    res = tree.insert(A, [1, 2, 3, 9, 9, 9], [20, 21, 22])  # diverges inside page 2
    assert res.num_cached == 2 and res.pages == [10, 21, 22] and res.duplicates == [20]
    assert tree.match(A, [1, 2, 3, 4, 5, 6]).pages == [10, 11, 12]
    assert tree.match(A, [1, 2, 3, 9, 9, 9]).pages == [10, 21, 22]
    assert first.last_node.pages == [12]  # the original node object keeps the tail
    assert tree.cached_pages == 5


def test_insert_duplicates_and_shared_pages() -> None:
    tree = RadixTree(page_size=1)
    tree.insert(A, [1, 2], [10, 11])
    # pages it got from match (10, 11) move nowhere; its own copy of a cached page comes back
    res = tree.insert(A, [1, 2, 3], [10, 11, 12])
    assert (res.num_cached, res.pages, res.duplicates) == (2, [10, 11, 12], [])
    res = tree.insert(A, [1, 2, 3, 4], [30, 11, 31, 32])
    assert (res.pages, res.duplicates) == ([10, 11, 12, 32], [30, 31])
    with pytest.raises(ValueError):  # page 10 already holds A's [1]
        tree.insert(B, [1], [10])
    with pytest.raises(ValueError):
        tree.insert(B, [1, 2], [40, 40])
    assert sorted(p for _, p in tree.iter_pages()) == [10, 11, 12, 32]


def test_namespaces_isolated() -> None:
    tree = RadixTree(page_size=2)
    tree.insert(A, [1, 2, 3, 4], [1, 2])
    assert tree.match(B, [1, 2, 3, 4]).num_tokens == 0
    assert tree.match(A_LORA, [1, 2, 3, 4]).num_tokens == 0
    res = tree.insert(A_LORA, [1, 2, 3, 4], [3, 4])
    assert res.duplicates == [] and res.pages == [3, 4]
    assert tree.match(A, [1, 2, 3, 4]).pages == [1, 2]
    assert sorted(tree.iter_pages(), key=lambda x: x[1]) == [
        (A, 1),
        (A, 2),
        (A_LORA, 3),
        (A_LORA, 4),
    ]


def test_lock_prevents_eviction() -> None:
    tree = RadixTree(page_size=1)
    tree.insert(A, [1, 2, 3], [1, 2, 3])
    tree.insert(A, [1, 5], [1, 5])
    m = tree.match(A, [1, 2, 3])
    tree.lock(m.last_node)
    assert (tree.protected_pages, tree.evictable_pages) == (3, 1)
    assert tree.evict(10).device == [5]
    assert tree.match(A, [1, 2, 3]).pages == [1, 2, 3]
    tree.unlock(m.last_node)
    assert sorted(tree.evict(10).device) == [1, 2, 3] and tree.cached_pages == 0
    with pytest.raises(ValueError):
        tree.lock(m.last_node)  # evicted
    with pytest.raises(ValueError):
        tree.unlock(tree.insert(A, [1], [1]).last_node)  # never locked


def test_lru_order_of_eviction() -> None:
    tree = RadixTree(page_size=2)
    tree.insert(A, [0, 0, 1, 1], [1, 2])
    tree.insert(B, [0, 0, 2, 2], [3, 4])
    tree.insert(A, [0, 0, 3, 3, 3, 3], [1, 5, 6])
    tree.match(A, [0, 0, 1, 1])  # [1, 2] becomes the most recent
    assert tree.evict(1).device == [4]  # B's node is the oldest leaf: it loses its tail page
    assert tree.evict(1).device == [3]
    assert tree.evict(1).device == [6]  # then A's [5, 6], older than A's [2]
    assert tree.match(A, [0, 0, 3, 3, 3, 3])[:2] == (4, [1, 5])
    assert tree.evict(2).device == [2, 5]  # the match above made [5] the newest
    assert tree.evict(5).device == [1] and tree.evicted_pages == 6


def test_pinned_never_evicted() -> None:
    tree = RadixTree(page_size=2)
    session = tree.insert(A, [1, 1, 2, 2], [1, 2]).last_node
    tree.pin(session)
    tree.insert(A, [1, 1, 2, 2, 3, 3], [1, 2, 3])
    tree.insert(B, [1, 1], [4])
    assert sorted(tree.evict(10).device) == [3, 4]
    assert tree.cached_pages == tree.protected_pages == 2
    tree.lock(session)
    with pytest.raises(RuntimeError):
        tree.reset()
    tree.unlock(session)
    assert sorted(tree.reset().device) == [1, 2] and tree.cached_pages == 0
    with pytest.raises(ValueError):
        tree.unpin(session)


# -- property tests: a tree, a free list and running requests never lose or share a page ----

NAMESPACES = [A, A_LORA, B]
POOL = 32
# shared heads (system prompts) and short binary tails make prefixes collide often
HEADS = [(), (0, 0, 0, 0, 0, 0), (0, 1, 0, 1), (1, 1, 1, 1, 1, 1, 1, 1)]
TOKENS = st.builds(
    lambda head, tail: [*head, *tail],
    st.sampled_from(HEADS),
    st.lists(st.integers(0, 1), max_size=6),
)


@dataclass
class Req:
    ns: Hashable
    tokens: list[int]
    table: list[int]  # its page table: full pages, then a page for the partial tail
    own: set[int]  # the pages it owns; the rest of `table` is lent by the tree
    node: RadixNode  # locked
    committed: int  # full pages the locked path covers


class TreeMachine(RuleBasedStateMachine):
    page_size = 2

    def __init__(self) -> None:
        super().__init__()
        self.tree = RadixTree(self.page_size)
        self.free = list(range(POOL))
        self.reqs: list[Req] = []
        self.pins: list[tuple[RadixNode, list[int]]] = []
        self.ref: dict[tuple[Hashable, tuple[int, ...]], int] = {}  # (ns, page prefix) -> page

    def key(self, ns: Hashable, tokens: list[int], i: int) -> tuple[Hashable, tuple[int, ...]]:
        return ns, tuple(tokens[: (i + 1) * self.page_size])

    def check_match(self, ns: Hashable, tokens: list[int]) -> tuple[RadixNode, list[int]]:
        m = self.tree.match(ns, tokens)
        assert m.num_tokens == len(m.pages) * self.page_size
        assert m.pages == [self.ref[self.key(ns, tokens, i)] for i in range(len(m.pages))]
        if m.num_tokens + self.page_size <= len(tokens):
            assert self.key(ns, tokens, len(m.pages)) not in self.ref  # longest
        return m.last_node, m.pages

    def release(self, pages: list[int]) -> None:
        assert not set(pages) & set(self.free), "double free"
        assert len(set(pages)) == len(pages)
        self.free += pages

    def do_evict(self, n: int) -> None:
        before = self.tree.evictable_pages
        freed = self.tree.evict(n).device
        assert len(freed) == min(n, before)
        in_use = {p for r in self.reqs for p in r.table} | {p for _, ps in self.pins for p in ps}
        assert not set(freed) & in_use, "evicted a locked or pinned page"
        self.release(freed)
        self.ref = {k: p for k, p in self.ref.items() if p not in set(freed)}

    @initialize(warm=st.lists(st.tuples(st.sampled_from(NAMESPACES), TOKENS), max_size=5))
    def warm_up(self, warm: list[tuple[Hashable, list[int]]]) -> None:
        """Finished requests, so that the tree holds something from the first step."""
        for ns, tokens in warm:
            if req := self.start_one(ns, tokens):
                self.insert_req(req, len(tokens) // self.page_size)
                self.abort_req(req)

    @rule(ns=st.sampled_from(NAMESPACES), tokens=TOKENS, copies=st.integers(1, 3))
    def start(self, ns: Hashable, tokens: list[int], copies: int) -> None:
        """`copies` identical requests admitted together: none sees the others' pages."""
        for _ in range(copies):
            self.start_one(ns, tokens)

    def start_one(self, ns: Hashable, tokens: list[int]) -> Req | None:
        node, pages = self.check_match(ns, tokens)
        self.tree.lock(node)
        need = -(-len(tokens) // self.page_size) - len(pages)
        if need > len(self.free):
            self.do_evict(need - len(self.free))
        if need > len(self.free):
            self.tree.unlock(node)
            return None
        new = [self.free.pop() for _ in range(need)]
        self.reqs.append(Req(ns, list(tokens), pages + new, set(new), node, len(pages)))
        return self.reqs[-1]

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), finish=st.booleans(), session=st.booleans())
    def insert(self, data: st.DataObject, finish: bool, session: bool) -> None:
        """A prefill chunk (the request goes on) or the end of the request (a session pins)."""
        req = self.reqs[data.draw(st.integers(0, len(self.reqs) - 1))]
        n_full = len(req.tokens) // self.page_size
        res = self.insert_req(
            req, n_full if finish else data.draw(st.integers(req.committed, n_full))
        )
        if finish:
            if session:
                self.tree.pin(res.last_node)
                self.pins.append((res.last_node, res.pages))
            self.abort_req(req)

    def insert_req(self, req: Req, k: int) -> InsertResult:
        """Insert the first `k` full pages; the request keeps running on the tree's pages."""
        res = self.tree.insert(req.ns, req.tokens[: k * self.page_size], req.table)
        assert len(res.pages) == k and res.num_cached % self.page_size == 0
        for i, page in enumerate(res.pages):
            key = self.key(req.ns, req.tokens, i)
            if key not in self.ref:
                assert page == req.table[i] and page in req.own
                self.ref[key] = page
                req.own.remove(page)  # the tree took it
            assert self.ref[key] == page
        dups = [t for t, p in zip(req.table, res.pages, strict=False) if t != p]
        assert res.duplicates == dups and set(dups) <= req.own
        req.own -= set(dups)
        self.release(dups)
        req.table[:k] = res.pages
        self.tree.lock(res.last_node)
        self.tree.unlock(req.node)
        req.node, req.committed = res.last_node, k
        return res

    def abort_req(self, req: Req) -> None:
        self.tree.unlock(req.node)
        self.release(sorted(req.own))
        self.reqs.remove(req)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self.abort_req(self.reqs[data.draw(st.integers(0, len(self.reqs) - 1))])

    @rule(ns=st.sampled_from(NAMESPACES), tokens=TOKENS)
    def lookup(self, ns: Hashable, tokens: list[int]) -> None:
        self.check_match(ns, tokens)

    @precondition(lambda self: self.ref)
    @rule(data=st.data(), tail=st.lists(st.integers(0, 1), max_size=4))
    def lookup_cached(self, data: st.DataObject, tail: list[int]) -> None:
        ns, prefix = data.draw(st.sampled_from(sorted(self.ref, key=repr)))
        self.check_match(ns, [*prefix, *tail])

    @rule(n=st.integers(0, 5) | st.just(POOL))
    def evict(self, n: int) -> None:
        self.do_evict(n)

    @rule(ns=st.sampled_from(NAMESPACES), tokens=TOKENS)
    def pin(self, ns: Hashable, tokens: list[int]) -> None:
        node, pages = self.check_match(ns, tokens)
        self.tree.pin(node)
        self.pins.append((node, pages))

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        node, _ = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        self.tree.unpin(node)

    @precondition(lambda self: not self.reqs)
    @rule()
    def reset(self) -> None:
        self.release(self.tree.reset().device)
        self.pins.clear()
        self.ref.clear()

    @invariant()
    def pages_conserved(self) -> None:
        tree_pages = list(self.tree.iter_pages())
        owned = [p for r in self.reqs for p in r.own]
        everything = [p for _, p in tree_pages] + owned + self.free
        assert sorted(everything) == list(range(POOL)), "leaked or doubly owned page"
        assert self.tree.cached_pages == len(tree_pages)
        # one namespace per page, and exactly the pages inserted for each prefix
        assert sorted(tree_pages, key=repr) == sorted(
            ((ns, p) for (ns, _), p in self.ref.items()), key=repr
        )
        for ns, prefix in self.ref:  # evicting leaves first keeps the cache prefix-closed
            assert len(prefix) == self.page_size or (ns, prefix[: -self.page_size]) in self.ref

    @invariant()
    def tables_read_the_right_pages(self) -> None:
        protected = {p for _, ps in self.pins for p in ps}
        for r in self.reqs:
            for i, page in enumerate(r.table[: r.committed]):
                assert self.ref[self.key(r.ns, r.tokens, i)] == page
            assert set(r.table[r.committed :]) <= r.own
            protected |= set(r.table[: r.committed])
        assert self.tree.protected_pages == len(protected)
        assert self.tree.evictable_pages == self.tree.cached_pages - len(protected)


class TreeMachinePage1(TreeMachine):
    page_size = 1


class TreeMachinePage3(TreeMachine):
    page_size = 3


TestTreeFuzz = TreeMachine.TestCase
TestTreeFuzzPage1 = TreeMachinePage1.TestCase
TestTreeFuzzPage3 = TreeMachinePage3.TestCase
for _case in (TestTreeFuzz, TestTreeFuzzPage1, TestTreeFuzzPage3):
    _case.settings = settings(
        max_examples=60,
        stateful_step_count=40,
        deadline=None,
        database=None,
        derandomize=True,  # the same cases every CI run (as tests/test_prefix_cache_fuzz.py)
        suppress_health_check=[HealthCheck.too_slow],
    )
del _case


def test_common_pages_equals_a_token_by_token_walk():
    """`Forest.walk`'s page comparison (slices, bisected) against the plain loop it replaced,
    for a divergence at every token of a 12-page node, keys shorter and longer than it."""
    from sessions.forest import _common_pages

    def loop(node_key, key, pos, ps):
        n, limit = 0, min(len(node_key), len(key) - pos)
        while n < limit and node_key[n] == key[pos + n]:
            n += 1
        return n - n % ps

    ps = 4
    node_key = tuple(range(100, 148))  # 12 pages
    for pos in (0, 8):
        for length in (4, 20, 48, 60):  # the key's pages from `pos` on
            same = tuple(range(7, 7 + pos)) + node_key[:length] + (999,) * (length - 48)
            keys = [same] + [same[: pos + d] + (-1,) + same[pos + d + 1 :]
                             for d in range(ps, min(length, 48))]  # first page always equal
            for key in keys:
                assert len(key) % ps == 0
                assert _common_pages(node_key, key, pos, ps) == loop(node_key, key, pos, ps)
