"""Which replica serves a request. Pure Python over `ReplicaInfo` records (refreshed from
Redis by `ReplicaPool`), so the choice is tested without servers.

Rules, in order:
1. Only ready replicas serving the fleet's base model are candidates. The fleet's base is the
   one most replicas advertise (ties: the longest-running replica's); a replica advertising
   another is refused, logged once, and never sent anything.
2. A replica that refused a connection is skipped for `DOWN_S` (its heartbeat may not have
   expired yet).
3. A session goes to the replica holding its KV (the affinity recorded in Redis) while that
   one is a candidate; otherwise it moves, and the next replica re-prefills from the stored
   history.
4. A request with a prompt prefix (tenant + adapter + the first message or prompt) prefers
   the replica that prefix hashes to (rendezvous hashing: stable while replicas come and
   go), unless that replica carries `PREFIX_SLACK` more sequences than the least loaded.
5. Otherwise the least loaded: the larger of its heartbeat's count and this router's own
   count of requests in flight there.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable

from gateway import registry
from gateway.redis_store import Redis
from gateway.registry import ReplicaInfo

log = logging.getLogger(__name__)

DOWN_S = 10.0
PREFIX_SLACK = 4


def fleet_base(replicas: Iterable[ReplicaInfo]) -> str | None:
    """The base model most replicas advertise; ties go to the longest-running replica's."""
    replicas = sorted(replicas, key=lambda r: (r.started, r.id))
    if not replicas:
        return None
    counts = Counter(r.base_model for r in replicas)
    best = max(counts.values())
    return next(r.base_model for r in replicas if counts[r.base_model] == best)


def choose(
    candidates: list[ReplicaInfo],
    load: Callable[[ReplicaInfo], int],
    affinity: str | None = None,
    prefix: str | None = None,
) -> ReplicaInfo | None:
    """Rules 3-5 over the candidates (rules 1-2 already applied)."""
    if not candidates:
        return None
    for r in candidates:
        if r.id == affinity:
            return r
    least = min(candidates, key=lambda r: (load(r), r.id))
    if prefix is not None:
        preferred = max(candidates, key=lambda r: _score(prefix, r.id))
        if load(preferred) <= load(least) + PREFIX_SLACK:
            return preferred
    return least


def _score(prefix: str, replica_id: str) -> bytes:
    return hashlib.sha256(f"{prefix}\0{replica_id}".encode()).digest()


class ReplicaPool:
    """The router's current view of the replicas, refreshed from Redis by `refresh()`."""

    def __init__(self, redis: Redis):
        self.redis = redis
        self.accepted: list[ReplicaInfo] = []
        self.refused: dict[str, tuple[ReplicaInfo, str]] = {}  # id -> (replica, why)
        self.inflight: Counter[str] = Counter()
        self._down_until: dict[str, float] = {}

    async def refresh(self) -> None:
        live = [r for r in await registry.live_replicas(self.redis) if r.ready and r.url]
        base = fleet_base(live)
        refused = {}
        for r in live:
            if r.base_model != base:
                why = f"advertises base model {r.base_model}; the fleet serves {base}"
                if r.id not in self.refused:
                    log.warning("refusing replica %s (%s): %s", r.address, r.id, why)
                refused[r.id] = (r, why)
        self.accepted = [r for r in live if r.id not in refused]
        self.refused = refused

    def candidates(self, exclude: Iterable[str] = ()) -> list[ReplicaInfo]:
        now, skip = time.monotonic(), set(exclude)
        return [r for r in self.accepted
                if r.id not in skip and self._down_until.get(r.id, 0.0) <= now]

    def pick(self, affinity: str | None = None, prefix: str | None = None,
             exclude: Iterable[str] = ()) -> ReplicaInfo | None:
        return choose(self.candidates(exclude), self.load, affinity, prefix)

    def load(self, r: ReplicaInfo) -> int:
        return max(r.load, self.inflight[r.id])

    def mark_down(self, r: ReplicaInfo) -> None:
        log.warning("replica %s (%s) refused a connection; skipping it for %.0f s",
                    r.address, r.id, DOWN_S)
        self._down_until[r.id] = time.monotonic() + DOWN_S

    def status(self) -> dict[str, object]:
        """The `/router/replicas` body."""
        def view(r: ReplicaInfo) -> dict[str, object]:
            return {"id": r.id, "address": r.address, "model": r.model, "base": r.base,
                    "load": self.load(r)}

        return {"base_model": fleet_base(self.accepted),
                "replicas": [{**view(r), "healthy": r in self.candidates()}
                             for r in self.accepted],
                "refused": [{**view(r), "reason": why} for r, why in self.refused.values()]}
