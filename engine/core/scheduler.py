"""Continuous batching with chunked prefill and recompute preemption. Pure Python, no torch.

One rule covers prefill, chunked prefill and decode: each step a scheduled request's
`num_computed_tokens` catches up toward `num_tokens` by at most the step's remaining token
budget. A request whose KV catches up samples one token at the end of the step. A prefix hit
is the same rule: admission starts `num_computed_tokens` at the cached prefix's length.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from engine.core.request import Request, Status
from engine.kv.page_allocator import PageAllocator
from engine.kv.prefix_cache import PrefixCache

log = logging.getLogger(__name__)


@dataclass
class ScheduledSeq:
    request: Request
    start: int  # num_computed_tokens before this step
    num_new_tokens: int
    # True when this step computes the request's last known token, so it samples; also for a
    # decode scheduled ahead, one past it (its input is the token the step in flight draws).
    # Fixed when scheduled (the step's postprocess appends tokens); read several times a step.
    samples: bool = field(init=False)
    # Draft tokens after the last known one (engine/spec/speculative.py): the step computes them
    # too and draws at their positions (`num_drawn`); `num_new_tokens` counts them.
    draft: list[int] = field(default_factory=list)
    num_forced: int = 0  # leading drafts the grammar forces: accepted without verification

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_new_tokens >= self.request.num_tokens

    @property
    def num_drawn(self) -> int:
        """Positions the step draws a token at: a sampling seq's last; a drafted decode's from
        its last forced draft on (what follows each looked-up draft, and the token after the
        whole draft). Forced drafts need no draw: they are accepted as they are."""
        if not self.samples:
            return 0
        return 1 + len(self.draft) - self.num_forced


@dataclass
class Batch:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Waiting requests whose own admission check raised, with why: the engine fails them.
    failed: list[tuple[Request, str]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    @property
    def all_sample(self) -> bool:
        """Every seq samples (decodes, and prompts computed whole): the next step can be
        queued behind this one, fed by its tokens on the device."""
        return all(s.samples for s in self.seqs)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Admission(Protocol):
    def can_admit(self, req: Request) -> bool:
        """May `req` start now? (e.g. its LoRA adapter is resident). True may reserve what
        the request needs until it finishes; False must not block the requests behind it."""
        ...

    def loading(self, req: Request) -> bool:
        """After `can_admit` said no: is what `req` waits for already on its way (its adapter
        has a slot, its copy to the device in flight), rather than waiting for room?"""
        ...

    def resident(self, req: Request) -> bool:
        """Is `req`'s adapter in a device slot, its copy landed: would admitting it take no
        slot? (Asking changes nothing.)"""
        ...


class AdmitAll:
    def can_admit(self, req: Request) -> bool:
        return True

    def loading(self, req: Request) -> bool:
        return False

    def resident(self, req: Request) -> bool:
        return True


# A request kept waiting this long by its adapter (no room on the device while every resident
# adapter is busy) stops the requests behind it that want other adapters (`Scheduler._admit`).
ADAPTER_WAIT_S = 2.0


class Scheduler:
    """FCFS within priority (lower `params.priority` first).

    Contract: a running request's `request.pages` hold enough pages for its computed tokens
    plus this step's; its own pages return to the allocator, and its full pages go to the
    prefix cache, on `finish` or on preemption, never otherwise (engine/kv/prefix_cache.py).
    """

    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        adapters: Admission | None = None,
        is_ready: Callable[[Request], bool] = lambda req: True,
        cache: PrefixCache | None = None,
        adapter_wait_s: float = ADAPTER_WAIT_S,
    ):
        self.is_ready = is_ready  # e.g. the request's grammar has compiled
        self.adapter_wait_s = adapter_wait_s
        self.allocator = allocator
        self.adapters = adapters or AdmitAll()
        self.cache = cache or PrefixCache(allocator, page_size, enabled=False)
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Request] = []  # sorted by sort_key
        self.running: list[Request] = []  # sorted by sort_key
        self.num_preemptions = 0

    # -- queue management ---------------------------------------------------------------

    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        bisect.insort(self.waiting, req, key=lambda r: r.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: str) -> None:
        """End `req` (stop, length, abort or error) and free its pages."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.cache.release(req)

    def requests(self) -> Iterable[Request]:
        yield from self.running
        yield from self.waiting

    # -- the step -------------------------------------------------------------------------

    def schedule(self) -> Batch:
        batch = Batch()
        budget = self.max_num_batched_tokens

        # Running requests first, best first; preempt from the worst end when out of pages.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self._reserve(req, req.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is req:
                    break
            else:
                batch.seqs.append(ScheduledSeq(req, req.num_computed_tokens, n))
                budget -= n
                i += 1

        self._admit(batch, budget)
        return batch

    def schedule_ahead(self, reqs: list[Request]) -> Batch | None:
        """The step after the one in flight, scheduled before its tokens are known: each of
        `reqs` (running; the step in flight draws its next token) decodes that token, and
        waiting requests start beside them when all they must compute fits this step. None
        when the regular `schedule` must decide once the step in flight is done: a decode's
        page cannot be reserved without preempting, or a request that could start needs its
        prompt chunked."""
        batch = Batch()
        for req in reqs:
            if not self._reserve(req, req.num_tokens + 1):
                return None
            batch.seqs.append(ScheduledSeq(req, req.num_tokens, 1))
        if not self._admit(batch, self.max_num_batched_tokens - len(reqs), whole=True):
            return None
        return batch or None

    def _admit(self, batch: Batch, budget: int, whole: bool = False) -> bool:
        """Admit waiting requests into `batch` while the budget, the seat count and the pages
        allow. One that is not ready (grammar compiling, adapter not resident) is passed over:
        it waits, the others go ahead. With `whole`, a request is admitted only if the rest of
        its prompt fits the budget; False when one that could start does not.

        Adapters: requests whose adapters are resident go ahead of one whose adapter waits for
        room, but not for ever. Once a request has waited `adapter_wait_s` for room for its
        adapter while requests with adapters run, it is held for (one whose adapter is already
        being copied in waits for nobody): no other adapter takes a slot, and
        the running adapter with the fewest running requests (`_drained`) admits no more, so
        its slot empties and the held request's adapter loads there (further slots drain, one
        a step, while its rows do not fit). The other running adapters keep admitting their
        requests, as do adapters already resident (`Admission.resident`: an adapter loaded for
        requests that have not started keeps its slot until one does, so they must be able to),
        and base-model requests still start. So no request waits for its adapter more than
        `adapter_wait_s`, plus the remaining run of the drained adapters' requests and of those
        admitted to resident slots meanwhile, plus its adapter's load, beyond first-come
        order."""
        now = time.monotonic()
        held: tuple[str, str] | None = None  # the adapter of such a request
        running: set[tuple[str, str]] = set()  # the adapters running when it was held
        drained: tuple[str, str] | None = None
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            adapter = _adapter(req)
            if held is not None and adapter not in (None, held) and (
                    adapter == drained
                    or adapter not in running and not self.adapters.resident(req)):
                continue
            if not self._startable(req, batch):
                if (held is None and adapter is not None and req.lora_waits
                        and now - req.added_at >= self.adapter_wait_s
                        and any(_adapter(r) is not None for r in self.running)):
                    held, (running, drained) = adapter, self._drained()
                continue
            self.cache.attach(req)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if whole and n < req.num_tokens - req.num_computed_tokens:
                self.cache.detach(req)
                return False
            if not self._reserve(req, req.num_computed_tokens + n):
                self.cache.detach(req)
                break
            self.waiting.remove(req)
            req.status = Status.RUNNING
            if req.scheduled_at is None:
                req.scheduled_at = time.monotonic()
            bisect.insort(self.running, req, key=lambda r: r.sort_key)
            batch.seqs.append(ScheduledSeq(req, req.num_computed_tokens, n))
            budget -= n
        return True

    def _drained(self) -> tuple[set[tuple[str, str]], tuple[str, str] | None]:
        """The running adapters, and the one whose slot a held request takes: the one with the
        fewest running requests (the first to run out), ties to the one first in running
        order."""
        count: Counter[tuple[str, str]] = Counter(
            a for r in self.running if (a := _adapter(r)) is not None)
        return set(count), min(count, key=count.__getitem__, default=None)

    def _startable(self, req: Request, batch: Batch) -> bool:
        """The per-request predicates: its grammar is ready, its cached prefix on the device
        (loading it from the host tier meanwhile), its adapter resident. They do that request's
        own work (build its matcher, copy its KV or its adapter); one that raises fails that
        request alone, through `batch.failed`."""
        req.lora_waits = False
        try:
            if not (self.is_ready(req) and self.cache.ready(req, overlap=not self.running)):
                return False
            if self.adapters.can_admit(req):
                return True
            req.lora_waits = not self.adapters.loading(req)  # waits for room, not a copy
            return False
        except Exception as e:
            log.exception("request %s cannot start", req.request_id)
            batch.failed.append((req, f"could not start: {type(e).__name__}: {e}"))
            return False

    def update(self, batch: Batch, sampled: dict[Request, int]) -> None:
        """Advance every scheduled request still running; append the tokens sampled this step."""
        for seq in batch.seqs:
            if seq.request.status is not Status.RUNNING:  # ended while the step was in flight
                continue
            seq.request.num_computed_tokens = seq.start + seq.num_new_tokens
            if seq.num_new_tokens > 1:  # a prefill chunk: its full pages join the cache
                self.cache.commit(seq.request)
        for req, token in sampled.items():
            req.token_ids.append(token)

    # -- pages ----------------------------------------------------------------------------

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def add_draft(self, seq: ScheduledSeq, draft: list[int], num_forced: int = 0) -> bool:
        """Extend a decode by draft tokens (the first `num_forced` forced by its grammar), if
        their pages can be had without preempting."""
        if not self._reserve(seq.request, seq.start + 1 + len(draft)):
            return False
        seq.draft, seq.num_forced = draft, num_forced
        seq.num_new_tokens = 1 + len(draft)
        return True

    def reserve(self, req: Request, num_tokens: int) -> bool:
        """Pages for `num_tokens` of running `req`, if they can be had without preempting."""
        return self._reserve(req, num_tokens)

    def _reserve(self, req: Request, num_tokens: int) -> bool:
        need = self.pages_for(num_tokens) - len(req.pages)
        if need <= 0:
            return True
        if not self.cache.make_room(need):  # evicts unlocked cached pages before failing
            return False
        req.pages.extend(self.allocator.allocate(need))
        return True

    def _preempt(self, req: Request, batch: Batch) -> None:
        """Recompute preemption: drop the KV, keep the tokens, requeue."""
        self.running.remove(req)
        self.cache.release(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        batch.preempted.append(req)
        self.add(req)


def _adapter(req: Request) -> tuple[str, str] | None:
    """Which adapter `req` runs (None: the base model)."""
    return None if req.params.adapter is None else (req.tenant, req.params.adapter)
