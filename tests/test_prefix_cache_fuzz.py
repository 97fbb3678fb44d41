"""Property tests one level above tests/test_radix_tree.py: the page allocator, the prefix cache
and the scheduler driven together by random traffic (several tenants and adapters, shared
prompt heads, sessions, chunked prefill, preemption on a small pool, aborts, session ends,
resets). After every step: each page is free or owned by exactly one party (the tree or one
request), no page is freed twice, a request reads only KV computed for its own namespace and
its own tokens, and it writes only into pages it owns. Pure Python, milliseconds per case."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.core.request import Request, Status
from engine.core.scheduler import Scheduler
from engine.kv.page_allocator import OutOfPagesError, PageAllocator
from engine.kv.prefix_cache import PrefixCache
from engine.kv.tiers import CopyStats
from engine.sampling.params import SamplingParams

POOL = 12  # the largest request fits alone, not beside every session pin of both tenants
DRAIN_STEPS = 500
SESSION_PAGES = 4  # per tenant
# (tenant, adapter, adapter_uid): uid 2 is "x" deleted and uploaded again, another adapter
NAMESPACES = [("a", None, 0), ("a", "x", 1), ("a", "x", 2), ("b", None, 0)]
HEADS = [(), (5, 5, 5, 5, 5, 5), (5, 5, 5, 5, 6, 6, 6, 6), (7, 7, 7, 7, 7, 7, 7, 7, 7)]
PROMPTS = st.builds(lambda head, tail: [*head, *tail], st.sampled_from(HEADS),
                    st.lists(st.integers(0, 2), min_size=1, max_size=6))


class TrackingAllocator(PageAllocator):
    """The real allocator, plus the set of pages out of it (to compare with their owners)."""

    def __init__(self, num_pages: int):
        super().__init__(num_pages)
        self.out: set[int] = set()

    def allocate(self, n: int) -> list[int]:
        pages = super().allocate(n)
        assert not self.out & set(pages), "handed out a page that is in use"
        self.out |= set(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        super().free(pages)  # raises on a double free
        self.out -= set(pages)


class CacheMachine(RuleBasedStateMachine):
    page_size = 2
    budget = 6  # tokens per step: long prompts take several chunks

    def __init__(self) -> None:
        super().__init__()
        self.alloc = TrackingAllocator(POOL)
        self.kv: dict[int, tuple[Hashable, tuple[int, ...]]] = {}  # page -> (namespace, tokens)
        self.host = self.make_host()
        self.cache = PrefixCache(self.alloc, self.page_size, session_pages=SESSION_PAGES,
                                 host=self.host)
        self.sched = Scheduler(self.alloc, self.page_size, 4, self.budget, cache=self.cache)
        self.ids = itertools.count()

    def make_host(self) -> HostContents | None:
        return None

    @property
    def live(self) -> list[Request]:
        return list(self.sched.requests())

    @rule(ns=st.sampled_from(NAMESPACES), prompt=PROMPTS, max_tokens=st.integers(1, 8),
          session=st.sampled_from([None, "s1", "s2"]))
    def add(self, ns: tuple, prompt: list[int], max_tokens: int, session: str | None) -> None:
        tenant, adapter, uid = ns
        req = Request(f"r{next(self.ids)}", prompt, SamplingParams(max_tokens=max_tokens,
                      adapter=adapter), tenant, session_id=session and f"{tenant}-{session}")
        req.adapter_uid = uid
        self.sched.add(req)

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(data=st.data(), steps=st.integers(1, 4))
    def run(self, data: st.DataObject, steps: int) -> None:
        for _ in range(steps):
            self.step(lambda: data.draw(st.integers(0, 2)))

    @precondition(lambda self: self.sched.has_unfinished())
    @rule()
    def drain(self) -> None:
        """Whatever is pinned or cached, every request finishes: nothing waits forever."""
        for _ in range(DRAIN_STEPS):
            if not self.sched.has_unfinished():
                return
            self.step(lambda: 0)
        raise AssertionError(f"stuck: {[(r.request_id, r.status) for r in self.live]}")

    def step(self, sample: Callable[[], int]) -> None:
        """One engine step: the "forward" writes each scheduled token's KV into its page."""
        batch = self.sched.schedule()
        for seq in batch.seqs:
            req = seq.request
            for pos in range(seq.start, seq.start + seq.num_new_tokens):
                index = pos // self.page_size
                assert index >= req.num_cached_pages, "wrote into a page the tree owns"
                self.kv[req.pages[index]] = (req.namespace, tuple(req.token_ids[: pos + 1]))
        sampled = {s.request: sample() for s in batch.seqs if s.samples}
        self.sched.update(batch, sampled)
        for req in self.live:
            if req.num_output_tokens >= req.params.max_tokens:
                self.sched.finish(req, "length")

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self.sched.finish(data.draw(st.sampled_from(self.live)), "abort")

    @rule(tenant=st.sampled_from(["a", "b"]), session=st.sampled_from(["s1", "s2"]))
    def end_session(self, tenant: str, session: str) -> None:
        self.cache.release_session(f"{tenant}-{session}")

    @precondition(lambda self: not self.sched.has_unfinished())
    @rule()
    def reset(self) -> None:
        self.cache.reset()
        assert self.alloc.num_used == 0 and not self.alloc.out

    @invariant()
    def every_page_has_one_owner(self) -> None:
        tree = list(self.cache.tree.iter_pages())
        own = [p for r in self.live for p in r.pages[r.num_cached_pages :]]
        owned = [p for _, p in tree] + own
        assert len(owned) == len(set(owned)), "a page has two owners"
        assert set(owned) == self.alloc.out, "a page leaked or was freed while owned"
        assert self.alloc.num_used == len(owned)
        assert all(not r.pages for r in self.live if r.status is Status.WAITING)

    @invariant()
    def kv_never_crosses_namespaces(self) -> None:
        tree = dict((p, ns) for ns, p in self.cache.tree.iter_pages())
        for ns_page in tree.items():
            page, ns = ns_page
            assert self.kv[page][0] == ns, "the tree keeps a page under another namespace"
        for r in self.live:
            for i, page in enumerate(r.pages):
                if i < r.num_cached_pages:
                    assert tree.get(page) == r.namespace, "lent a page of another namespace"
                if (i + 1) * self.page_size <= r.num_computed_tokens:  # a full computed page
                    want = (r.namespace, tuple(r.token_ids[: (i + 1) * self.page_size]))
                    assert self.kv[page] == want, "reads KV computed for something else"

    @invariant()
    def sessions_within_budget(self) -> None:
        assert all(self.cache.pins.pages_of(t) <= SESSION_PAGES for t in ("a", "b"))
        assert self.cache.tree.protected_pages <= self.cache.tree.cached_pages

    def teardown(self) -> None:
        for req in self.live:
            self.sched.finish(req, "abort")
        self.cache.reset()
        assert self.alloc.num_used == 0


class CacheMachinePage3(CacheMachine):
    page_size = 3
    budget = 16


class HostContents:
    """A host tier over the machine's page contents (the real copies are tested in
    tests/test_kv_tiers.py): what a page's KV was computed for moves with it. A load is done
    at the second `done` poll, so requests wait for it across a step."""

    def __init__(self, kv: dict[int, tuple[Hashable, tuple[int, ...]]], num_pages: int):
        self.kv, self.num_pages = kv, num_pages
        self.host: dict[int, tuple[Hashable, tuple[int, ...]]] = {}

    def offload(self, device_pages: list[int], host_pages: list[int]) -> None:
        for d, h in zip(device_pages, host_pages, strict=True):
            self.host[h] = self.kv[d]

    def load(self, host_pages: list[int], device_pages: list[int],
             overlap: bool = False) -> list[int]:
        for h, d in zip(host_pages, device_pages, strict=True):
            self.kv[d] = self.host[h]
        return [1]

    def done(self, handle: list[int]) -> bool:
        handle[0] -= 1
        return handle[0] < 0

    def use(self, handle: list[int]) -> None:
        pass

    def copy_stats(self) -> CopyStats:
        return CopyStats()


class HostTierMachine(CacheMachine):
    """The same traffic with evicted KV moving to a host tier and loaded back on a hit."""

    host_pages = 16

    def make_host(self) -> HostContents:
        return HostContents(self.kv, self.host_pages)

    @invariant()
    def host_pages_have_one_owner_and_their_kv(self) -> None:
        tree = list(self.cache.tree.host.iter_pages())
        pages = [p for _, p in tree]
        assert len(pages) == len(set(pages)), "a host page has two owners"
        assert self.cache.tiers.host_allocator.num_used == len(pages), "a host page leaked"
        assert self.host is not None
        for ns, page in tree:
            assert self.host.host[page][0] == ns, "a host page kept under another namespace"
        # device nodes form a subtree at the root
        for root in self.cache.tree._forest.roots.values():
            stack = [root]
            while stack:
                node = stack.pop()
                assert node.parent is None or node.pages or not any(
                    c.pages for c in node.children.values()), "device KV below a host node"
                stack.extend(node.children.values())

    def teardown(self) -> None:
        super().teardown()
        assert self.cache.tiers.host_allocator.num_used == 0


class HostTierMachinePage3(HostTierMachine):
    page_size = 3
    budget = 16
    host_pages = 6  # full most of the time: host pages are evicted too


TestCacheFuzz = CacheMachine.TestCase
TestCacheFuzzPage3 = CacheMachinePage3.TestCase
TestHostTierFuzz = HostTierMachine.TestCase
TestHostTierFuzzPage3 = HostTierMachinePage3.TestCase
# The same examples every run (derandomize): a CI run must not fail on a newly drawn case. A
# wider search runs the machines with more examples and random seeds, as the case below was
# found.
for _case in (TestCacheFuzz, TestCacheFuzzPage3, TestHostTierFuzz, TestHostTierFuzzPage3):
    _case.settings = settings(max_examples=80, stateful_step_count=40, deadline=None,
                              database=None, derandomize=True,
                              suppress_health_check=[HealthCheck.too_slow])
del _case


def test_waiting_loads_give_way_to_the_head_of_the_queue():
    """Found by the fuzz: requests waiting for their prefixes to come back from the host tier
    held those device pages locked, the request ahead of them needed the pages, and nothing
    ran again. The waiting requests' loads now give way (their pages stay cached)."""
    m = HostTierMachine()
    m.add(max_tokens=1, ns=("a", None, 0), prompt=[5, 5, 5, 5, 5, 5, 0], session=None)
    m.add(max_tokens=1, ns=("a", "x", 2), prompt=[5, 5, 5, 5, 6, 6, 6, 6, 0], session=None)
    m.drain()
    m.add(max_tokens=1, ns=("a", None, 0), prompt=[0, 0], session=None)
    m.drain()
    m.add(max_tokens=2, ns=("a", "x", 1), prompt=[5, 5, 5, 5, 6, 6, 6, 6, 0, 0, 0, 0, 0, 0],
          session=None)
    m.add(max_tokens=1, ns=("a", None, 0), prompt=[5, 5, 5, 5, 5, 5, 0], session=None)
    m.add(max_tokens=1, ns=("a", "x", 2), prompt=[5, 5, 5, 5, 5, 5, 0], session=None)
    m.drain()  # raised "stuck" with three requests waiting
    m.every_page_has_one_owner()
    m.host_pages_have_one_owner_and_their_kv()
    m.teardown()


@settings(max_examples=200, deadline=None, database=None, derandomize=True)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=30))
def test_allocator_against_a_model(ops: list[tuple[bool, int]]) -> None:
    """Never hands out a held page; refuses to over-allocate, to free a page twice, and to
    free a page it never handed out (out of range included)."""
    alloc, held = PageAllocator(8), []
    for allocate, n in ops:
        if allocate and n > alloc.num_free:
            with pytest.raises(OutOfPagesError):
                alloc.allocate(n)
        elif allocate:
            got = alloc.allocate(n)
            assert len(set(got)) == n and not set(got) & set(held)
            held += got
        else:
            given, held = held[:n], held[n:]
            alloc.free(given)
            for page in [*given[:1], -1, 8]:
                with pytest.raises(RuntimeError):
                    alloc.free([page])
        assert alloc.num_used == len(held) and alloc.num_free == 8 - len(held)
