"""Bounded, tenant-scoped records for the Responses API: stored responses, conversations, and
the index of sessions made for responses.

Each kind is one `Records`: JSON objects by id, each with a TTL, and per tenant at most `bound`
of them; putting one more evicts the oldest (least recently put: putting an id again renews
it). Two implementations: `MemoryRecords` (in-process) and `RedisRecords` (`--redis-url`;
the keys are named in gateway/redis_store.py).

Contract: `get` answers None for a record that does not exist, has expired or belongs to
another tenant (callers must not tell these apart); `put` returns the ids it evicted, so the
caller can drop what hangs off them; a store that cannot be reached raises `StoreUnavailable`.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections import OrderedDict

from gateway.redis_store import Redis, store_errors

Record = dict[str, object]


class Records(ABC):
    def __init__(self, ttl_s: int, bound: int):
        self.ttl_s, self.bound = ttl_s, bound

    @abstractmethod
    async def put(self, tenant: str, record_id: str, record: Record) -> list[str]:
        """Store (or renew) the tenant's record; the ids evicted to keep `bound`."""

    @abstractmethod
    async def get(self, tenant: str, record_id: str) -> Record | None: ...

    @abstractmethod
    async def delete(self, tenant: str, record_id: str) -> bool:
        """True when the tenant's record existed."""

    @abstractmethod
    async def ids(self, tenant: str) -> list[str]:
        """The tenant's record ids (at most `bound`), oldest first."""


class MemoryRecords(Records):
    def __init__(self, ttl_s: int, bound: int):
        super().__init__(ttl_s, bound)
        # tenant -> id -> (JSON, expires at), oldest first
        self._tenants: dict[str, OrderedDict[str, tuple[str, float]]] = {}

    async def put(self, tenant: str, record_id: str, record: Record) -> list[str]:
        records = self._live(tenant)
        records.pop(record_id, None)
        records[record_id] = (json.dumps(record), time.monotonic() + self.ttl_s)
        evicted = []
        while len(records) > self.bound:
            evicted.append(records.popitem(last=False)[0])
        return evicted

    async def get(self, tenant: str, record_id: str) -> Record | None:
        entry = self._live(tenant).get(record_id)
        return None if entry is None else json.loads(entry[0])

    async def delete(self, tenant: str, record_id: str) -> bool:
        return self._live(tenant).pop(record_id, None) is not None

    async def ids(self, tenant: str) -> list[str]:
        return list(self._live(tenant))

    def _live(self, tenant: str) -> OrderedDict[str, tuple[str, float]]:
        """The tenant's records, the expired ones dropped (they are the oldest: one TTL)."""
        records = self._tenants.setdefault(tenant, OrderedDict())
        now = time.monotonic()
        while records and next(iter(records.values()))[1] <= now:
            records.popitem(last=False)
        return records


class RedisRecords(Records):
    """`{prefix}{id}`: the record's JSON with its tenant, TTL `ttl_s`; `{index}{tenant}`: a
    sorted set of the tenant's ids by the time they were put. Entries past the TTL leave the
    index on the next put; beyond `bound`, the oldest are popped and their records deleted
    (ZPOPMIN is atomic, so with several replicas each is evicted once)."""

    def __init__(self, redis: Redis, prefix: str, index: str, ttl_s: int, bound: int):
        super().__init__(ttl_s, bound)
        self._redis, self.prefix, self.index = redis, prefix, index

    async def put(self, tenant: str, record_id: str, record: Record) -> list[str]:
        now, index = time.time(), self.index + tenant
        async with store_errors("response store"):
            pipe = self._redis.pipeline(transaction=True)
            pipe.set(self.prefix + record_id, json.dumps({"tenant": tenant, "record": record}),
                     ex=self.ttl_s)
            pipe.zadd(index, {record_id: now})
            pipe.zremrangebyscore(index, "-inf", now - self.ttl_s)
            pipe.expire(index, self.ttl_s)
            pipe.zcard(index)
            *_, count = await pipe.execute()
            if count <= self.bound:
                return []
            evicted = [m for m, _ in await self._redis.zpopmin(index, count - self.bound)]
            if evicted:
                await self._redis.delete(*(self.prefix + m for m in evicted))
        return evicted

    async def get(self, tenant: str, record_id: str) -> Record | None:
        async with store_errors("response store"):
            raw = await self._redis.get(self.prefix + record_id)
        if raw is None:
            return None
        data = json.loads(raw)
        return data["record"] if data.get("tenant") == tenant else None

    async def delete(self, tenant: str, record_id: str) -> bool:
        if await self.get(tenant, record_id) is None:
            return False
        async with store_errors("response store"):
            pipe = self._redis.pipeline(transaction=True)
            pipe.delete(self.prefix + record_id)
            pipe.zrem(self.index + tenant, record_id)
            await pipe.execute()
        return True

    async def ids(self, tenant: str) -> list[str]:
        async with store_errors("response store"):
            return list(await self._redis.zrangebyscore(self.index + tenant,
                                                        time.time() - self.ttl_s, "+inf"))
