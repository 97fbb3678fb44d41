"""The engine core's loop, apart from how it is reached: one `EngineCore` steps an `LLMEngine`
(or anything with its interface) and applies the commands put into its inbox between steps.
Two clients run it:

    engine/ipc/async_engine.py  `AsyncEngine`: the core in a thread of the caller's process (the
                            tests, `--engine-core thread`).
    engine/ipc/core_process.py  the core in its own process, reached over a socket by
                            engine/ipc/core_client.py's `EngineProcess` (`switchboard serve`).

The loop applies every queued command before each step (so an abort frees the request's KV
pages before the next step runs), steps while there is work, and hands each iteration's
outputs and a stats snapshot to `emit`. A failing request never stops the loop: an exception
while adding a request fails that request; one inside a step fails the requests of that step,
and the loop goes on. Only a fatal engine error (a tensor-parallel rank died) ends it.

This module imports no torch: the engine itself is built by `load`.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.kv.prefix_cache import PrefixCacheStats
from engine.messages import GenerateRequest, RequestOutput
from engine.protocols import EngineStats
from engine.sampling.params import InvalidRequestError

log = logging.getLogger(__name__)

LOAD_STAGES = ("locating weights", "loading model", "ready")
IDLE_POLL_S = 0.5  # an idle loop still looks at the engine this often (has a rank died?)
ENGINE_FAILED = "engine_failed"  # `RequestOutput.error_code` when the engine itself stopped


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class ReleaseSession:
    session_id: str


@dataclass(frozen=True)
class FailAll:
    why: str


STOP = "stop"  # the command that ends the loop
# Where the loop's wall time goes: blocked for work while idle, applying commands (adding
# requests), stepping, publishing the outputs and stats.
LOOP_PARTS = ("wait", "commands", "step", "publish")
Command = GenerateRequest | Abort | ReleaseSession | FailAll | str
Emit = Callable[[list[RequestOutput], EngineStats], None]


class EngineCore:
    """`load()` once, then `run()` until `stop()`; `put()` from any thread."""

    def __init__(
        self,
        config: EngineConfig,
        emit: Emit,
        engine_factory: Callable[[EngineConfig], Any] | None = None,
        on_stage: Callable[[str], None] | None = None,
    ):
        self.config = config
        self.engine: Any = None
        self.inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.stats = EngineStats()
        self._emit, self._factory = emit, engine_factory
        self._on_stage = on_stage or (lambda stage: None)
        self._live: set[str] = set()  # requests added and not finished
        self._stopping = False
        # Where the loop's wall time went (`EngineStats.loop_seconds`).
        self._seconds = dict.fromkeys(LOOP_PARTS, 0.0)

    # -- lifecycle --------------------------------------------------------------------------

    def load(self) -> None:
        """Build the engine (raises what loading raised)."""
        if self._factory is not None:
            self._on_stage(LOAD_STAGES[1])
            self.engine = self._factory(self.config)
        else:
            from engine.core.engine import LLMEngine
            from engine.runner.loader import resolve_model_dir

            resolve_model_dir(self.config.model, self.config.cache_dir)  # converts a GGUF once
            self._on_stage(LOAD_STAGES[1])
            self.engine = LLMEngine(self.config)
            self.engine.grammar.start()  # not on the first constrained request
        self.stats = self._snapshot()
        self._on_stage(LOAD_STAGES[2])

    def run(self) -> None:
        """Step until `stop()` or a fatal engine error; then close the engine."""
        try:
            while not self._stopping:
                try:
                    self._iterate()
                except Exception:  # the loop itself must survive anything
                    log.exception("engine loop iteration failed")
        finally:
            close = getattr(self.engine, "close", None)
            if close is not None:
                close()

    def put(self, command: Command) -> None:
        self.inbox.put(command)

    def stop(self) -> None:
        self._stopping = True
        self.inbox.put(STOP)

    @property
    def fatal_error(self) -> str | None:
        """Why the loaded engine stopped for good (a tensor-parallel rank died), else None."""
        return getattr(self.engine, "fatal_error", None)

    # -- one iteration ----------------------------------------------------------------------

    def _iterate(self) -> None:
        outputs = self._drain(block=not self.engine.has_unfinished_requests())
        t = time.perf_counter()
        if self.engine.has_unfinished_requests() and not self._stopping:
            outputs += self._step()
        self._live.difference_update(o.request_id for o in outputs if o.finished)
        published = time.perf_counter()
        self._seconds["step"] += published - t
        self.stats = self._snapshot()
        self._emit(outputs, self.stats)
        self._seconds["publish"] += time.perf_counter() - published

    def _drain(self, block: bool) -> list[RequestOutput]:
        """Apply queued commands; when idle, wait a while for the first one."""
        outputs: list[RequestOutput] = []
        while True:
            t = time.perf_counter()
            try:
                cmd = self.inbox.get(timeout=IDLE_POLL_S) if block else self.inbox.get_nowait()
            except queue.Empty:
                return outputs
            finally:
                got = time.perf_counter()
                self._seconds["wait" if block else "commands"] += got - t
            block = False
            if cmd == STOP:
                return outputs
            outputs += self._apply(cmd)
            self._seconds["commands"] += time.perf_counter() - got

    def _apply(self, cmd: Command) -> list[RequestOutput]:
        """One command; the outputs it ended (a failed add, the requests a FailAll ended)."""
        if isinstance(cmd, Abort):
            self._live.discard(cmd.request_id)
            try:
                self.engine.abort_request(cmd.request_id)  # nobody listens for its output
            except Exception:
                log.exception("aborting %s failed", cmd.request_id)
        elif isinstance(cmd, FailAll):
            return self._abort_all(set(self._live), cmd.why)
        elif isinstance(cmd, ReleaseSession):
            try:
                self.engine.release_session(cmd.session_id)
            except Exception:
                log.exception("releasing session %s failed", cmd.session_id)
        elif isinstance(cmd, GenerateRequest):
            err = self._add(cmd)
            if err is not None:
                return [err]
        return []

    def _add(self, req: GenerateRequest) -> RequestOutput | None:
        if self.fatal_error is not None:
            return failed(req.request_id, f"the engine stopped: {self.fatal_error}",
                          ENGINE_FAILED)
        try:
            self.engine.add_request(req.request_id, req.prompt_token_ids, req.params, req.tenant,
                                    req.session_id)
        except InvalidRequestError as e:
            return failed(req.request_id, e.message)
        except Exception as e:
            log.exception("adding request %s failed", req.request_id)
            return failed(req.request_id, f"{type(e).__name__}: {e}")
        self._live.add(req.request_id)
        return None

    def _step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except Exception as e:
            fatal = self.fatal_error
            if fatal is not None:  # nothing can run any more: fail everything, stop the loop
                log.error("engine stopped: %s", fatal)
                self._stopping = True
                return self._abort_all(set(self._live), f"the engine stopped: {fatal}",
                                       ENGINE_FAILED)
            # We cannot tell which request of the batch broke the step: fail the running ones
            # (this frees their pages), and any that finished inside the failed step (their
            # outputs are lost); keep serving the waiting ones.
            log.exception("engine step failed; failing the running requests")
            scheduler = self.engine.scheduler
            running = {r.request_id for r in scheduler.running}
            vanished = self._live - {r.request_id for r in scheduler.requests()}
            why = f"engine step failed: {e}"
            return self._abort_all(running, why) + [failed(rid, why) for rid in vanished]

    def _abort_all(self, request_ids: set[str], why: str,
                   code: str | None = None) -> list[RequestOutput]:
        """Abort these requests in the engine; their failed outputs, with `why`."""
        for rid in request_ids:
            try:
                self.engine.abort_request(rid)
            except Exception:
                log.exception("could not abort %s", rid)
        return [failed(rid, why, code) for rid in request_ids]

    def _snapshot(self) -> EngineStats:
        e = self.engine
        prefix = e.prefix_cache.stats() if hasattr(e, "prefix_cache") else PrefixCacheStats()
        spec = getattr(getattr(e, "speculator", None), "stats", None)
        return EngineStats(
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
            fatal_error=self.fatal_error,
            loop_seconds=dict(self._seconds),
        )


def failed(request_id: str, message: str, code: str | None = None) -> RequestOutput:
    """A request's last output when it failed (`code`: `ENGINE_FAILED` when the engine did)."""
    return RequestOutput(
        request_id=request_id,
        new_token_ids=[],
        new_text="",
        finished=True,
        finish_reason="error",
        error=message,
        error_code=code,
    )
