"""The scheduler with the prefix cache and session pins: pure Python, no model, milliseconds."""

from __future__ import annotations

from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.kv.page_allocator import PageAllocator
from engine.kv.prefix_cache import PrefixCache
from engine.sampling.params import SamplingParams

PS = 4


def make(num_pages=64, budget=64, seqs=8, session_pages=1000):
    alloc = PageAllocator(num_pages)
    cache = PrefixCache(alloc, PS, session_pages=session_pages)
    return Scheduler(alloc, PS, seqs, budget, cache=cache), alloc, cache


def req(rid, tokens, tenant="t", adapter=None, max_tokens=2, session=None):
    params = SamplingParams(max_tokens=max_tokens, adapter=adapter)
    return Request(rid, list(tokens), params, tenant, session_id=session)


def run(sched, r, token=7):
    """Add `r`, step until it has `max_tokens` outputs, finish it; return its batches."""
    sched.add(r)
    batches = []
    while r.num_output_tokens < r.params.max_tokens:
        batch = sched.schedule()
        sched.update(batch, {s.request: token for s in batch.seqs if s.samples})
        batches.append(batch)
    sched.finish(r, "length")
    return batches


def first_chunk(batches, r):
    return next(s for b in batches for s in b.seqs if s.request is r)


def assert_no_leak(sched, alloc, cache):
    assert not sched.has_unfinished()
    assert alloc.num_used == cache.tree.cached_pages  # every used page is the tree's
    cache.reset()
    assert alloc.num_free == alloc.num_pages


def test_repeat_hits_and_computes_only_the_rest():
    sched, alloc, cache = make()
    prompt = list(range(1, 19))  # 18 tokens: 4 full pages + 2
    run(sched, req("a", prompt))
    b = req("b", prompt + [50, 51, 52])
    seq = first_chunk(run(sched, b), b)
    # a computed 19 tokens (prompt + its first sample): 4 full pages cached.
    assert (seq.start, seq.num_new_tokens) == (16, 5)
    assert b.num_cached_tokens == 16
    assert cache.hit_tokens == 16 and cache.miss_tokens == 18 + 5
    assert_no_leak(sched, alloc, cache)


def test_full_hit_still_computes_the_last_page():
    sched, alloc, cache = make()
    prompt = list(range(1, 17))  # exactly 4 pages
    run(sched, req("a", prompt, max_tokens=4))
    b = req("b", prompt)
    seq = first_chunk(run(sched, b), b)
    assert seq.start == 12 and seq.num_new_tokens == 4  # so the step samples from logits
    assert_no_leak(sched, alloc, cache)


def test_namespaces_never_share():
    sched, alloc, cache = make()
    prompt = list(range(1, 30))
    run(sched, req("a", prompt, tenant="alpha"))
    for other in (req("b", prompt, tenant="beta"), req("c", prompt, tenant="alpha", adapter="x")):
        assert first_chunk(run(sched, other), other).start == 0
        assert other.num_cached_tokens == 0
    same = req("d", prompt, tenant="alpha")
    assert first_chunk(run(sched, same), same).start == 28
    assert_no_leak(sched, alloc, cache)


def test_chunks_are_inserted_as_they_are_computed():
    sched, alloc, cache = make(budget=8)
    a = req("a", list(range(1, 30)))
    sched.add(a)
    batch = sched.schedule()
    sched.update(batch, {})
    assert cache.tree.cached_pages == 2 and a.num_cached_pages == 2
    # A second request with the same prompt reuses the first chunk while a still runs.
    b = req("b", list(range(1, 30)))
    cache.attach(b)
    assert b.num_computed_tokens == 8 and b.pages == a.pages[:2]
    cache.detach(b)
    assert b.pages == [] and cache.hit_tokens == 0
    sched.finish(a, "abort")
    assert_no_leak(sched, alloc, cache)


def test_evicts_cached_pages_before_preempting():
    sched, alloc, cache = make(num_pages=8)
    run(sched, req("a", list(range(1, 25))))  # 6 pages cached, 2 free
    b = req("b", list(range(100, 125)))  # needs 7 pages: evicts a's LRU pages
    run(sched, b)
    assert sched.num_preemptions == 0 and cache.tree.evicted_pages >= 5
    assert_no_leak(sched, alloc, cache)


def test_locked_prefix_is_not_evicted_and_preemption_still_works():
    sched, alloc, cache = make(num_pages=6, budget=64)
    hi = req("hi", list(range(1, 13)), max_tokens=12)
    sched.add(hi)
    sched.add(req("lo", list(range(50, 58)), max_tokens=12))
    for _ in range(8):
        batch = sched.schedule()
        sched.update(batch, {s.request: 7 for s in batch.seqs if s.samples})
    assert sched.num_preemptions > 0
    assert hi.num_output_tokens == 8  # hi kept running; its pages were never evicted
    for r in list(sched.requests()):
        sched.finish(r, "abort")
    assert_no_leak(sched, alloc, cache)


def test_session_pins_survive_eviction_within_the_budget():
    sched, alloc, cache = make(num_pages=10, session_pages=4)
    run(sched, req("s1", list(range(1, 17)), session="S"))  # 4 full pages, pinned
    assert cache.pins.is_pinned("S") and cache.tree.protected_pages == 4
    run(sched, req("x", list(range(100, 120))))  # needs 5 pages: only unpinned ones go
    again = req("s2", list(range(1, 17)) + [7, 9], session="S")
    assert first_chunk(run(sched, again), again).start == 16
    # Over the tenant's budget: the LRU session is unpinned (it stays cached, evictable).
    run(sched, req("o", list(range(200, 217)), session="O"))
    assert not cache.pins.is_pinned("S") and cache.pins.is_pinned("O")
    assert cache.pins.pages_of("t") <= 4
    cache.release_session("O")
    assert cache.tree.protected_pages == 0
    assert_no_leak(sched, alloc, cache)


def test_disabled_cache_frees_everything():
    alloc = PageAllocator(16)
    sched = Scheduler(alloc, PS, 4, 64)
    run(sched, req("a", list(range(1, 20))))
    b = req("b", list(range(1, 20)))
    assert first_chunk(run(sched, b), b).start == 0
    assert alloc.num_used == 0
