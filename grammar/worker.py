"""A compile worker: one subprocess that compiles untrusted specs under a memory cap.

Native compilers ignore Python-level timeouts and can grow without bound on a hostile schema,
so compilation never runs in the engine's process. The child caps its own address space
(RLIMIT_AS); the parent caps wall time by killing it. Either way the parent gets a
BackendError, and the next compile starts a fresh child.

The child is a plain `python -m grammar.worker` (not multiprocessing's spawn, which re-imports
the user's `__main__`), talking pickles over a socketpair.

The child also loads what it compiled and probes its first steps (grammar/probe.py), so that a
grammar that cannot start, or that fails on its own mask, is refused here; and it refuses an
artifact over its byte cap (MAX_ARTIFACT_BYTES by default), since unpickling one in the
engine's process holds the GIL (~2.5 ms per MB for outlines' index) and loading it peaks at
several times its size.
"""

from __future__ import annotations

import os
import pickle
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple

from grammar.backend import Backend, BackendError, Unsatisfiable
from grammar.backends import BACKEND_NAMES, make_backend
from grammar.probe import probe
from grammar.spec import ConstraintSpec
from grammar.vocab import TokenVocab

START_TIMEOUT_S = 120.0  # importing torch + xgrammar in a fresh child, on a busy machine
MAX_ARTIFACT_BYTES = 32 << 20  # a pickled compiled grammar, as the engine's process gets it


class Shipped(NamedTuple):
    """A compiled grammar as it left the worker."""

    artifact: Any  # the backend's artifact, for `Backend.load` (Any: each backend's own type)
    nbytes: int  # its pickled size
    compile_ms: float  # compiling, loading and probing it in the worker


class CompileWorker:
    """The parent's handle on one compile subprocess. Not thread-safe: one caller at a time."""

    def __init__(
        self,
        vocab: TokenVocab,
        memory_limit_mb: int | None,
        backends: Sequence[str] = BACKEND_NAMES,
        max_artifact_bytes: int = MAX_ARTIFACT_BYTES,
    ):
        self._vocab = vocab
        self._backends = tuple(backends)
        self._memory_limit_mb = memory_limit_mb
        self._max_artifact_bytes = max_artifact_bytes
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._ready = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Launch the child without waiting for it to finish importing."""
        ours, theirs = socket.socketpair()
        root = str(Path(__file__).resolve().parent.parent)  # so `-m grammar.worker` resolves
        path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        limit = str(self._memory_limit_mb or 0)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "grammar.worker", str(theirs.fileno()), limit],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            env=dict(os.environ, PYTHONPATH=path),
        )
        theirs.close()
        self._conn, self._ready = Connection(ours.detach()), False

    def compile(self, backend: str, spec: ConstraintSpec, timeout_s: float) -> Shipped:
        """Compile `spec` with `backend` in the child.

        Raises Unsatisfiable when no output satisfies `spec`; BackendError on a compile error,
        an artifact over the byte cap, after `timeout_s` of wall time, or when the child
        dies (e.g. over its memory cap); the child is then replaced on next use.
        """
        self._ensure_ready()
        assert self._conn is not None
        try:
            self._conn.send((backend, spec))
        except OSError:  # it died while idle; the spec is not to blame
            self.stop()
            self._ensure_ready()
            self._conn.send((backend, spec))
        if not self._conn.poll(timeout_s):
            self.stop()
            self.start()  # the replacement imports while the caller moves on
            raise BackendError(f"compilation took over the {timeout_s:g}s limit")
        status, value, ms = self._receive()
        if status == "oom":
            self.stop()
        if status == "unsatisfiable":
            raise Unsatisfiable(value)
        if status != "ok":
            raise BackendError(value)
        return Shipped(pickle.loads(value), len(value), ms)  # holds the GIL: bounded by the cap

    def _ensure_ready(self) -> None:
        # An idle child never writes, so readable-while-idle means it closed (died).
        dead = self._proc is None or self._proc.poll() is not None
        if dead or (self._ready and self._conn is not None and self._conn.poll(0)):
            self.stop()
            self.start()
        if not self._ready:  # handshake: "hello" once imported, vocab, "ready" once built
            self._wait_for("hello")
            assert self._conn is not None
            try:
                # The child is reading: no block.
                self._conn.send((self._vocab, self._backends, self._max_artifact_bytes))
            except OSError:
                self.stop()
                raise BackendError("the compile worker died while starting") from None
            self._wait_for("ready")
            self._ready = True

    def _wait_for(self, what: str) -> None:
        assert self._conn is not None
        if not self._conn.poll(START_TIMEOUT_S):
            self.stop()
            raise BackendError(f"the compile worker did not start in {START_TIMEOUT_S:.0f}s")
        status, _, _ = self._receive()
        assert status == what, status

    def stop(self) -> None:
        """Kill the child (if any) and forget it."""
        if self._conn is not None:
            self._conn.close()
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
        self._proc, self._conn, self._ready = None, None, False

    def _receive(self) -> tuple[str, Any, float]:
        """(status, value, ms) from the child. Any: by status, the pickled artifact (bytes), an
        error text or None."""
        assert self._conn is not None and self._proc is not None
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            try:
                code = self._proc.wait(5)
            except subprocess.TimeoutExpired:
                code = None
            self.stop()
            cap = f"{self._memory_limit_mb} MiB" if self._memory_limit_mb else "no"
            raise BackendError(
                f"the compile worker died (exit code {code}; {cap} memory cap)"
            ) from None


def serve(conn: Connection, memory_limit_mb: int) -> None:
    """The child: serve (backend, spec) requests on `conn` until the parent closes it. The
    parent first sends the vocabulary, the backends to build and the artifact byte cap."""
    conn.send(("hello", None, 0.0))
    vocab: TokenVocab
    vocab, names, max_artifact_bytes = conn.recv()
    missing: dict[str, str] = {}
    backends: dict[str, Backend] = {}
    for name in names:
        try:
            backends[name] = make_backend(name, vocab)
        except ImportError as e:  # an optional library that is not installed
            missing[name] = f"{name} is not installed ({e})"
    if memory_limit_mb:  # cap what compiling may add on top of the imports
        limit = _address_space_bytes() + (memory_limit_mb << 20)
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    conn.send(("ready", None, 0.0))
    while True:
        try:
            name, spec = conn.recv()
        except (EOFError, OSError):
            return
        if name not in backends:
            conn.send(("error", missing.get(name, f"unknown backend {name!r}"), 0.0))
            continue
        t0 = time.perf_counter()
        try:
            blob = _compile_and_probe(backends[name], spec, vocab, max_artifact_bytes)
            conn.send(("ok", blob, (time.perf_counter() - t0) * 1e3))
        except Unsatisfiable as e:
            conn.send(("unsatisfiable", str(e), 0.0))
        except Exception as e:  # a backend's own errors have many types
            message = str(e).splitlines()[0] if str(e) else type(e).__name__
            if isinstance(e, MemoryError) or "bad_alloc" in message:
                conn.send(("oom", f"compilation went over the {memory_limit_mb} MiB cap", 0.0))
                return  # the heap may be in a bad state; the parent starts a fresh child
            conn.send(("error", message, 0.0))


def _compile_and_probe(
    backend: Backend, spec: ConstraintSpec, vocab: TokenVocab, max_bytes: int
) -> bytes:
    """The pickled artifact of `spec`, once it is at most `max_bytes` and a matcher from it
    passed `probe`."""
    artifact = backend.compile(spec)
    blob = pickle.dumps(artifact, protocol=pickle.HIGHEST_PROTOCOL)
    if len(blob) > max_bytes:
        raise BackendError(
            f"the compiled grammar is {len(blob):,} bytes, over the {max_bytes:,} byte limit"
        )
    probe(backend.load(artifact)(), vocab)
    return blob


def _address_space_bytes() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:
        serve(Connection(int(sys.argv[1])), int(sys.argv[2]))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the parent stopped during the handshake: no one to tell
