"""The gateway's engine client when the engine core runs in its own process (what
`switchboard serve` runs, so that the HTTP event loop and the step loop do not share a GIL):
`EngineProcess` implements `engine.protocols.EngineClient` as `AsyncEngine` does, plus the
runtime's lifecycle (start, loading, drain, shutdown), over engine/ipc/core_link.py's `CoreLink`,
which starts the core, carries the messages and restarts it when it dies.

A core that dies ends every request in flight at once with finish_reason "error" and
`error_code` "engine_failed". Facts the gateway checks requests against (context length,
vocabulary) come with the core's `Status` once it has loaded, so `validate` runs here, in the
gateway. Grammar compiles and adapter uploads are calls to the core; the adapter registry is
mirrored by the link (`RemoteAdapters`) from the table the core sends after every change. This
module imports no torch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.core.loop import ENGINE_FAILED, Command, failed
from engine.ipc.core_link import CoreLink, EngineUnavailable, RemoteAdapterError, RemoteAdapters
from engine.ipc.sinks import SinkClient
from engine.ipc.wire import CoreFacts
from engine.messages import GenerateRequest, RequestOutput
from engine.protocols import AdapterRegistry, EngineStats, Sink
from engine.sampling.params import SamplingParams, check_request
from grammar.spec import ConstraintSpec

__all__ = ["EngineProcess", "EngineUnavailable", "RemoteAdapterError", "RemoteAdapters"]


class EngineProcess(SinkClient):
    def __init__(
        self,
        config: EngineConfig,
        restarts: int = 3,
        restart_window: float = 600.0,
        engine_factory: Callable[[EngineConfig], Any] | None = None,
        attach: tuple[str, bytes] | None = None,
    ):
        super().__init__()
        self.config = config
        self.link = CoreLink(config, self._on_outputs, self._on_death, restarts, restart_window,
                             engine_factory, attach)
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle (the runtime's) ------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.link.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self.link.shutdown(timeout)

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Block (not on the event loop) until the first core loaded or failed to."""
        return self.link.done_loading.wait(timeout)

    @property
    def ready(self) -> bool:
        link = self.link
        return link.serving and link.fatal_error is None and link.stats.fatal_error is None

    @property
    def restarting(self) -> bool:
        return self.link.restarting

    @property
    def fatal_error(self) -> str | None:
        """Why no core will serve again (it kept dying: restarts exhausted), else None."""
        return self.link.fatal_error

    @property
    def load_error(self) -> BaseException | None:
        return self.link.load_error

    @property
    def load_stage(self) -> str:
        return self.link.status.stage

    @property
    def stats(self) -> EngineStats:
        return self.link.stats

    # -- facts --------------------------------------------------------------------------------

    @property
    def facts(self) -> CoreFacts:
        if self.link.facts is None:
            raise EngineUnavailable("the engine core has not loaded")
        return self.link.facts

    @property
    def max_model_len(self) -> int:
        return self.facts.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.facts.max_num_seqs

    @property
    def model_dir(self) -> Path:
        return self.facts.model_dir

    @property
    def adapters(self) -> AdapterRegistry | None:
        return self.link.adapters

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        f = self.facts
        check_request(prompt_token_ids, params, f.vocab_size, f.max_model_len)

    async def compile_grammar(self, spec: ConstraintSpec) -> None:
        await asyncio.wrap_future(self.link.call("compile_grammar", spec))

    # -- requests (event loop side) -----------------------------------------------------------

    def add_request(self, request: GenerateRequest, sink: Sink) -> None:
        if not self.link.serving and request.request_id not in self._sinks:
            # died just now: the death's failures went out already
            sink.put_nowait(failed(request.request_id, "the engine core is not running",
                                   ENGINE_FAILED))
            return
        super().add_request(request, sink)

    def _send(self, command: Command) -> None:
        self.link.send(command)

    # -- the link's callbacks (its reader thread) ---------------------------------------------

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _on_death(self, why: str) -> None:
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._fail_outstanding, why)
            except RuntimeError:  # the event loop is closed
                pass

    # -- the event loop's side of them --------------------------------------------------------

    def _fail_outstanding(self, why: str) -> None:
        sinks, self._sinks = self._sinks, {}
        for rid, sink in sinks.items():
            sink.put_nowait(failed(rid, why, ENGINE_FAILED))
