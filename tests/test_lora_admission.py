"""The scheduler's one LoRA predicate, without a model: a request whose adapter is not
resident waits and does not block the requests behind it, until it has waited past the
fairness bound (`Scheduler.adapter_wait_s`): then one running adapter's slot drains for it,
and no other adapter takes a slot before it."""

from __future__ import annotations

from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.kv.page_allocator import PageAllocator
from engine.sampling.params import SamplingParams


class Adapters:
    """Stands in for `lora.manager.AdapterManager`: `ready` names the adapters a request may
    start with (resident, or loaded on asking), `copying` those on their way to the device,
    `resident` those already in a slot with no request running."""

    def __init__(self) -> None:
        self.ready: set[str] = set()
        self.copying: set[str] = set()  # has a slot, its copy in flight
        self.resident_idle: set[str] = set()
        self.asked: list[str] = []

    def can_admit(self, req: Request) -> bool:
        self.asked.append(req.request_id)
        return req.params.adapter is None or req.params.adapter in self.ready

    def loading(self, req: Request) -> bool:
        return req.params.adapter in self.copying

    def resident(self, req: Request) -> bool:
        return req.params.adapter in self.resident_idle


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


def ids(batch) -> list[str]:
    return [s.request.request_id for s in batch.seqs]


def test_resident_adapters_go_first_until_a_waiting_one_is_held_up_too_long():
    """x has no room while y runs. Within the bound, later y requests start ahead of x's; past
    it, they wait (base requests still start) until y's running request finishes, and x then
    starts ahead of them."""
    adapters = Adapters()
    adapters.ready.add("y")
    sched = Scheduler(PageAllocator(64), 4, 8, 64, adapters=adapters, adapter_wait_s=3600)
    running = req("y-running", "y")
    sched.add(running)
    assert ids(sched.schedule()) == ["y-running"]
    starved, later = req("x", "x"), req("y-later", "y")
    sched.add(starved)
    sched.add(later)
    assert ids(sched.schedule()) == ["y-running", "y-later"]  # resident first, within the bound
    assert starved.lora_waits and sched.waiting == [starved]

    sched.adapter_wait_s = 0.0  # now past the bound
    sched.add(held := req("y-held", "y"))
    sched.add(req("base"))
    batch = sched.schedule()
    assert "y-held" not in ids(batch) and "base" in ids(batch)
    assert sched.waiting == [starved, held]
    for r in (running, later):  # y's requests end: its slot is free, x's adapter loads
        sched.finish(r, "stop")
    adapters.ready.add("x")
    batch = sched.schedule()
    assert ids(batch)[-2:] == ["x", "y-held"] and not sched.waiting


def test_no_hold_without_running_adapters_to_wait_for():
    """An adapter that cannot load while nothing with an adapter runs (nothing will free room)
    does not stop other adapters' requests."""
    adapters = Adapters()
    adapters.ready.add("y")
    sched = Scheduler(PageAllocator(64), 4, 8, 64, adapters=adapters, adapter_wait_s=0.0)
    sched.add(stuck := req("x", "x"))
    sched.add(req("y1", "y"))
    assert ids(sched.schedule()) == ["y1"] and sched.waiting == [stuck]
    # y1 runs now: the next y request is held behind x, which has waited past the bound.
    sched.add(req("y2", "y"))
    assert ids(sched.schedule()) == ["y1"]


def test_a_request_waiting_on_its_grammar_holds_nobody():
    adapters = Adapters()
    adapters.ready.update({"x", "y"})
    compiled: set[str] = set()
    sched = Scheduler(PageAllocator(64), 4, 8, 64, adapters=adapters,
                      is_ready=lambda r: r.request_id in compiled | {"y1", "y2"},
                      adapter_wait_s=0.0)
    sched.add(req("y1", "y"))
    sched.schedule()
    sched.add(slow := req("x", "x"))
    sched.add(req("y2", "y"))
    assert ids(sched.schedule()) == ["y1", "y2"] and not slow.lora_waits


def test_held_request_drains_one_slot_and_the_others_keep_running():
    """x waits past the bound while y (one running request) and z (two) hold the slots. y's
    slot is the one drained: later y requests wait, later z requests still start, and w (an
    adapter in no running request's slot) waits behind x. Once y's request ends, x's adapter
    loads into its slot and x starts ahead of the y and w requests."""
    adapters = Adapters()
    adapters.ready.update({"y", "z", "w"})
    sched = Scheduler(PageAllocator(64), 4, 16, 64, adapters=adapters, adapter_wait_s=0.0)
    y1, z1, z2 = req("y1", "y"), req("z1", "z"), req("z2", "z")
    for r in (y1, z1, z2):
        sched.add(r)
    assert ids(sched.schedule()) == ["y1", "z1", "z2"]
    starved = req("x", "x")
    later = [req("y2", "y"), req("z3", "z"), req("w1", "w"), req("base")]
    for r in (starved, *later):
        sched.add(r)
    batch = sched.schedule()
    assert ids(batch) == ["y1", "z1", "z2", "z3", "base"]
    assert [r.request_id for r in sched.waiting] == ["x", "y2", "w1"]
    assert "w1" not in adapters.asked  # never asked: asking may load it into a free slot
    sched.finish(y1, "stop")
    adapters.ready.add("x")
    assert ids(sched.schedule())[-3:] == ["x", "y2", "w1"]  # (the stand-in has room for all)


def test_held_request_waits_at_most_for_the_drained_slot():
    """The bound, stepped: one slot, adapters a and b with a steady stream of requests each,
    and x held up. However long the streams, x starts as soon as the drained adapter's
    running requests end, not when the queue empties."""
    adapters = Adapters()
    sched = Scheduler(PageAllocator(256), 4, 64, 256, adapters=adapters, adapter_wait_s=0.0)
    adapters.ready.update({"a", "b"})
    a0, b0, b1 = req("a0", "a"), req("b0", "b"), req("b1", "b")
    for r in (a0, b0, b1):
        sched.add(r)
    sched.schedule()
    sched.add(starved := req("x", "x"))
    for step in range(5):  # more a and b requests arrive every step; a (fewest) drains
        sched.add(req(f"a-late{step}", "a"))
        sched.add(req(f"b-late{step}", "b"))
        batch = sched.schedule()
        assert not any(r.startswith("a-late") for r in ids(batch))
        assert f"b-late{step}" in ids(batch) and starved in sched.waiting
    sched.finish(a0, "stop")
    adapters.ready.add("x")
    assert "x" in ids(sched.schedule())


def test_a_request_whose_adapter_is_being_copied_holds_nobody():
    """Past the bound, a request whose adapter already has a slot (its copy in flight) is not
    waiting for room: the requests behind it, for adapters that need a slot of their own,
    still start. With the copies asynchronous, a hold here would let one adapter load a step."""
    adapters = Adapters()
    adapters.ready.add("y")
    sched = Scheduler(PageAllocator(64), 4, 8, 64, adapters=adapters, adapter_wait_s=0.0)
    sched.add(req("y1", "y"))
    sched.schedule()
    adapters.copying.add("x")
    sched.add(coming := req("x", "x"))
    sched.add(req("w", "w"))
    adapters.ready.add("w")
    assert ids(sched.schedule()) == ["y1", "w"] and not coming.lora_waits
    adapters.copying.clear()
    adapters.ready.add("x")
    assert ids(sched.schedule())[-1] == "x"


def test_during_a_hold_requests_of_resident_adapters_still_start():
    """An adapter loaded for requests that have not started keeps its slot until one does
    (`lora.manager`), so a hold must let them start: v was loaded before x was held, and runs
    nothing yet. Its request starts during the hold; w, in no slot, still waits, and the
    drained y admits no more."""
    adapters = Adapters()
    adapters.ready.update({"y", "z", "v", "w"})
    adapters.resident_idle.add("v")
    sched = Scheduler(PageAllocator(64), 4, 16, 64, adapters=adapters, adapter_wait_s=0.0)
    y1, z1, z2 = req("y1", "y"), req("z1", "z"), req("z2", "z")
    for r in (y1, z1, z2):
        sched.add(r)
    sched.schedule()
    for r in (req("x", "x"), req("y2", "y"), req("w1", "w"), req("v1", "v")):
        sched.add(r)
    assert ids(sched.schedule()) == ["y1", "z1", "z2", "v1"]
    assert [r.request_id for r in sched.waiting] == ["x", "y2", "w1"]
    assert "w1" not in adapters.asked and "y2" not in adapters.asked
