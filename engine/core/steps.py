"""The ways a step runs a batch (`StepMode`), each a small class behind one protocol.

`LLMEngine.step` asks its modes in order whether they take the batch the scheduler made:
the overlapped speculative loop (engine/spec/steps.py `DraftLoopStep`), a synchronous
speculative step (`SpeculativeStep`), the overlapped decode loop (`OverlapStep`), and the
synchronous step (`SyncStep`), which takes every batch. A mode that leaves a step in flight
on the device runs the engine's next step too (`resume`), until it hands back to the schedule.

On CUDA the steps overlap (`EngineConfig.overlap_schedule`): step N+1's forward is queued on
the device, fed by step N's tokens there, before the host reads step N's tokens and
postprocesses them, so the host's work per step hides behind the device's (SGLang's overlap
scheduler). Requests that step N ends ran one token too far in step N+1; that row is dropped.
Requests that start while the loop runs are prefilled in it when their whole prompt fits one
step; one that needs chunks hands back to the regular schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine.core.output_processor import OutputProcessor
from engine.core.scheduler import Batch, Scheduler
from engine.messages import RequestOutput
from engine.runner.model_runner import ModelRunner, Step
from engine.sampling.structured import GrammarStage
from engine.spec.speculative import Speculator

# How a step ran (`LLMEngine.step_times`): in the overlapped loop (queued behind the step in
# flight), synchronously (prefill and admission steps, a request mid-chunk, CPU engines), or
# carrying speculative drafts (synchronous too).
STEP_KINDS = ("overlapped", "synchronous", "speculative")


@dataclass
class StepParts:
    """What the step modes run on. `speculator` and `overlap` may change between steps
    (tests and benchmarks swap them through `LLMEngine`)."""

    scheduler: Scheduler
    runner: ModelRunner
    out: OutputProcessor
    grammar: GrammarStage
    speculator: Speculator | None
    overlap: bool
    single_device: bool  # no tensor-parallel workers


class StepMode(Protocol):
    kind: str  # one of STEP_KINDS

    def start(self, batch: Batch) -> list[RequestOutput] | None:
        """Run a step of the scheduled `batch`, or decline it (None: the next mode decides)."""

    def resume(self) -> list[RequestOutput]:
        """Run the next step of what this mode left in flight."""

    @property
    def in_flight(self) -> bool:
        """Whether a step of this mode is queued on the device (the engine's next step is
        then `resume`)."""


class SyncStep:
    """schedule -> run -> postprocess, the step waiting for the device."""

    kind = "synchronous"
    in_flight = False

    def __init__(self, parts: StepParts):
        self.p = parts

    def start(self, batch: Batch) -> list[RequestOutput]:
        return self.p.out.postprocess(batch, self.p.runner.run(batch))

    def resume(self) -> list[RequestOutput]:
        raise AssertionError("a synchronous step leaves nothing in flight")


class OverlapStep:
    """The overlapped decode loop: a batch whose every seq samples (no prompt left mid-chunk)
    starts it; each step queues the next before postprocessing its own."""

    kind = "overlapped"

    def __init__(self, parts: StepParts):
        self.p = parts
        self.ahead: Step | None = None  # the step in flight

    @property
    def in_flight(self) -> bool:
        return self.ahead is not None

    def start(self, batch: Batch) -> list[RequestOutput] | None:
        if not (self.p.overlap and batch.all_sample):
            return None
        first = self.p.runner.launch(batch)
        self.p.runner.sample(first, first.rows)
        self.ahead = first
        return self.resume()

    def resume(self) -> list[RequestOutput]:
        """One step of the loop. The step in flight (N) has its draw queued: queue step N+1's
        decodes behind it, fed by N's tokens on the device; postprocess N while the device
        computes; then queue N+1's draw (its grammar masks need N's tokens accepted). N+1 may
        also prefill requests that start now. Ends (nothing left in flight) when no request
        decodes on or starts, or when one must start in chunks."""
        prev, self.ahead = self.ahead, None  # if this raises, nothing stays in flight
        assert prev is not None
        p = self.p
        nxt = self._next(prev)
        failed = [p.out.fail(req, why) for req, why in nxt.failed] if nxt else []
        ahead = p.runner.launch(nxt, after=prev) if nxt else None
        # N+1 decodes N's sampled token: no forced (jump-forward) tokens may follow it.
        outputs = failed + p.out.postprocess(prev.batch, p.runner.collect(prev),
                                             jump_forward=False)
        if ahead is not None:
            alive = [r for r in ahead.rows if not r.finished]
            if alive:
                p.runner.sample(ahead, alive)
                self.ahead = ahead
        return outputs

    def _next(self, prev: Step) -> Batch | None:
        """The step that follows `prev`: its requests that its tokens cannot end by length
        decode on, and waiting requests whose whole prompt fits start beside them (their
        prefill overlaps too). None when the regular schedule must decide."""
        assert prev.drawn is not None, "an overlapped step's draw is queued at launch"
        reqs = [r for r in prev.drawn.reqs if not r.finished and self.p.out.tokens_left(r) > 1]
        spec = self.p.speculator
        if spec is not None and spec.wants(len(reqs)) and any(map(spec.may_draft, reqs)):
            return None  # the regular schedule attaches drafts
        return self.p.scheduler.schedule_ahead(reqs)
