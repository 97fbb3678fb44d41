"""The gateway's link to an engine core in its own process (engine/ipc/core_process.py): it
starts the core and keeps it alive, or attaches to one another process owns; it carries
messages both ways. `EngineProcess` (engine/ipc/core_client.py) is the engine client built on it.

    start      spawn the core, connect to its socket, follow its loading (`Status`).
    serve      messages go out through a sender thread (the event loop never waits on the
               socket); a reader thread takes the core's outputs, stats, replies and adapter
               table and hands them to the client's callbacks.
    death      the socket closes (a CUDA fault, an OOM kill, `kill -9`, a rank that died):
               pending calls fail with `EngineUnavailable`, the client is told (`on_death`);
               not ready until a new core is loaded.
    restart    with the same settings, at most `restarts` times within `restart_window`
               seconds; past that `fatal_error` says why.

With `attach=(address, authkey)` it starts nothing: it connects to the core another gateway
process owns (`--api-servers`), and reconnects to its replacement after a death. This module
imports no torch.
"""

from __future__ import annotations

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
from engine.core.loop import LOAD_STAGES, STOP
from engine.ipc.wire import AdapterTable, Call, CoreFacts, Outputs, Reply, Status
from engine.messages import RequestOutput
from engine.protocols import EngineStats
from grammar.spec import GrammarError
from lora.info import AdapterExists, AdapterInfo, AdapterStats

log = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 0.0005  # as in the core's process (engine/ipc/core_process.py says why)
CONNECT_TIMEOUT_S = 60.0  # from spawn to the core's socket listening (imports, no model yet)
CALL_TIMEOUT_S = 300.0  # an adapter upload's validation in the core


class EngineUnavailable(RuntimeError):
    """The engine core died (or is restarting) while a call waited on it."""


class RemoteAdapterError(ValueError):
    """The core refused an adapter; `problems` lists why (lora's `AdapterError`, told over the
    socket)."""

    def __init__(self, message: str, problems: list[str]):
        super().__init__(message)
        self.problems = problems


class CoreLink:
    """Callbacks, called from the link's reader thread: `on_outputs(outputs)` and
    `on_death(why)`."""

    def __init__(
        self,
        config: EngineConfig,
        on_outputs: Callable[[list[RequestOutput]], None],
        on_death: Callable[[str], None],
        restarts: int = 3,
        restart_window: float = 600.0,
        engine_factory: Callable[[EngineConfig], Any] | None = None,
        attach: tuple[str, bytes] | None = None,
    ):
        self.config = config
        self.on_outputs, self.on_death = on_outputs, on_death
        self.adapters: RemoteAdapters | None = None  # once a core with LoRA has loaded
        self.attached = attach is not None
        self._workdir: str | None = None
        if attach is None:  # the socket's folder, the same for every core this one starts
            self._workdir = tempfile.mkdtemp(prefix="switchboard-core-")
            attach = (os.path.join(self._workdir, "core.sock"), os.urandom(16))
        self.address, self.authkey = attach
        self.max_restarts, self.restart_window = restarts, restart_window
        self.restarts = 0  # how many times the core was replaced
        self._factory = engine_factory
        self.status = Status(LOAD_STAGES[0])
        self.facts: CoreFacts | None = None
        self.load_error: BaseException | None = None
        self.stats = EngineStats()
        self.done_loading = threading.Event()
        self.serving = False  # a loaded core is connected
        self.fatal_error: str | None = None  # why no core will serve again
        self._stopping = False
        self._deaths: deque[float] = deque()
        self._conn: Connection | None = None
        self._epoch = 0  # which core's connection a queued message is for
        self._outbox: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        self._calls: dict[int, Future[Any]] = {}
        self._call_ids = itertools.count(1)
        self._lock = threading.Lock()  # _conn/_epoch/_calls/serving
        self.proc: Any = None  # the core's multiprocessing.Process
        self._supervisor: threading.Thread | None = None

    def start(self) -> None:
        if self._supervisor is not None:
            return
        sys.setswitchinterval(SWITCH_INTERVAL_S)  # the reader thread must not wait 5 ms
        self._supervisor = threading.Thread(target=self._supervise, name="core-supervisor",
                                            daemon=True)
        self._supervisor.start()
        threading.Thread(target=self._send_loop, name="core-sender", daemon=True).start()

    @property
    def restarting(self) -> bool:
        """A core died and its replacement is not serving yet."""
        return (not self.serving and self.done_loading.is_set() and self.load_error is None
                and self.fatal_error is None and not self._stopping)

    @property
    def alive(self) -> bool:
        return self._supervisor is not None and self._supervisor.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self.attached:  # the core is the owner's to stop
            self._outbox.put((-1, None))
            return
        self.send(STOP)
        if self._supervisor is not None:
            self._supervisor.join(timeout)  # it reaps the core once its socket closes
        proc = self.proc
        if proc is not None and proc.is_alive():
            proc.kill()
        self._outbox.put((-1, None))  # ends the sender
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)

    def send(self, msg: Any) -> None:
        """Queue `msg` for the core serving now (dropped if it dies first)."""
        self._outbox.put((self._epoch, msg))

    def call(self, method: str, *args: Any) -> Future[Any]:
        """Ask the core; the future resolves with its reply (or raises its error)."""
        fut: Future[Any] = Future()
        with self._lock:
            if not self.serving:
                fut.set_exception(EngineUnavailable("the engine core is not running"))
                return fut
            call_id = next(self._call_ids)
            self._calls[call_id] = fut
            self._outbox.put((self._epoch, Call(call_id, method, args)))
        return fut

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
            self.fatal_error = f"the engine core's supervisor failed: {e}"
            self._died(self.fatal_error)
            self.done_loading.set()

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
                self.fatal_error = (f"{why} ({len(self._deaths)} times in "
                               f"{self.restart_window:g} s; not restarted)")
                return
            self.restarts += 1
            log.warning("restarting the engine core (%d)", self.restarts)

    def _run_core(self) -> str | None:
        """Start one core and serve through it until it ends. Returns why it died, or None
        when it should not be restarted (it failed to load, or we are stopping)."""
        from engine.ipc.core_process import core_main

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
        if not self.done_loading.is_set():
            self.done_loading.set()
            return None
        if self.status.load_error is not None:  # a restart that could not load
            self.fatal_error = f"the engine core failed to load again: {self.status.load_error}"
            self._died(self.fatal_error)
            return None
        fatal = self.stats.fatal_error
        return f"{what}: {fatal}" if fatal else f"{what} (exit code {proc.exitcode})"

    def _died(self, why: str) -> None:
        with self._lock:
            self.serving = False
            self._conn = None
            self._epoch += 1
            calls, self._calls = self._calls, {}
        for fut in calls.values():
            fut.set_exception(EngineUnavailable(why))
        self.status = Status(LOAD_STAGES[0])
        self.stats = EngineStats()
        self.on_death(f"the engine failed: {why}")

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, Outputs):
            self.stats = msg.stats
            if msg.outputs:
                self.on_outputs(msg.outputs)
        elif isinstance(msg, Reply):
            with self._lock:
                fut = self._calls.pop(msg.call_id, None)
            if fut is not None:
                _settle(fut, msg)
        elif isinstance(msg, AdapterTable):
            if self.adapters is not None:
                self.adapters.update(msg)
        elif isinstance(msg, Status):
            self.status = msg
            if msg.load_error is not None and self.facts is None:
                self.load_error = RuntimeError(msg.load_error)
            if msg.facts is not None:
                self.facts = msg.facts
                if msg.facts.lora and self.adapters is None:
                    self.adapters = RemoteAdapters(self, msg.facts.adapter_store_dir)
                with self._lock:
                    self.serving = True
                self.done_loading.set()



class RemoteAdapters:
    """The core's adapter registry as `engine.protocols.AdapterRegistry`: `get` and `list` read
    the table the core last sent (safe on the event loop); `add` and `remove` ask the core and
    block (the gateway calls them off the event loop)."""

    def __init__(self, link: CoreLink, store_dir: Path | None):
        self._link, self._store_dir = link, store_dir
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
            pin: bool = False, version: str = "") -> AdapterInfo:
        return self._link.call("add_adapter", tenant, name, str(path), move, pin,
                               version).result(CALL_TIMEOUT_S)

    def remove(self, tenant: str, name: str) -> bool:
        return self._link.call("remove_adapter", tenant, name).result(CALL_TIMEOUT_S)

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
