"""Replica registration in Redis: every replica publishes itself with a heartbeat, routers
read the live ones. No torch, no FastAPI: replicas and routers both import it.

A replica's record (`redis_store.REPLICA` + id) holds the `ReplicaInfo` fields with a TTL of
`TTL_S`, rewritten every `HEARTBEAT_S`: an expired record is a dead replica. The index
(`redis_store.REPLICAS`) lists the ids; the reader drops those whose record has expired.

A replica id is fresh for every process (a restarted replica is another replica: its KV is
gone), so per-replica counters elsewhere (the shared concurrency limit) die with it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass, field, fields
from typing import Any
from urllib.parse import urlsplit

from gateway.redis_store import REPLICA, REPLICAS, Redis

HEARTBEAT_S = 1.0
TTL_S = 5


@dataclass(frozen=True)
class ReplicaInfo:
    url: str = ""  # how routers reach it, http://host:port ("" until it listens)
    model: str = ""  # the served base model name (what clients send as `model`)
    base: str = ""  # fingerprint of the base checkpoint (its config.json)
    ready: bool = False  # model loaded and URL known: routers may send it requests
    load: int = 0  # sequences queued or running
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    started: float = field(default_factory=time.time)

    @property
    def address(self) -> str:
        """host:port, the `x-switchboard-replica` header value."""
        return urlsplit(self.url).netloc

    @property
    def base_model(self) -> str:
        return f"{self.model} ({self.base})"


async def publish(redis: Redis, info: ReplicaInfo) -> None:
    """One heartbeat: write the record and restart its TTL."""
    key = REPLICA + info.id
    record = {k: str(int(v)) if isinstance(v, bool) else str(v) for k, v in asdict(info).items()}
    pipe = redis.pipeline(transaction=True)
    pipe.hset(key, mapping=record)
    pipe.expire(key, TTL_S)
    pipe.sadd(REPLICAS, info.id)
    await pipe.execute()


async def withdraw(redis: Redis, replica_id: str) -> None:
    """A clean stop: routers stop sending at once instead of after the TTL."""
    pipe = redis.pipeline(transaction=True)
    pipe.delete(REPLICA + replica_id)
    pipe.srem(REPLICAS, replica_id)
    await pipe.execute()


async def live_replicas(redis: Redis) -> list[ReplicaInfo]:
    """Every replica whose heartbeat has not expired (ready or not)."""
    ids = sorted(await redis.smembers(REPLICAS))
    pipe = redis.pipeline(transaction=False)
    for replica_id in ids:
        pipe.hgetall(REPLICA + replica_id)
    records = await pipe.execute() if ids else []
    dead = [i for i, r in zip(ids, records, strict=True) if not r]
    if dead:
        await redis.srem(REPLICAS, *dead)
    return [_parse(r) for r in records if r]


def _parse(record: dict[str, str]) -> ReplicaInfo:
    types = {f.name: f.type for f in fields(ReplicaInfo)}
    values: dict[str, Any] = {}  # Any: each value has its field's type, parsed below
    for name, raw in record.items():
        kind = types.get(name)
        if kind == "bool":
            values[name] = raw == "1"
        elif kind == "int":
            values[name] = int(raw)
        elif kind == "float":
            values[name] = float(raw)
        elif kind == "str":
            values[name] = raw
    return ReplicaInfo(**values)
