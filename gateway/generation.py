"""One HTTP request's generation: its engine requests (one per choice), merged into one
stream of outputs, with the accounting that follows them (metrics, tenant tokens, usage).

Lifecycle: `submit()` -> iterate `outputs()` -> `close()` (always, in a `finally`). `close()`
aborts whatever is unfinished, so a client that goes away frees its KV pages at the engine's
next step, and releases the tenant's concurrency slot.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from engine.messages import GenerateRequest, RequestOutput, TokenLogprob
from engine.protocols import EngineClient, Sink
from gateway.limits import Ticket
from gateway.metrics import Metrics
from gateway.params import Job

DISCONNECT_POLL_S = 0.5


@dataclass
class Choice:
    """The accumulated state of one choice (one engine request)."""

    job: Job
    request_id: str
    text: str = ""
    reasoning: str = ""  # a reasoning model's reasoning (engine/reasoning.py), not in `text`
    num_reasoning_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None

    @property
    def index(self) -> int:
        return self.job.index

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Generation:
    def __init__(
        self,
        engine: EngineClient,
        response_id: str,
        jobs: list[Job],
        tenant: str,
        ticket: Ticket,
        metrics: Metrics,
        session_id: str | None = None,
    ):
        self.engine, self.tenant, self.ticket, self.metrics = engine, tenant, ticket, metrics
        self.session_id = session_id
        self.response_id = response_id
        self.arrival = time.monotonic()
        self.created = int(time.time())
        self.sink: Sink = asyncio.Queue()
        self.choices = {f"{response_id}-{job.index}": Choice(job, f"{response_id}-{job.index}")
                        for job in jobs}
        self._submitted = False

    def submit(self) -> None:
        for rid, choice in self.choices.items():
            job = choice.job
            self.engine.add_request(
                GenerateRequest(rid, job.prompt_ids, job.params, self.tenant, self.session_id),
                self.sink)
        self._submitted = True
        prompt_tokens = self._prompt_tokens()
        self.metrics.prompt_tokens.labels(self.tenant).inc(prompt_tokens)
        self.ticket.record_tokens(prompt_tokens)

    @property
    def ordered(self) -> list[Choice]:
        return sorted(self.choices.values(), key=lambda c: c.index)

    @property
    def done(self) -> bool:
        return all(c.finished for c in self.choices.values())

    async def outputs(
        self, disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """Each engine output with its (already updated) choice, until all have finished.
        With `disconnected`, polls it every `DISCONNECT_POLL_S` and stops early (aborting)
        once the client has gone."""
        check_at = time.monotonic() + DISCONNECT_POLL_S
        while not self.done:
            if disconnected is not None and time.monotonic() >= check_at:
                if await disconnected():
                    self.close()
                    return
                check_at = time.monotonic() + DISCONNECT_POLL_S
            if disconnected is None:
                out = await self.sink.get()
            else:
                try:
                    out = await asyncio.wait_for(self.sink.get(), DISCONNECT_POLL_S)
                except TimeoutError:
                    continue
            choice = self.choices.get(out.request_id)
            if choice is None or choice.finished:
                continue
            self._update(choice, out)
            yield choice, out

    @property
    def pending(self) -> bool:
        """Whether outputs are queued already: a stream that has fallen behind the engine (a
        busy event loop) writes those together with the current one."""
        return not self.sink.empty()

    def close(self) -> None:
        """Abort unfinished choices and release the tenant slot. Idempotent."""
        if self._submitted:
            for rid, choice in self.choices.items():
                if not choice.finished:
                    self.engine.abort(rid)
                    choice.finish_reason = "abort"
                    self.metrics.finished.labels("abort").inc()
        self.ticket.release()

    def usage(self) -> dict[str, object]:
        completion = sum(len(c.token_ids) for c in self.choices.values())
        prompt = self._prompt_tokens()
        cached = sum(c.num_cached_tokens for c in self._first_per_prompt())
        usage: dict[str, object] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        reasoning = sum(c.num_reasoning_tokens for c in self.choices.values())
        if reasoning:
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        return usage

    # -- accounting ---------------------------------------------------------------------

    def _first_per_prompt(self) -> list[Choice]:
        first: dict[int, Choice] = {}
        for c in self.ordered:
            first.setdefault(c.job.prompt_index, c)
        return list(first.values())

    def _prompt_tokens(self) -> int:
        return sum(len(c.job.prompt_ids) for c in self._first_per_prompt())

    def _update(self, choice: Choice, out: RequestOutput) -> None:
        now = time.monotonic()
        choice.text += out.new_text
        choice.reasoning += out.new_reasoning_text
        choice.num_reasoning_tokens = out.num_reasoning_tokens or choice.num_reasoning_tokens
        if out.new_token_ids:
            if choice.first_token_at is None:
                choice.first_token_at = now
                self.metrics.ttft.observe(now - self.arrival)
                if out.queue_time is not None:
                    self.metrics.queue_time.observe(out.queue_time)
            choice.last_token_at = now
            choice.token_ids.extend(out.new_token_ids)
            self.metrics.generation_tokens.labels(self.tenant).inc(len(out.new_token_ids))
            self.ticket.record_tokens(len(out.new_token_ids))
        if out.logprobs:
            choice.logprobs.extend(out.logprobs)
        choice.num_prompt_tokens = out.num_prompt_tokens or choice.num_prompt_tokens
        choice.num_cached_tokens = out.num_cached_tokens or choice.num_cached_tokens
        if out.finished:
            choice.finish_reason = out.finish_reason or "stop"
            choice.error = out.error
            self.metrics.finished.labels(choice.finish_reason).inc()
            self.metrics.e2e.observe(now - self.arrival)
            n = len(choice.token_ids)
            if n > 1 and choice.first_token_at is not None and choice.last_token_at is not None:
                self.metrics.tpot.observe((choice.last_token_at - choice.first_token_at) / (n - 1))
