"""The engine core (engine/core/loop.py) in a thread of this process, fed from an asyncio event
loop: the offline tests' and `--engine-core thread`'s client (`switchboard serve` runs the core
in its own process: engine/ipc/core_client.py).

The gateway never blocks on an engine step. It calls `add_request` / `abort` from its event
loop; those only enqueue a command. The core's thread applies the commands before every step,
steps while there is work, and hands each step's `RequestOutput`s back to the event loop, where
they land in the asyncio queue (the "sink") registered for their request.

This module imports no torch: the engine itself is built inside the thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.core.loop import LOAD_STAGES, Command, EngineCore
from engine.ipc.sinks import SinkClient
from engine.messages import RequestOutput
from engine.protocols import AdapterRegistry, EngineStats
from engine.sampling.params import SamplingParams
from grammar.spec import ConstraintSpec

log = logging.getLogger(__name__)

__all__ = ["LOAD_STAGES", "AsyncEngine"]


class AsyncEngine(SinkClient):
    """An `EngineCore` and the thread that runs it. Request handling sees it as an
    `engine.protocols.EngineClient`; the rest (start, loading, drain, shutdown) is the gateway
    runtime's.

    Contract:
      - `start(loop)` once; the engine is built in the thread. `ready` / `load_error` tell
        how that went; `load_stage` names the current stage of `LOAD_STAGES`.
      - `add_request(req, sink)` and `abort(request_id)` are called on `loop` only. Every
        output for `req.request_id` is put into `sink`, the last with `finished=True`
        (finish_reason "error" with `error` set when the engine failed the request).
    """

    def __init__(
        self,
        config: EngineConfig,
        engine_factory: Callable[[EngineConfig], Any] | None = None,
    ):
        super().__init__()
        self.config = config
        self.core = EngineCore(config, self._emit, engine_factory, self._set_stage)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._done_loading = threading.Event()
        self._closed = False
        self.load_stage = LOAD_STAGES[0]
        self.load_error: BaseException | None = None

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
        return self.core.fatal_error

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Block (not on the event loop) until loading succeeded or failed."""
        return self._done_loading.wait(timeout)

    def shutdown(self, timeout: float = 10.0) -> None:
        self.core.stop()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- facts about the loaded engine (read-only after loading, so safe from any thread) --

    @property
    def _engine(self) -> Any:
        """The `LLMEngine` (torch), built in the thread; or a test's fake."""
        return self.core.engine

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self._engine.max_num_seqs

    @property
    def model_dir(self) -> Path:
        return self._engine.model_dir

    @property
    def adapters(self) -> AdapterRegistry | None:
        """The engine's LoRA adapter manager (its registry methods are thread-safe); None
        before loading or for an engine without one."""
        return getattr(self._engine, "adapters", None)

    @property
    def stats(self) -> EngineStats:
        return self.core.stats

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise `InvalidRequestError` now, before the request is queued. Reads only
        immutable engine facts (vocab size, context length), so it is safe off-thread."""
        self._engine.validate(prompt_token_ids, params)

    async def compile_grammar(self, spec: ConstraintSpec) -> None:
        """Compile a constraint (or find it cached) before the request is queued; raises
        `grammar.spec.GrammarError` when no backend can compile it. Thread-safe: the compiler
        has its own lock and workers."""
        await asyncio.wrap_future(self._engine.grammar.compile(spec))

    # -- the engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.core.load()
        except BaseException as e:  # noqa: BLE001 - reported through load_error
            log.exception("engine failed to load")
            self.load_error = e
            self._done_loading.set()
            return
        self._ready.set()
        self._done_loading.set()
        self.core.run()

    def _send(self, command: Command) -> None:
        self.core.put(command)

    def _set_stage(self, stage: str) -> None:
        self.load_stage = stage

    def _emit(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        if not outputs or self._closed:
            return
        try:
            self._loop.call_soon_threadsafe(self._deliver, outputs)  # type: ignore[union-attr]
        except RuntimeError:  # the event loop is closed: we are shutting down
            self._closed = True
            self.core.stop()
