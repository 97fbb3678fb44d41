"""The two step modes that verify drafts (engine/core/steps.py has the protocol).

`SpeculativeStep`: a step whose decodes carry drafts (engine/spec/speculative.py), run
synchronously. `DraftLoopStep`: the overlapped speculative loop (engine/spec/loop.py), whose
drafts are proposed, verified and appended on the device while the host reads the step before.
Both append a drafted decode's tokens the same way (`advance_drafted`).
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import cast

from engine.core.request import Request
from engine.core.scheduler import Batch, ScheduledSeq
from engine.core.steps import StepParts
from engine.messages import RequestOutput
from engine.sampling.sampler import SampleResult
from engine.spec.loop import DraftLoop, HintGate, LoopStep
from engine.spec.speculative import DeviceDrafter

log = logging.getLogger(__name__)


class SpeculativeStep:
    """A step whose decodes carry drafts, run synchronously: every position of a drafted
    decode is drawn; its accepted drafts and the token drawn after them are appended, each
    through the stop checks, and its KV is kept up to them. The seqs without drafts go through
    `postprocess`."""

    kind = "speculative"
    in_flight = False

    def __init__(self, parts: StepParts):
        self.p = parts

    def start(self, batch: Batch) -> list[RequestOutput] | None:
        p = self.p
        if p.speculator is None or not p.speculator.attach(
            batch, p.out.tokens_left, p.scheduler.add_draft,
            p.scheduler.max_num_batched_tokens, p.grammar,
        ):
            return None
        step = p.runner.launch(batch)
        seq_of = {s.request: s for s in batch.seqs}
        offsets, prev = [], None
        for req in step.rows:  # a drafted decode's rows are consecutive, one per drawn position
            offsets.append(offsets[-1] + 1 if req is prev else seq_of[req].num_forced)
            prev = req
        p.runner.sample(step, step.rows, offsets=offsets)
        plain: list[tuple[Request, SampleResult]] = []
        drafted: dict[Request, list[SampleResult]] = {}
        for req, result in p.runner.collect(step):
            if seq_of[req].draft:
                drafted.setdefault(req, []).append(result)
            else:
                plain.append((req, result))
        outputs = p.out.postprocess(Batch([s for s in batch.seqs if not s.draft]), plain)
        for req, results in drafted.items():
            outputs.append(advance_drafted(p, seq_of[req], results))
        return outputs

    def resume(self) -> list[RequestOutput]:
        raise AssertionError("a synchronous step leaves nothing in flight")


class DraftLoopStep:
    """The overlapped speculative loop: each step is queued before the host has read what the
    step before it accepted. It takes a batch of decodes only (overlapped steps, on one
    device), few enough to speculate, each free to loop, one still drafting."""

    kind = "speculative"

    def __init__(self, parts: StepParts):
        self.p = parts
        self.loop: DraftLoop | None = None  # its sequences on the device
        self.ahead: LoopStep | None = None  # its step in flight
        self.hints = HintGate()

    @property
    def in_flight(self) -> bool:
        return self.ahead is not None

    def start(self, batch: Batch) -> list[RequestOutput] | None:
        """The loop's first step, queued, and the step after it; None when the batch does not
        loop or a request has no room (the batch then runs as the regular schedule would)."""
        if not self._loops(batch):
            return None
        spec = self.p.speculator
        assert spec is not None
        # One run per adapter slot (SGMV segments), as `ModelRunner._layout` orders decodes.
        reqs = sorted((s.request for s in batch.seqs), key=lambda r: r.lora_slot)
        drafter = cast(DeviceDrafter, spec.drafter)
        self.loop = DraftLoop(reqs, spec.k, drafter, self.p.runner.device)
        self.ahead = self._launch(reqs, in_flight=False)
        if self.ahead is None:
            self.loop = None
            return None
        return self.resume()

    def resume(self) -> list[RequestOutput]:
        """One step of the loop: queue the next step of the requests in flight still running,
        then read the step in flight's draws and advance its requests while the device
        computes. The loop ends (nothing queued; the regular schedule decides next) when no
        request is left, a waiting one could start, none still drafts, or one has no room."""
        prev, self.ahead = self.ahead, None  # until the next step is queued
        assert prev is not None
        reqs = [r for r in prev.reqs if not r.finished]
        nxt = self._launch(reqs, in_flight=True) if self._goes_on(reqs) else None
        outputs = self._collect(prev)
        self.ahead = nxt
        if nxt is None:
            self.loop = None
        return outputs

    def _loops(self, batch: Batch) -> bool:
        p, spec = self.p, self.p.speculator
        if spec is None or not p.overlap or not p.single_device or not hasattr(
                spec.drafter, "propose_on_device"):
            return False
        reqs = [s.request for s in batch.seqs]
        return (all(s.num_new_tokens == 1 and s.samples for s in batch.seqs)
                and spec.wants(len(reqs)) and all(map(spec.loops, reqs))
                and any(map(spec.may_draft, reqs)))

    def _goes_on(self, reqs: list[Request]) -> bool:
        if self.p.speculator is None:  # turned off (tests and benchmarks swap it)
            return False
        sched = self.p.scheduler
        if len(sched.running) < sched.max_num_seqs and any(
                map(sched.is_ready, sched.waiting)):
            return False  # the regular schedule admits it
        return any(map(self.p.speculator.may_draft, reqs))

    def _launch(self, reqs: list[Request], in_flight: bool) -> LoopStep | None:
        """Reserve what the step's positions may reach and queue it; None when a request has
        no room (pages, its row on the device, its page table)."""
        loop, spec = self.loop, self.p.speculator
        assert loop is not None and spec is not None
        q = spec.k + 1
        # The device may be 1 + k tokens past the host (`in_flight`); the step computes the
        # last token and k drafts after it.
        extra = 2 * q - 1 if in_flight else q - 1
        for req in reqs:
            need = req.num_tokens + extra
            if need > self.p.runner.max_context or not loop.room(req, in_flight):
                return None
            if not self.p.scheduler.reserve(req, need):
                return None
        return loop.launch(self.p.runner, reqs, self.hints.on)

    def _collect(self, step: LoopStep) -> list[RequestOutput]:
        """Read the step's draws and drafts; advance each request still running by its
        accepted drafts and the token after them, through the stop checks."""
        out = self.p.out
        q = len(step.step.rows) // max(len(step.reqs), 1)
        start = time.perf_counter()
        results = self.p.runner.collect(step.step)
        if self.p.runner.device.type == "cuda":  # on a CPU the step ran as it was queued
            self.hints.update(time.perf_counter() - start, step.hint_seconds)
        drafts = step.drafts.tolist()
        outputs = []
        for i, req in enumerate(step.reqs):
            if req.finished:  # ended while the step was in flight
                continue
            row = [r for _, r in results[i * q : (i + 1) * q]]
            error = next((r.error for r in row if r.error is not None), None)
            if error is not None:  # its row on the device went on with a wrong token
                outputs.append(out.fail(req, error))
                continue
            seq = ScheduledSeq(req, req.num_tokens - 1, q)
            *seq.draft, looked = drafts[i]
            appended = 1 + sum(1 for _ in itertools.takewhile(
                lambda pair: pair[0] == pair[1].token_id, zip(seq.draft, row[:-1], strict=True)))
            before = req.num_tokens
            outputs.append(advance_drafted(self.p, seq, row, looked))
            if not req.finished and req.num_tokens - before != appended:
                # The device appended what was accepted: the host must have too.
                outputs.append(out.fail(req, "internal error: the speculative loop's tokens "
                                        "diverged from the host's"))
        return outputs


def advance_drafted(p: StepParts, seq: ScheduledSeq, results: list[SampleResult],
                    looked: int | None = None) -> RequestOutput:
    """Append a drafted decode's drawn tokens up to the first that differs from its draft (or
    a row that could not be sampled), each through the stop checks. `results`: the draws from
    its last forced draft on (`ScheduledSeq.num_drawn`); `looked`: as for
    `Speculator.accepted`."""
    req, out = seq.request, p.out
    results = [SampleResult(t) for t in seq.draft[: seq.num_forced]] + results
    good = list(itertools.takewhile(lambda r: r.error is None, results))
    if not good:
        return out.fail(req, results[0].error or "")
    assert p.speculator is not None, "only a speculating engine drafts"
    accepted = p.speculator.accepted(seq, [r.token_id for r in good], looked)
    new, lps = [], []
    try:
        for i, r in enumerate(good[: accepted + 1]):
            forced = i < seq.num_forced  # the grammar's token, whatever was drawn
            token = seq.draft[i] if forced else r.token_id
            req.token_ids.append(token)
            new.append(token)
            if r.logprob is not None and not forced:  # none forced with logprobs
                lps.append(r.logprob)
            reason = out.check_stop(req, token)
            if reason:
                out.finish(req, reason)
                break
            # Past the forced drafts (the grammar forces those in a row), a token after which
            # the grammar forces more ends the run, as jump-forward would: the next draft
            # starts with the forced tokens, tokenized canonically.
            if seq.num_forced - 1 <= i < accepted and _forces_next(p, req):
                break
    except Exception as e:
        log.exception("request %s failed after sampling", req.request_id)
        return out.fail(req, f"internal error: {type(e).__name__}: {e}")
    # The KV holds the last known token and each draft equal to the token after it.
    req.num_computed_tokens = seq.start + len(new)
    return out.output(req, new, lps or None)


def _forces_next(p: StepParts, req: Request) -> bool:
    """Whether the request's grammar now forces tokens that jump-forward would append."""
    if req.matcher is None or req.params.logprobs is not None:
        return False
    return bool(p.grammar.forced_tokens(req, p.out.tokens_left(req)))
