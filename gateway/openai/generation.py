"""One HTTP request's generation: its engine requests (one per choice), merged into one
stream of outputs, with the accounting that follows them (metrics, tenant tokens, usage).

Lifecycle: `submit()` -> iterate `outputs()` -> `close()` (always, in a `finally`). `close()`
aborts whatever is unfinished, so a client that goes away frees its KV pages at the engine's
next step, and releases the tenant's concurrency slot.

A client that stays connected but stops reading a stream stops its writes (uvicorn's flow
control holds the response's `send` once the socket's and the transport's buffers are full), so
the engine's outputs queue up in the sink. Past `max_buffered_bytes` of them the generation is
aborted as if the client had gone, and `drop` resets its connection (a close would wait for the
unread bytes to drain).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from engine.messages import GenerateRequest, RequestOutput, TokenLogprob
from engine.protocols import EngineClient, Sink
from gateway.access.limits import Ticket
from gateway.metrics import Metrics
from gateway.openai.params import Job

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.5
EVENT_BYTES = 200  # about the JSON around one output's text in an SSE event
LOGPROB_BYTES = 64  # about one logprob entry (a sampled token's or one of its top ones)


@dataclass
class Choice:
    """The accumulated state of one choice (one engine request)."""

    job: Job
    request_id: str
    text: str = ""
    reasoning: str = ""  # a reasoning model's reasoning (engine/core/reasoning.py), not in `text`
    num_reasoning_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None
    error_code: str | None = None  # "engine_failed": the engine stopped, not this request
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
        max_buffered_bytes: int | None = None,
        drop: Callable[[str], None] | None = None,
    ):
        self.engine, self.tenant, self.ticket, self.metrics = engine, tenant, ticket, metrics
        self.session_id = session_id
        self.response_id = response_id
        self.arrival = time.monotonic()
        self.created = int(time.time())
        self.sink: Sink = OutputQueue(max_buffered_bytes, self._overflow)
        self.drop = drop  # the connection's (gateway/access/connections.py), reason -> reset
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

    def _overflow(self, nbytes: int) -> None:
        log.warning("%s aborted: its client read nothing while %d bytes of output waited",
                    self.response_id, nbytes)
        self.close()
        if self.drop is not None:
            self.drop("stream_buffer")

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
            choice.stop_reason = out.stop_reason
            choice.error, choice.error_code = out.error, out.error_code
            self.metrics.finished.labels(choice.finish_reason).inc()
            self.metrics.e2e.observe(now - self.arrival)
            n = len(choice.token_ids)
            if n > 1 and choice.first_token_at is not None and choice.last_token_at is not None:
                self.metrics.tpot.observe((choice.last_token_at - choice.first_token_at) / (n - 1))


class OutputQueue(asyncio.Queue[RequestOutput]):
    """A generation's sink: the engine's outputs its response has not taken yet, weighed in
    about the bytes they make as SSE events. Past `max_bytes` (None: no bound), `on_overflow`
    runs once, with the weight queued."""

    def __init__(self, max_bytes: int | None, on_overflow: Callable[[int], None]):
        super().__init__()
        self.max_bytes, self.on_overflow = max_bytes, on_overflow
        self.bytes = 0
        self.overflowed = False

    def _put(self, item: RequestOutput) -> None:
        super()._put(item)
        self.bytes += _weight(item)
        if self.max_bytes is not None and self.bytes > self.max_bytes and not self.overflowed:
            self.overflowed = True
            self.on_overflow(self.bytes)

    def _get(self) -> RequestOutput:
        item = super()._get()
        self.bytes -= _weight(item)
        return item


def _weight(out: RequestOutput) -> int:
    logprobs = sum(1 + len(lp.top) for lp in out.logprobs) if out.logprobs else 0
    return (EVENT_BYTES + len(out.new_text) + len(out.new_reasoning_text)
            + LOGPROB_BYTES * logprobs)
