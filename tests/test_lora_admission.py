"""The scheduler's one LoRA predicate, without a model: a request whose adapter is not
resident waits and never blocks the requests behind it; a slot is pinned while used."""

from __future__ import annotations

from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.kv.page_allocator import PageAllocator
from engine.sampling.params import SamplingParams


class Adapters:
    """Stands in for `lora.manager.AdapterManager`: `ready` names the resident adapters."""

    def __init__(self) -> None:
        self.ready: set[str] = set()
        self.asked: list[str] = []

    def can_admit(self, req: Request) -> bool:
        self.asked.append(req.request_id)
        return req.params.adapter is None or req.params.adapter in self.ready


def req(rid: str, adapter: str | None = None) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=4, adapter=adapter))


def test_waiting_adapter_does_not_block_others():
    adapters = Adapters()
    sched = Scheduler(PageAllocator(32), 4, 8, 64, adapters=adapters)
    slow, base, other = req("slow", "x"), req("base"), req("other", "y")
    for r in (slow, base, other):
        sched.add(r)
    adapters.ready.add("y")
    batch = sched.schedule()
    assert [s.request.request_id for s in batch.seqs] == ["base", "other"]
    assert sched.waiting == [slow] and not slow.pages  # no pages held while it waits
    adapters.ready.add("x")
    batch = sched.schedule()
    assert "slow" in [s.request.request_id for s in batch.seqs] and not sched.waiting


def test_default_admits_everything():
    sched = Scheduler(PageAllocator(32), 4, 8, 64)
    sched.add(req("a", "anything"))
    assert len(sched.schedule().seqs) == 1
