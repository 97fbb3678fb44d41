"""The scheduler alone: pure Python, no model, milliseconds."""

from __future__ import annotations

from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.kv.page_allocator import PageAllocator
from engine.sampling.params import SamplingParams


def make(num_pages=64, page_size=4, seqs=8, budget=32):
    alloc = PageAllocator(num_pages)
    return Scheduler(alloc, page_size, seqs, budget), alloc


def req(rid, n, priority=0, max_tokens=8):
    return Request(
        rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, priority=priority)
    )


def run_step(sched, token=7):
    batch = sched.schedule()
    sched.update(batch, {s.request: token for s in batch.seqs if s.samples})
    return batch


def test_chunked_prefill_under_budget():
    sched, alloc = make(budget=10)
    a = req("a", 25)
    sched.add(a)
    sizes = [run_step(sched).seqs[0].num_new_tokens for _ in range(3)]
    assert sizes == [10, 10, 5]
    assert a.num_computed_tokens == 25 and a.num_tokens == 26  # sampled once, at the end
    assert len(a.pages) == 7  # ceil(25 / 4)
    assert run_step(sched).seqs[0].num_new_tokens == 1  # now decoding


def test_decodes_go_first_and_budget_is_shared():
    sched, _ = make(budget=8)
    a, b = req("a", 3), req("b", 20)
    sched.add(a)
    run_step(sched)  # a prefilled, sampled
    sched.add(b)
    batch = run_step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in batch.seqs] == [("a", 1), ("b", 7)]


def test_max_num_seqs():
    sched, _ = make(seqs=2, budget=100)
    for i in range(3):
        sched.add(req(str(i), 4))
    batch = sched.schedule()
    assert len(batch.seqs) == 2 and len(sched.waiting) == 1


def test_preempts_lowest_priority_and_recomputes():
    sched, alloc = make(num_pages=4, page_size=4, budget=64)
    hi, lo = req("hi", 8, priority=0), req("lo", 8, priority=1)
    sched.add(lo)
    sched.add(hi)
    run_step(sched)  # both prefilled: 2 pages each, pool full
    assert alloc.num_free == 0
    # hi now has 9 tokens: needs a third page, so lo is preempted.
    batch = run_step(sched)
    assert [r.request_id for r in batch.preempted] == ["lo"]
    assert lo.num_computed_tokens == 0 and lo.pages == [] and lo.num_tokens == 9
    assert sched.waiting == [lo]
    assert len(hi.pages) == 3


def test_a_request_is_stamped_when_it_first_runs():
    """`scheduled_at` marks the first admission (its queue time ends there): a request
    waiting for a seat has none, and a preempted one keeps its first."""
    sched, _ = make(num_pages=4, page_size=4, seqs=1, budget=64)
    a, b = req("a", 8), req("b", 8)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    assert a.scheduled_at is not None and a.scheduled_at >= a.added_at
    assert b.scheduled_at is None  # one seat: b waits
    first = a.scheduled_at
    sched.finish(a, "stop")
    run_step(sched)
    assert b.scheduled_at is not None and b.scheduled_at >= first
    sched, _ = make(num_pages=4, page_size=4, budget=64)
    hi, lo = req("hi", 8, priority=0), req("lo", 8, priority=1)
    sched.add(lo)
    sched.add(hi)
    run_step(sched)
    stamped = lo.scheduled_at
    assert run_step(sched).preempted == [lo] and lo.scheduled_at == stamped


def test_priority_order_and_fcfs():
    sched, _ = make(seqs=1)
    late_urgent = req("u", 4, priority=-1)
    first, second = req("f", 4), req("s", 4)
    sched.add(first)
    sched.add(second)
    sched.add(late_urgent)
    assert [r.request_id for r in sched.waiting] == ["u", "f", "s"]


def test_finish_and_abort_free_pages():
    sched, alloc = make()
    a, b = req("a", 10), req("b", 10)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    sched.finish(a, "stop")
    sched.finish(b, "abort")
    assert alloc.num_free == alloc.num_pages and not sched.has_unfinished()
