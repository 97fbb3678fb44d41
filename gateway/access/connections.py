"""Who may hold a connection, and for how long: the rules gateway/server.py's protocol applies
to every HTTP connection, kept apart from it so that they read (and test) alone.

A connection is `waiting` (for a request's headers, or idle between keep-alive requests),
`receiving` (a request's body) or `busy` (its request is being answered). Waiting and
receiving have deadlines: the headers within `header_timeout`, the body within `body_timeout`
plus one second per `body_min_rate` bytes it carries; an idle connection stays open
`keep_alive_timeout`, longer than clients keep theirs (httpx and the openai SDK drop an idle
connection after 5 s): a server that closes first races the client's next request on that
connection, and the client reads a reset. At `max_connections`, a new connection
takes the place of the one that has waited longest for its headers (else of the oldest one
still sending its body), which is closed; only when every connection is busy is the new one
refused, with a 503. Busy connections are few, since admission answers a request beyond the
seats and queue with a 429 at once, so a flood of slow or idle connections holds no place a
newcomer cannot take: a probe's fresh connection gets in, and `/health` answers through it.

The cap sits below the process's file-descriptor limit (`fit_fd_limit`), so the process never
runs out of descriptors, whatever the clients do.
"""

from __future__ import annotations

import logging
import resource
from collections import Counter, OrderedDict
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

log = logging.getLogger(__name__)

Phase = Literal["waiting", "receiving", "busy"]
# Why a connection was closed by us: its headers or body too late, its place taken by a newer
# one, refused at the cap, or its client stopped reading a stream (gateway/openai/generation.py).
REASONS = ("header_timeout", "body_timeout", "evicted", "refused", "stream_buffer")
EXTENSION = "switchboard.connection"  # the ASGI scope extension holding the connection's `drop`
FD_RESERVE = 256  # descriptors kept for the process's own files, pipes and clients


@dataclass(frozen=True)
class ConnectionLimits:
    """The rules' numbers (`switchboard serve` sets them from its flags)."""

    header_timeout: float = 10.0
    body_timeout: float = 30.0
    body_min_rate: int = 16 * 1024  # bytes/s
    max_connections: int = 65536
    keep_alive_timeout: float = 75.0


class Conn(Protocol):
    def drop(self, reason: str) -> None:
        """Close the connection now (unflushed when its client is not reading), counted."""


class Connections:
    """The open connections of one server, by phase, oldest first; and the counts of those
    we closed, by reason. Used on the event loop only."""

    def __init__(self, limits: ConnectionLimits):
        self.limits = limits
        self.cap = limits.max_connections  # lowered by `fit_fd_limit`
        self.members: set[Conn] = set()
        self.order: dict[Phase, OrderedDict[Conn, None]] = {
            "waiting": OrderedDict(), "receiving": OrderedDict()}
        self.dropped: Counter[str] = Counter()

    @property
    def open(self) -> int:
        return len(self.members)

    def admit(self, conn: Conn) -> bool:
        """A new connection, waiting for its headers. At the cap, the stalest waiting (else
        receiving) connection makes room; False (refused, counted) when all are busy."""
        if self.open >= self.cap:
            victim = next(iter(self.order["waiting"]), None)
            victim = victim or next(iter(self.order["receiving"]), None)
            if victim is None:
                self.dropped["refused"] += 1
                return False
            victim.drop("evicted")
        self.members.add(conn)
        self.order["waiting"][conn] = None
        return True

    def move(self, conn: Conn, phase: Phase) -> None:
        """`conn` is now in `phase`; one already there keeps its place (its age)."""
        if conn not in self.members:
            return
        for name, queue in self.order.items():
            if name != phase:
                queue.pop(conn, None)
        if phase != "busy":
            self.order[phase].setdefault(conn)

    def remove(self, conn: Conn) -> None:
        """`conn` is closed (or closing). Idempotent."""
        self.members.discard(conn)
        for queue in self.order.values():
            queue.pop(conn, None)

    def fit_fd_limit(self, backlog: int) -> None:
        """Raise the soft file-descriptor limit to the hard one, and lower the cap below it:
        connections are accepted before they are admitted (a whole accept queue, `backlog`, in
        one turn of the loop) and those they evict close a turn later, so two queues' worth
        stay free, and `FD_RESERVE` for the process's own files, pipes and clients."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard != resource.RLIM_INFINITY and soft < hard:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
                soft = hard
            except (ValueError, OSError) as e:
                log.warning("could not raise the open-file limit to %d: %s", hard, e)
        room = soft - 2 * backlog - FD_RESERVE
        if room < self.cap:  # `switchboard_connections_max` on /metrics shows it too
            log.info("--max-connections %d lowered to %d: the open-file limit is %d",
                     self.cap, room, soft)
            self.cap = max(1, room)


def connection_drop(scope: MutableMapping[str, Any]) -> Callable[[str], None] | None:
    """The request's connection's `drop(reason)`, when gateway/server.py serves it (None in an
    in-process test client)."""
    ext = scope.get("extensions", {}).get(EXTENSION)
    return ext["drop"] if ext else None
