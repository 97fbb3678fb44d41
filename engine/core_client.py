"""The gateway's client of an engine core in its own process (engine/core_process.py): what
`switchboard serve` runs, so that the HTTP server's event loop and the step loop do not share
a GIL. It implements `engine.protocols.EngineClient` as `AsyncEngine` does, plus the runtime's
lifecycle (start, loading, drain, shutdown), and it keeps the core alive:

    start      spawn the core, connect to its socket, follow its loading (`Status`).
    serve      requests and commands go out through a sender thread (the event loop never
               waits on the socket); a reader thread takes the core's outputs, stats, replies
               and adapter table, and hands outputs to the event loop.
    death      the socket closes (a CUDA fault, an OOM kill, `kill -9`, a rank that died):
               every request in flight ends at once with finish_reason "error" and
               `error_code` "engine_failed"; not ready until a new core is loaded.
    restart    with the same settings, at most `restarts` times within `restart_window`
               seconds; past that `fatal_error` says why, and /health answers 503.

With `attach=(address, authkey)` it starts nothing: it connects to the core another gateway
process owns (`--api-servers`), and reconnects to its replacement after a death.

Facts the gateway checks requests against (context length, vocabulary) come with the core's
`Status` once it has loaded, so `validate` runs here, in the gateway. Grammar compiles and
adapter uploads are calls to the core; the adapter registry is mirrored here from the table
the core sends after every change. This module imports no torch.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Client, Connection
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.core import ENGINE_FAILED, LOAD_STAGES, STOP, Abort, FailAll, ReleaseSession, failed
from engine.messages import GenerateRequest, RequestOutput
from engine.protocols import AdapterRegistry, EngineStats, Sink
from engine.sampling_params import InvalidRequestError, SamplingParams, check_request
from engine.wire import AdapterTable, Call, CoreFacts, Outputs, Reply, Status
from grammar.spec import ConstraintSpec, GrammarError
from lora.info import AdapterExists, AdapterInfo, AdapterStats

log = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 0.0005  # as in the core's process (engine/core_process.py says why)
CONNECT_TIMEOUT_S = 60.0  # from spawn to the core's socket listening (imports, no model yet)
CALL_TIMEOUT_S = 300.0  # an adapter upload's validation in the core


class EngineUnavailable(RuntimeError):
    """The engine core died (or is restarting) while a call waited on it."""


class EngineProcess:
    def __init__(
        self,
        config: EngineConfig,
        restarts: int = 3,
        restart_window: float = 600.0,
        engine_factory: Callable[[EngineConfig], Any] | None = None,
        attach: tuple[str, bytes] | None = None,
    ):
        self.config = config
        self.attached = attach is not None
        self._workdir: str | None = None
        if attach is None:  # the socket's folder, the same for every core this one starts
            self._workdir = tempfile.mkdtemp(prefix="switchboard-core-")
            attach = (os.path.join(self._workdir, "core.sock"), os.urandom(16))
        self.address, self.authkey = attach
        self.max_restarts, self.restart_window = restarts, restart_window
        self.restarts = 0  # how many times the core was replaced
        self._factory = engine_factory
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sinks: dict[str, Sink] = {}  # event loop side
        self._status = Status(LOAD_STAGES[0])
        self.facts: CoreFacts | None = None
        self.load_error: BaseException | None = None
        self.stats = EngineStats()
        self._adapters: RemoteAdapters | None = None
        self._done_loading = threading.Event()
        self._serving = False  # a loaded core is connected
        self._fatal: str | None = None
        self._stopping = False
        self._deaths: deque[float] = deque()
        self._conn: Connection | None = None
        self._epoch = 0  # which core's connection a queued message is for
        self._outbox: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        self._calls: dict[int, Future[Any]] = {}
        self._call_ids = itertools.count(1)
        self._lock = threading.Lock()  # _conn/_epoch/_calls
        self.proc: Any = None  # the core's multiprocessing.Process
        self._supervisor: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._supervisor is not None:
            return
        self._loop = loop
        sys.setswitchinterval(SWITCH_INTERVAL_S)  # the reader thread must not wait 5 ms
        self._supervisor = threading.Thread(target=self._supervise, name="core-supervisor",
                                            daemon=True)
        self._supervisor.start()
        threading.Thread(target=self._send_loop, name="core-sender", daemon=True).start()

    @property
    def ready(self) -> bool:
        return self._serving and self._fatal is None and self.stats.fatal_error is None

    @property
    def restarting(self) -> bool:
        """A core died and its replacement is not serving yet."""
        return (not self._serving and self._done_loading.is_set() and self.load_error is None
                and self._fatal is None and not self._stopping)

    @property
    def fatal_error(self) -> str | None:
        """Why no core will serve again (it kept dying: restarts exhausted), else None."""
        return self._fatal

    @property
    def alive(self) -> bool:
        return self._supervisor is not None and self._supervisor.is_alive()

    @property
    def load_stage(self) -> str:
        return self._status.stage

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Block (not on the event loop) until the first core loaded or failed to."""
        return self._done_loading.wait(timeout)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self.attached:  # the core is the owner's to stop
            self._outbox.put((-1, None))
            return
        self._send(STOP)
        if self._supervisor is not None:
            self._supervisor.join(timeout)  # it reaps the core once its socket closes
        proc = self.proc
        if proc is not None and proc.is_alive():
            proc.kill()
        self._outbox.put((-1, None))  # ends the sender
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)

    # -- facts --------------------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self._facts.max_model_len

    @property
    def model_dir(self) -> Path:
        return self._facts.model_dir

    @property
    def adapters(self) -> AdapterRegistry | None:
        return self._adapters

    @property
    def _facts(self) -> CoreFacts:
        if self.facts is None:
            raise EngineUnavailable("the engine core has not loaded")
        return self.facts

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        f = self._facts
        check_request(prompt_token_ids, params, f.vocab_size, f.max_model_len)

    async def compile_grammar(self, spec: ConstraintSpec) -> None:
        await asyncio.wrap_future(self.call("compile_grammar", spec))

    # -- requests (event loop side) -----------------------------------------------------------

    @property
    def num_outstanding(self) -> int:
        return len(self._sinks)

    def add_request(self, request: GenerateRequest, sink: Sink) -> None:
        if request.request_id in self._sinks:
            raise InvalidRequestError(f"duplicate request id {request.request_id!r}")
        if not self._serving:  # died just now: the death's failures went out already
            sink.put_nowait(failed(request.request_id, "the engine core is not running",
                                   ENGINE_FAILED))
            return
        self._sinks[request.request_id] = sink
        self._send(request)

    def abort(self, request_id: str) -> None:
        if self._sinks.pop(request_id, None) is not None:
            self._send(Abort(request_id))

    def release_session(self, session_id: str) -> None:
        self._send(ReleaseSession(session_id))

    def fail_all(self, why: str) -> None:
        self._send(FailAll(why))

    def call(self, method: str, *args: Any) -> Future[Any]:
        """Ask the core; the future resolves with its reply (or raises its error)."""
        fut: Future[Any] = Future()
        with self._lock:
            if not self._serving:
                fut.set_exception(EngineUnavailable("the engine core is not running"))
                return fut
            call_id = next(self._call_ids)
            self._calls[call_id] = fut
            self._outbox.put((self._epoch, Call(call_id, method, args)))
        return fut

    def _send(self, msg: Any) -> None:
        self._outbox.put((self._epoch, msg))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue  # aborted by the gateway: nobody listens any more
            if out.finished:
                del self._sinks[out.request_id]
            sink.put_nowait(out)

    def _fail_outstanding(self, why: str) -> None:
        sinks, self._sinks = self._sinks, {}
        for rid, sink in sinks.items():
            sink.put_nowait(failed(rid, why, ENGINE_FAILED))

    # -- threads ------------------------------------------------------------------------------

    def _send_loop(self) -> None:
        while True:
            epoch, msg = self._outbox.get()
            if msg is None:
                return
            with self._lock:
                conn = self._conn if epoch == self._epoch else None
            if conn is None:
                continue  # for a core that died: the death failed its requests
            try:
                conn.send(msg)
            except OSError:  # it is dying: the reader sees the socket close
                pass

    def _supervise(self) -> None:
        try:
            self._keep_serving()
        except Exception as e:  # a bug here must not leave a server that looks alive
            log.exception("the engine core's supervisor failed")
            self._fatal = f"the engine core's supervisor failed: {e}"
            self._died(self._fatal)
            self._done_loading.set()

    def _keep_serving(self) -> None:
        while not self._stopping:
            why = self._attach() if self.attached else self._run_core()
            if why is None or self._stopping:
                return
            log.error("%s; failing the requests in flight", why)
            self._died(why)
            if self.attached:
                continue  # the owner restarts it (or, past its limit, stops this process)
            now = time.monotonic()
            self._deaths.append(now)
            while self._deaths and now - self._deaths[0] > self.restart_window:
                self._deaths.popleft()
            if len(self._deaths) > self.max_restarts:
                self._fatal = (f"{why} ({len(self._deaths)} times in "
                               f"{self.restart_window:g} s; not restarted)")
                return
            self.restarts += 1
            log.warning("restarting the engine core (%d)", self.restarts)

    def _run_core(self) -> str | None:
        """Start one core and serve through it until it ends. Returns why it died, or None
        when it should not be restarted (it failed to load, or we are stopping)."""
        from engine.core_process import core_main

        proc = mp.get_context("spawn").Process(
            target=core_main, name="switchboard-core", daemon=False,  # it starts TP workers
            args=(self.config, self.address, self.authkey, os.getpid(), self._factory))
        proc.start()
        self.proc = proc
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        conn = _connect(self.address, self.authkey,
                        lambda: proc.is_alive() and time.monotonic() < deadline)
        if conn is None:
            return self._ended(proc, "the engine core exited while starting")
        self._serve(conn)
        return self._ended(proc, "the engine core stopped")

    def _attach(self) -> str | None:
        """Serve through the owner's core until it ends (None: we are stopping)."""
        conn = _connect(self.address, self.authkey, lambda: not self._stopping)
        if conn is None:
            return None
        self._serve(conn)
        return None if self._stopping else (
            f"the engine core stopped: {self.stats.fatal_error}" if self.stats.fatal_error
            else "the engine core stopped")

    def _serve(self, conn: Connection) -> None:
        with self._lock:
            self._conn = conn
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            self._handle(msg)
        conn.close()

    def _ended(self, proc: Any, what: str) -> str | None:
        proc.join(2.0)
        if proc.is_alive():  # the socket closed but it lingers: make sure it is gone
            proc.kill()
            proc.join(5.0)
        if self._stopping:
            return None
        if self.facts is None and self.load_error is None:  # never loaded: not a death
            self.load_error = RuntimeError(f"{what} (exit code {proc.exitcode})")
        if not self._done_loading.is_set():
            self._done_loading.set()
            return None
        if self._status.load_error is not None:  # a restart that could not load
            self._fatal = f"the engine core failed to load again: {self._status.load_error}"
            self._died(self._fatal)
            return None
        fatal = self.stats.fatal_error
        return f"{what}: {fatal}" if fatal else f"{what} (exit code {proc.exitcode})"

    def _died(self, why: str) -> None:
        with self._lock:
            self._serving = False
            self._conn = None
            self._epoch += 1
            calls, self._calls = self._calls, {}
        for fut in calls.values():
            fut.set_exception(EngineUnavailable(why))
        self._status = Status(LOAD_STAGES[0])
        self.stats = EngineStats()
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._fail_outstanding,
                                                f"the engine failed: {why}")
            except RuntimeError:  # the event loop is closed
                pass

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, Outputs):
            self.stats = msg.stats
            if msg.outputs and self._loop is not None:
                self._loop.call_soon_threadsafe(self._deliver, msg.outputs)
        elif isinstance(msg, Reply):
            with self._lock:
                fut = self._calls.pop(msg.call_id, None)
            if fut is not None:
                _settle(fut, msg)
        elif isinstance(msg, AdapterTable):
            if self._adapters is not None:
                self._adapters.update(msg)
        elif isinstance(msg, Status):
            self._status = msg
            if msg.load_error is not None and self.facts is None:
                self.load_error = RuntimeError(msg.load_error)
            if msg.facts is not None:
                self.facts = msg.facts
                if msg.facts.lora and self._adapters is None:
                    self._adapters = RemoteAdapters(self, msg.facts.adapter_store_dir)
                with self._lock:
                    self._serving = True
                self._done_loading.set()


class RemoteAdapterError(ValueError):
    """The core refused an adapter; `problems` lists why (lora's `AdapterError`, told over the
    socket)."""

    def __init__(self, message: str, problems: list[str]):
        super().__init__(message)
        self.problems = problems


class RemoteAdapters:
    """The core's adapter registry as `engine.protocols.AdapterRegistry`: `get` and `list` read
    the table the core last sent (safe on the event loop); `add` and `remove` ask the core and
    block (the gateway calls them off the event loop)."""

    def __init__(self, client: EngineProcess, store_dir: Path | None):
        self._client, self._store_dir = client, store_dir
        self._table: dict[tuple[str, str], AdapterInfo] = {}
        self._stats = AdapterStats()
        self._resident: dict[str, int] = {"device": 0, "host": 0}

    def update(self, table: AdapterTable) -> None:
        self._table = {(a.tenant, a.name): a for a in table.adapters}
        self._stats, self._resident = table.stats, table.resident

    @property
    def store_dir(self) -> Path | None:
        return self._store_dir

    @property
    def stats(self) -> AdapterStats:
        return self._stats

    @property
    def num_resident(self) -> dict[str, int]:
        return self._resident

    def add(self, tenant: str, name: str, path: str | Path, *, move: bool = False,
            pin: bool = False) -> AdapterInfo:
        return self._client.call("add_adapter", tenant, name, str(path), move, pin).result(
            CALL_TIMEOUT_S)

    def remove(self, tenant: str, name: str) -> bool:
        return self._client.call("remove_adapter", tenant, name).result(CALL_TIMEOUT_S)

    def get(self, tenant: str, name: str) -> AdapterInfo | None:
        return self._table.get((tenant, name))

    def list(self, tenant: str) -> list[AdapterInfo]:
        mine = [a for (t, _), a in self._table.items() if t == tenant]
        return sorted(mine, key=lambda a: (a.created, a.name))


def _settle(fut: Future[Any], reply: Reply) -> None:
    if reply.error is None:
        fut.set_result(reply.value)
        return
    kind, message, details = reply.error
    if kind == "grammar":
        fut.set_exception(GrammarError(message, details))
    elif kind == "adapter":
        fut.set_exception(RemoteAdapterError(message, details))
    elif kind == "exists":
        fut.set_exception(AdapterExists(message))
    else:
        fut.set_exception(RuntimeError(message))


def _connect(address: str, authkey: bytes, keep_trying: Callable[[], bool]
             ) -> Connection | None:
    """Connect once the core listens; None once `keep_trying()` says to give up."""
    while keep_trying():
        try:
            return Client(address, "AF_UNIX", authkey=authkey)
        except (OSError, EOFError):  # not listening yet, or the core it reached just died
            time.sleep(0.02)
    return None
