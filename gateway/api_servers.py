"""`--api-servers N`: N-1 more HTTP server processes beside `switchboard serve`'s own, on the
same port (SO_REUSEPORT: the kernel spreads connections among them) and over its engine core,
so JSON, SSE and tokenization run on more cores than one.

`switchboard serve` owns the core: it starts it, restarts it, and stops it. Each process
started here attaches to the core's socket (`EngineProcess(attach=...)`), serves until it is
told to drain (SIGTERM, forwarded by the owner) and exits with its owner. Sessions, stored
responses and tenant limits are shared through Redis (`--redis-url` is required), adapters
through the core.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from typing import Any

from gateway.config import ServeConfig

READY_TIMEOUT_S = 120.0


class APIServers:
    """The owner's handle on the other HTTP processes."""

    def __init__(self, cfg: ServeConfig, port: int, address: str, authkey: bytes):
        ctx = mp.get_context("spawn")
        self.ready = [ctx.Event() for _ in range(1, cfg.api_servers)]
        self.procs = [
            ctx.Process(target=api_server_main, name=f"switchboard-api{i}", daemon=True,
                        args=(cfg, port, address, authkey, os.getpid(), event))
            for i, event in enumerate(self.ready, start=1)
        ]
        for p in self.procs:
            p.start()

    def wait_ready(self) -> str | None:
        """Wait until every process serves; why one could not, else None."""
        for p, event in zip(self.procs, self.ready, strict=True):
            while not event.wait(0.2):
                if not p.is_alive():
                    return f"HTTP server process {p.name} exited with code {p.exitcode}"
        return None  # each gives up by itself after READY_TIMEOUT_S

    def drain(self) -> None:
        """SIGTERM each: they drain, as the owner does meanwhile."""
        for p in self.procs:
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGTERM)

    def stop(self, timeout: float) -> None:
        """Wait up to `timeout` s for each (draining ones finish their requests), then kill."""
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join(5)


def api_server_main(cfg: ServeConfig, port: int, address: str, authkey: bytes, parent: int,
                    ready: Any) -> None:
    """One more HTTP server (the process's entry point, multiprocessing "spawn")."""
    from engine.ipc.core_client import EngineProcess
    from engine.ipc.parent_watch import watch_parent
    from gateway.app import create_app
    from gateway.server import ServerThread

    watch_parent(parent)
    term = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: term.set())
    signal.signal(signal.SIGINT, lambda *_: term.set())
    engine = EngineProcess(cfg.engine_config(), attach=(address, authkey))
    app = create_app(cfg, engine)
    runtime = app.state.runtime
    server = ServerThread(app, cfg.host, port, cfg.log_level, runtime.connections,
                          reuse_port=True)
    server.start()
    try:
        if not runtime.loaded.wait(READY_TIMEOUT_S) or runtime.load_error is not None:
            return
        ready.set()
        while server.alive() and not term.wait(0.5):
            pass
        if term.is_set():
            runtime.drain(cfg.drain_timeout)
    finally:
        server.stop()
