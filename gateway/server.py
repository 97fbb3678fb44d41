"""Uvicorn in a background thread, so the caller's thread stays free (the CLI draws the
loading progress there; tests drive the server from theirs), on uvloop and httptools, with
every connection under gateway/access/connections.py's rules (`GuardedProtocol`)."""

from __future__ import annotations

import asyncio
import functools
import json
import math
import socket
import threading
import time
from asyncio import TimerHandle
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.access.connections import EXTENSION, ConnectionLimits, Connections, Phase

BACKLOG = 1024  # the kernel's accept queue (capped by net.core.somaxconn): bursts wait there


def _answer(status: str, code: str, message: str, extra: str = "") -> bytes:
    """A whole response in OpenAI's error shape that closes its connection."""
    body = json.dumps({"error": {"message": message, "type": "server_error", "param": None,
                                 "code": code}}).encode()
    head = (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n{extra}\r\n")
    return head.encode() + body


BUSY = _answer("503 Service Unavailable", "too_many_connections",
               "The server is at its connection limit; retry shortly.", "retry-after: 1\r\n")
LATE = _answer("408 Request Timeout", "request_timeout",
               "The request headers did not arrive in time.")


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol under `Connections`' rules: it reports each connection's
    phase, keeps its deadlines, and closes it when they pass or its place is taken. A request's
    ASGI scope carries the connection's `drop` as the extension `EXTENSION`."""

    def __init__(self, config: uvicorn.Config, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, *, guard: Connections):
        super().__init__(config, server_state, app_state, _loop)
        self.guard, self.limits = guard, guard.limits
        self.phase: Phase = "waiting"
        self.timer: TimerHandle | None = None
        self.body_due = 0.0  # the loop's time by which the body must have arrived
        self.idle = False  # between keep-alive requests (no byte of the next one yet)
        self.refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if not self.guard.admit(self):
            self.refused = True
            _close(transport, BUSY)
            return
        super().connection_made(transport)
        self._arm(self.limits.header_timeout, self._headers_late)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.refused:
            return
        self.guard.remove(self)
        self._disarm()
        super().connection_lost(exc)

    def drop(self, reason: str) -> None:
        if self not in self.guard.members:  # closed already
            return
        self.guard.dropped[reason] += 1
        self.guard.remove(self)
        self._disarm()
        if self.phase == "waiting":  # nothing to say: under a flood, a write costs as much
            _close(self.transport, None)
        else:  # its request in flight: its client may not be reading
            self.transport.abort()

    # -- the parser's events, in order ----------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {EXTENSION: {"drop": self.drop}}  # type: ignore[typeddict-unknown-key]
        if self.idle or self.timer is None:  # the headers' deadline runs from their first byte
            self._arm(self.limits.header_timeout, self._headers_late)
        self.idle = False
        self._enter("waiting")  # a keep-alive connection keeps its age

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()
        self._enter("receiving")
        self.body_due = self.loop.time() + self.limits.body_timeout
        self._arm(self.limits.body_timeout, self._body_late)

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self.body_due += len(body) / self.limits.body_min_rate

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()
        if self._answering_nothing and not self.pipeline:  # answered before its body came
            self._await_next()
        else:
            self._enter("busy")

    def on_response_complete(self) -> None:
        idle = self.phase == "busy" and not self.pipeline
        super().on_response_complete()
        if idle and not self.transport.is_closing():
            self._await_next()

    def _await_next(self) -> None:
        """Idle between requests: first to go at the cap, and closed after
        `keep_alive_timeout` unless a request begins (its first byte starts the header
        deadline)."""
        self.idle = True
        self._enter("waiting")
        self._arm(self.limits.keep_alive_timeout, self._idle_expired)

    # -- deadlines --------------------------------------------------------------------------

    def _headers_late(self) -> None:
        self.timer = None
        self.guard.dropped["header_timeout"] += 1
        self.guard.remove(self)
        _close(self.transport, None if self.idle or not self._answering_nothing else LATE)

    def _idle_expired(self) -> None:
        self.timer = None
        self.guard.remove(self)
        _close(self.transport, None)

    def _body_late(self) -> None:
        self.timer = None
        now = self.loop.time()
        if self.flow.read_paused:  # the app has not taken what came: the client may not send
            self.body_due = now + self.limits.body_timeout
        if now < self.body_due:
            self._arm(self.body_due - now, self._body_late)
        else:
            self.drop("body_timeout")

    @property
    def _answering_nothing(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _enter(self, phase: Phase) -> None:
        self.phase = phase
        self.guard.move(self, phase)

    def _arm(self, delay: float, then: Callable[[], None]) -> None:
        self._disarm()
        self.timer = self.loop.call_later(delay, then)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


def _shared_socket(host: str, port: int) -> socket.socket:
    """A listening socket with SO_REUSEPORT, bound to `host:port`."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(BACKLOG)
    return sock


def _close(transport: asyncio.Transport, answer: bytes | None) -> None:
    """Write `answer` (when given) and close; at once (a reset) if the client has not read
    what it was sent before, since a close waits for the write buffer to drain."""
    if answer is not None:
        transport.write(answer)
    if transport.get_write_buffer_size():
        transport.abort()
    else:
        transport.close()


class ServerThread:
    def __init__(self, app: FastAPI, host: str, port: int, log_level: str = "warning",
                 connections: Connections | None = None, reuse_port: bool = False):
        """`reuse_port`: listen on a socket other processes may bind too (`--api-servers`):
        the kernel spreads the connections among them."""
        self.connections = connections or Connections(ConnectionLimits())
        self.connections.fit_fd_limit(BACKLOG)
        protocol = functools.partial(GuardedProtocol, guard=self.connections)  # called as a class
        # uvicorn's own keep-alive timer (whole seconds) never fires before the protocol's.
        keep_alive = math.ceil(self.connections.limits.keep_alive_timeout) + 1
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                timeout_graceful_shutdown=5, backlog=BACKLOG, ws="none",
                                timeout_keep_alive=keep_alive,
                                http=protocol)  # type: ignore[arg-type]
        self.server = uvicorn.Server(config)
        self.host = host
        sockets = [_shared_socket(host, port)] if reuse_port else None
        self.thread = threading.Thread(target=self.server.run, args=(sockets,), name="uvicorn",
                                       daemon=True)

    def start(self, timeout: float = 30.0) -> None:
        """Start serving; return once the socket listens. Raises if it could not start."""
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"the server could not start on {self.host}")
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start in time")
            time.sleep(0.02)

    @property
    def port(self) -> int:
        """The bound port (useful with port 0)."""
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    def alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
