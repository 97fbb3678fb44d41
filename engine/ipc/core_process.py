"""The engine core in its own process: `core_main` is the process, started (and restarted) by
the gateway's `EngineProcess` (engine/ipc/core_client.py).

The process listens on a Unix socket; each gateway process connects to it (the one that
started it first: its "owner"). Three kinds of threads keep the step loop off the socket:

    main        `EngineCore.run()`: apply commands, step, emit.
    readers     one per connection: unpickle what the gateway sent; commands go into the core's
                inbox, `Call`s are answered off the loop (a grammar compile's future, or the
                adapter registry in a small pool).
    writer      pickles and sends what the loop emitted: each connection its own requests'
                outputs, and to all of them the stats, status and adapter table.

The process ends when its owner (the gateway process that started it) says `STOP` or goes
away (its pid is no longer our parent: `kill -9` of the server leaves no orphan), and when the
engine stops for good (a tensor-parallel rank died): the owner then sees the socket close and
restarts it. Another gateway process (`--api-servers`) that goes away only loses its requests.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection, Listener
from typing import Any

from engine.config import EngineConfig
from engine.core.loop import LOAD_STAGES, STOP, Abort, EngineCore
from engine.ipc.parent_watch import watch_parent
from engine.ipc.wire import AdapterTable, Call, CoreFacts, Outputs, Reply, Status
from engine.messages import GenerateRequest, RequestOutput
from engine.protocols import EngineStats
from grammar.spec import GrammarError

log = logging.getLogger(__name__)

# How long a thread that wants the GIL waits for the one holding it (Python's default: 5 ms).
# The step loop holds it nearly always; at 5 ms the reader and writer threads came late enough
# that the batch ran emptier: on an H200 (8B, 128 streams) 602 steps of 9.7 ms instead of the
# offline engine's 475 of 10.6 ms, 0.885 of its tokens/s; at 0.5 ms, 475 steps and 0.970.
SWITCH_INTERVAL_S = 0.0005


def core_main(config: EngineConfig, address: str, authkey: bytes, parent_pid: int,
              engine_factory: Any = None) -> None:
    """The process's entry point (multiprocessing "spawn")."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s engine-core %(message)s")
    logging.getLogger("engine").setLevel(logging.INFO)  # start-up choices (auto settings)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    watch_parent(parent_pid)
    CoreServer(config, address, authkey, engine_factory).serve()


class CoreServer:
    def __init__(self, config: EngineConfig, address: str, authkey: bytes,
                 engine_factory: Any = None):
        if os.path.exists(address):  # the socket of the core this one replaces
            os.unlink(address)
        self.listener = Listener(address, "AF_UNIX", authkey=authkey)
        self.core = EngineCore(config, self._emit, engine_factory, self._on_stage)
        self.status = Status(LOAD_STAGES[0])
        self._out: queue.SimpleQueue[tuple[int | None, Any]] = queue.SimpleQueue()
        self._conns: dict[int, Connection] = {}
        self._owner_of: dict[str, int] = {}  # request id -> connection id
        self._lock = threading.Lock()  # the two maps above; snapshots in their send order
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="core-call")
        self._sent_stats: EngineStats | None = None
        self._table_version: tuple[int, ...] = ()

    def serve(self) -> None:
        threading.Thread(target=self._accept, name="core-accept", daemon=True).start()
        writer = threading.Thread(target=self._write, name="core-writer", daemon=True)
        writer.start()
        try:
            self.core.load()
        except BaseException as e:  # noqa: BLE001 - told to the gateway, which does not retry
            log.exception("engine failed to load")
            self._broadcast(Status(self.status.stage, load_error=f"{e}"))
        else:
            self._broadcast(Status(LOAD_STAGES[2], facts=self._facts()))
            self._send_table(force=True)
            self.core.run()
        self._out.put((None, None))  # the writer sends what is queued, then ends
        writer.join(10)
        self.listener.close()

    # -- connections --------------------------------------------------------------------------

    def _accept(self) -> None:
        cid = 0
        while True:
            try:
                conn = self.listener.accept()
            except OSError:  # closed: the process is ending
                return
            except Exception:  # a client that failed the handshake (wrong key)
                log.warning("refused a connection", exc_info=True)
                continue
            with self._lock:
                self._conns[cid] = conn
                self._out.put((cid, self.status))
            if self.status.facts is not None:
                self._send_table(force=True)
            threading.Thread(target=self._read, args=(cid, conn), name=f"core-read-{cid}",
                             daemon=True).start()
            cid += 1

    def _read(self, cid: int, conn: Connection) -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(msg, GenerateRequest):
                with self._lock:
                    self._owner_of[msg.request_id] = cid
                self.core.put(msg)
            elif isinstance(msg, Call):
                self._call(cid, msg)
            elif msg == STOP:
                self.core.stop()
            else:
                self.core.put(msg)
        with self._lock:
            self._conns.pop(cid, None)
            orphans = [rid for rid, c in self._owner_of.items() if c == cid]
        for rid in orphans:
            self.core.put(Abort(rid))

    def _write(self) -> None:
        while True:
            cid, msg = self._out.get()
            if msg is None:
                return
            with self._lock:
                conns = list(self._conns.values()) if cid is None else [self._conns.get(cid)]
            for conn in conns:
                if conn is None:
                    continue
                try:
                    conn.send(msg)
                except OSError:  # that gateway went away: its reader cleans up
                    pass

    def _broadcast(self, msg: Any) -> None:
        with self._lock:
            if isinstance(msg, Status):
                self.status = msg
            self._out.put((None, msg))

    # -- the loop's side ------------------------------------------------------------------------

    def _on_stage(self, stage: str) -> None:
        if stage != LOAD_STAGES[2]:  # "ready" goes out with the facts
            self._broadcast(Status(stage))

    def _emit(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        if not outputs and stats == self._sent_stats:
            return
        self._sent_stats = stats
        with self._lock:
            mine: dict[int, list[RequestOutput]] = {cid: [] for cid in self._conns}
            for out in outputs:
                cid = (self._owner_of.pop(out.request_id, None) if out.finished
                       else self._owner_of.get(out.request_id))
                if cid in mine:
                    mine[cid].append(out)
            for cid, outs in mine.items():
                self._out.put((cid, Outputs(outs, stats)))
        self._send_table()
        if stats.fatal_error is not None:  # end the process: the owner restarts the core
            self.core.stop()

    def _facts(self) -> CoreFacts:
        e = self.core.engine
        adapters = getattr(e, "adapters", None)
        mc = getattr(e, "model_config", None)
        return CoreFacts(
            max_model_len=e.max_model_len,
            max_num_seqs=e.max_num_seqs,
            vocab_size=mc.vocab_size if mc is not None else getattr(e, "vocab_size", 1 << 30),
            model_dir=e.model_dir,
            lora=adapters is not None,
            adapter_store_dir=getattr(adapters, "store_dir", None),
        )

    def _send_table(self, force: bool = False) -> None:
        """The adapter registry, when adapters moved between tiers (loads and evictions count
        those: a check of a few ints, since every step comes here), or always with `force`
        (after an add or a remove, and for a new connection)."""
        manager = getattr(self.core.engine, "adapters", None)
        if manager is None:
            return
        st = manager.stats
        version = (*st.loads.values(), *st.evictions.values())
        with self._lock:
            if version == self._table_version and not force:
                return
            self._table_version = version
            self._out.put((None, AdapterTable(manager.snapshot(), st, manager.num_resident)))

    # -- calls ----------------------------------------------------------------------------------

    def _call(self, cid: int, call: Call) -> None:
        if call.method == "compile_grammar":
            fut: Future[Any] = self.core.engine.grammar.compile(*call.args)
            # the compiled grammar stays here (it does not pickle): the reply says only "done"
            fut.add_done_callback(lambda f: self._reply(cid, call.call_id, f, value=False))
        else:
            self._pool.submit(self._adapter_call, cid, call)

    def _adapter_call(self, cid: int, call: Call) -> None:
        out: Future[Any] = Future()
        manager = self.core.engine.adapters
        try:
            if call.method == "add_adapter":
                tenant, name, path, move, pin, version = call.args
                out.set_result(manager.add(tenant, name, path, move=move, pin=pin,
                                           version=version))
            elif call.method == "remove_adapter":
                out.set_result(manager.remove(*call.args))
            else:
                raise ValueError(f"unknown call {call.method!r}")
        except Exception as e:  # noqa: BLE001 - the caller's error
            out.set_exception(e)
        self._send_table(force=True)  # before the reply: the gateway's copy is current then
        self._reply(cid, call.call_id, out)

    def _reply(self, cid: int, call_id: int, fut: Future[Any], value: bool = True) -> None:
        e = fut.exception()
        if e is None:
            self._out.put((cid, Reply(call_id, fut.result() if value else None)))
            return
        if isinstance(e, GrammarError):
            error: tuple[str, str, Any] = ("grammar", e.message, e.param)
        elif isinstance(e, KeyError) and type(e).__name__ == "AdapterExists":
            error = ("exists", str(e.args[0]) if e.args else "", None)
        elif isinstance(e, ValueError) and hasattr(e, "problems"):
            error = ("adapter", str(e), list(e.problems))
        else:
            error = ("error", f"{type(e).__name__}: {e}", None)
        self._out.put((cid, Reply(call_id, error=error)))

