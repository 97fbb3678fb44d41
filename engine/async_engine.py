"""The engine loop in its own thread, fed from an asyncio event loop.

The gateway never blocks on an engine step. It calls `add_request` / `abort` from its event
loop; those only enqueue a command. The engine thread drains the commands before every step
(so an abort frees the request's KV pages before the next step runs), steps while there is
work, and hands each step's `RequestOutput`s back to the event loop, where they land in the
asyncio queue (the "sink") registered for their request.

This module imports no torch: the engine itself is built inside the thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.messages import GenerateRequest, RequestOutput
from engine.prefix_cache import PrefixCacheStats
from engine.protocols import AdapterRegistry, EngineStats, Sink
from engine.sampling_params import InvalidRequestError, SamplingParams
from grammar.spec import ConstraintSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _ReleaseSession:
    session_id: str


@dataclass(frozen=True)
class _FailAll:
    why: str


_STOP = object()
LOAD_STAGES = ("locating weights", "loading model", "ready")


class AsyncEngine:
    """Owns an `LLMEngine` (or anything with its interface) and the thread that steps it.
    Request handling sees it as an `engine.protocols.EngineClient`; the rest (start, loading,
    drain, shutdown) is the gateway runtime's.

    Contract:
      - `start(loop)` once; the engine is built in the thread. `ready` / `load_error` tell
        how that went; `load_stage` names the current stage of `LOAD_STAGES`.
      - `add_request(req, sink)` and `abort(request_id)` are called on `loop` only. Every
        output for `req.request_id` is put into `sink`, the last with `finished=True`
        (finish_reason "error" with `error` set when the engine failed the request).
      - A failing request never stops the thread: an exception while adding a request fails
        that request; one inside a step fails the requests of that step, and the loop goes on.
    """

    def __init__(
        self,
        config: EngineConfig,
        engine_factory: Callable[[EngineConfig], Any] | None = None,
    ):
        self.config = config
        self._factory = engine_factory
        self._engine: Any = None  # the LLMEngine (torch), built in the thread; or a fake
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()  # requests and commands
        self._sinks: dict[str, Sink] = {}  # event loop side: who listens for which request
        self._live: set[str] = set()  # engine thread side: requests added and not finished
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._done_loading = threading.Event()
        self._stopping = False
        self.load_stage = LOAD_STAGES[0]
        self.load_error: BaseException | None = None
        self.stats = EngineStats()

    # -- lifecycle (event loop side) ------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._thread is not None:
            return
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.alive and self.fatal_error is None

    @property
    def fatal_error(self) -> str | None:
        """Why the loaded engine stopped for good (a tensor-parallel rank died), else None."""
        return getattr(self._engine, "fatal_error", None)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Block (not on the event loop) until loading succeeded or failed."""
        return self._done_loading.wait(timeout)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._inbox.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout)

    # -- facts about the loaded engine (read-only after loading, so safe from any thread) --

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def model_dir(self) -> Path:
        return self._engine.model_dir

    @property
    def adapters(self) -> AdapterRegistry | None:
        """The engine's LoRA adapter manager (its registry methods are thread-safe); None
        before loading or for an engine without one."""
        return getattr(self._engine, "adapters", None)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise `InvalidRequestError` now, before the request is queued. Reads only
        immutable engine facts (vocab size, context length), so it is safe off-thread."""
        self._engine.validate(prompt_token_ids, params)

    async def compile_grammar(self, spec: ConstraintSpec) -> None:
        """Compile a constraint (or find it cached) before the request is queued; raises
        `grammar.spec.GrammarError` when no backend can compile it. Thread-safe: the compiler
        has its own lock and workers."""
        await asyncio.wrap_future(self._engine.grammar.compile(spec))

    # -- requests (event loop side) -------------------------------------------------------

    @property
    def num_outstanding(self) -> int:
        """Requests added and not yet finished (queued, waiting or running)."""
        return len(self._sinks)

    def add_request(self, request: GenerateRequest, sink: Sink) -> None:
        if request.request_id in self._sinks:
            raise InvalidRequestError(f"duplicate request id {request.request_id!r}")
        self._sinks[request.request_id] = sink
        self._inbox.put(request)

    def abort(self, request_id: str) -> None:
        """Stop a request; its pages are freed before the next engine step."""
        if self._sinks.pop(request_id, None) is not None:
            self._inbox.put(_Abort(request_id))

    def release_session(self, session_id: str) -> None:
        """The session ended: unpin its KV (applied before the next step)."""
        self._inbox.put(_ReleaseSession(session_id))

    def fail_all(self, why: str) -> None:
        """Fail every request added and not finished (a drain's deadline passed): each gets a
        last output with finish_reason "error" and `error=why`. Callable from any thread."""
        self._inbox.put(_FailAll(why))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue  # aborted by the gateway: nobody listens any more
            if out.finished:
                del self._sinks[out.request_id]
            sink.put_nowait(out)

    # -- the engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._engine = self._load()
        except BaseException as e:  # noqa: BLE001 - reported through load_error
            log.exception("engine failed to load")
            self.load_error = e
            self._done_loading.set()
            return
        self.load_stage = LOAD_STAGES[2]
        self._publish_stats()
        self._ready.set()
        self._done_loading.set()
        try:
            while not self._stopping:
                try:
                    self._iterate()
                except Exception:  # the loop itself must survive anything
                    log.exception("engine loop iteration failed")
        finally:
            close = getattr(self._engine, "close", None)
            if close is not None:
                close()

    def _load(self) -> Any:
        if self._factory is not None:
            self.load_stage = LOAD_STAGES[1]
            return self._factory(self.config)
        from engine.engine import LLMEngine
        from engine.loader import resolve_model_dir

        resolve_model_dir(self.config.model, self.config.cache_dir)  # converts a GGUF once
        self.load_stage = LOAD_STAGES[1]
        engine = LLMEngine(self.config)
        engine.grammar.start()  # not on the first constrained request: see `start`
        return engine

    def _iterate(self) -> None:
        outputs = self._drain(block=not self._engine.has_unfinished_requests())
        if self._engine.has_unfinished_requests() and not self._stopping:
            outputs += self._step()
        self._live.difference_update(o.request_id for o in outputs if o.finished)
        self._publish_stats()
        if outputs:
            self._send(outputs)

    def _drain(self, block: bool) -> list[RequestOutput]:
        """Apply queued commands; when idle, wait for the first one."""
        outputs: list[RequestOutput] = []
        while True:
            try:
                cmd = self._inbox.get() if block else self._inbox.get_nowait()
            except queue.Empty:
                return outputs
            block = False
            if cmd is _STOP:
                return outputs
            if isinstance(cmd, _Abort):
                self._live.discard(cmd.request_id)
                try:
                    self._engine.abort_request(cmd.request_id)  # nobody listens for its output
                except Exception:
                    log.exception("aborting %s failed", cmd.request_id)
            elif isinstance(cmd, _FailAll):
                outputs += self._abort_all(set(self._live), cmd.why)
            elif isinstance(cmd, _ReleaseSession):
                try:
                    self._engine.release_session(cmd.session_id)
                except Exception:
                    log.exception("releasing session %s failed", cmd.session_id)
            else:
                err = self._add(cmd)
                if err is not None:
                    outputs.append(err)

    def _add(self, req: GenerateRequest) -> RequestOutput | None:
        try:
            self._engine.add_request(req.request_id, req.prompt_token_ids, req.params, req.tenant,
                                     req.session_id)
        except InvalidRequestError as e:
            return _failed(req.request_id, e.message)
        except Exception as e:
            log.exception("adding request %s failed", req.request_id)
            return _failed(req.request_id, f"{type(e).__name__}: {e}")
        self._live.add(req.request_id)
        return None

    def _step(self) -> list[RequestOutput]:
        try:
            return self._engine.step()
        except Exception as e:
            fatal = self.fatal_error
            if fatal is not None:  # nothing can run any more: fail everything, stop the loop
                log.error("engine stopped: %s", fatal)
                self._stopping = True
                return self._abort_all(set(self._live), f"the engine stopped: {fatal}")
            # We cannot tell which request of the batch broke the step: fail the running ones
            # (this frees their pages), and any that finished inside the failed step (their
            # outputs are lost); keep serving the waiting ones.
            log.exception("engine step failed; failing the running requests")
            scheduler = self._engine.scheduler
            running = {r.request_id for r in scheduler.running}
            vanished = self._live - {r.request_id for r in scheduler.requests()}
            why = f"engine step failed: {e}"
            return self._abort_all(running, why) + [_failed(rid, why) for rid in vanished]

    def _abort_all(self, request_ids: set[str], why: str) -> list[RequestOutput]:
        """Abort these requests in the engine; their failed outputs, with `why`."""
        for rid in request_ids:
            try:
                self._engine.abort_request(rid)
            except Exception:
                log.exception("could not abort %s", rid)
        return [_failed(rid, why) for rid in request_ids]

    def _publish_stats(self) -> None:
        e = self._engine
        prefix = e.prefix_cache.stats() if hasattr(e, "prefix_cache") else PrefixCacheStats()
        spec = getattr(getattr(e, "speculator", None), "stats", None)
        self.stats = EngineStats(
            num_running=e.num_running,
            num_waiting=e.num_waiting,
            kv_pages_used=e.allocator.num_used - prefix.evictable_pages,
            kv_pages_total=e.allocator.num_pages,
            jump_forward_tokens=getattr(getattr(e, "grammar", None), "jump_forward_tokens", 0),
            num_preemptions=getattr(getattr(e, "scheduler", None), "num_preemptions", 0),
            step_times={k: (int(n), s) for k, (n, s) in getattr(e, "step_times", {}).items()},
            prefix=prefix,
            spec_drafted=spec.drafted if spec else 0,
            spec_accepted=spec.accepted if spec else 0,
            spec_forwards=spec.forwards if spec else 0,
            spec_emitted=spec.emitted if spec else 0,
            spec_forced=spec.forced if spec else 0,
        )

    def _send(self, outputs: list[RequestOutput]) -> None:
        try:
            self._loop.call_soon_threadsafe(self._deliver, outputs)  # type: ignore[union-attr]
        except RuntimeError:  # the event loop is closed: we are shutting down
            self._stopping = True


def _failed(request_id: str, message: str) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        new_token_ids=[],
        new_text="",
        finished=True,
        finish_reason="error",
        error=message,
    )
