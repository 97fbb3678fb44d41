"""Session stores: where a session's metadata and full message history live.

Two implementations: `MemoryStore` (in-process, the embedded default) and `RedisStore`
(`--redis-url`: durable across restarts, shared by replicas). Histories are plain Redis data
(a hash for metadata, a list of JSON messages), with the session's TTL on both keys.

Contract for every store: `get` answers None for a session that does not exist, has expired,
or belongs to another tenant (callers must not tell these apart); `append` returns only once
the messages are stored; a store that cannot be reached or refuses a write raises
`StoreUnavailable` (gateway/redis_store.py).
"""

from __future__ import annotations

import json
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace

from gateway.redis_store import SESSION, Redis, store_errors

Message = dict[str, object]  # a chat message, as JSON: role, content, the tool fields


@dataclass
class Session:
    tenant: str
    model: str
    messages: list[Message] = field(default_factory=list)
    tools: list[dict[str, object]] | None = None
    ttl_seconds: int | None = None  # None: never expires
    id: str = field(default_factory=lambda: f"sess_{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def fork(self, num_messages: int) -> Session:
        """A new session holding the first `num_messages` messages."""
        return replace(self, messages=list(self.messages[:num_messages]),
                       id=f"sess_{uuid.uuid4().hex}", created=int(time.time()))

    def public(self) -> dict[str, object]:
        """The HTTP body for this session."""
        return {"id": self.id, "object": "session", "created": self.created,
                "model": self.model, "tools": self.tools, "ttl_seconds": self.ttl_seconds,
                "messages": self.messages}


class SessionStore(ABC):
    @abstractmethod
    async def create(self, session: Session) -> None: ...

    @abstractmethod
    async def get(self, tenant: str, session_id: str) -> Session | None: ...

    @abstractmethod
    async def append(self, session: Session, messages: list[Message]) -> None:
        """Add `messages` to the history and restart the TTL; `session.messages` too."""

    @abstractmethod
    async def append_at(self, session: Session, length: int, messages: list[Message]) -> bool:
        """`append`, only while the stored history holds exactly `length` messages (False,
        and nothing written, otherwise): a continuation from that point, never interleaved
        with another (gateway/responses/routes.py forks instead)."""

    @abstractmethod
    async def delete(self, tenant: str, session_id: str) -> bool:
        """True when the tenant's session existed."""

    @abstractmethod
    async def splice(self, tenant: str, session_id: str, start: int, end: int | None) -> int:
        """Remove `messages[start:end]` from the tenant's session (`end` None: to the end);
        the bytes removed (0 for an unknown session). Deletes erase what they delete."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        pass


class MemoryStore(SessionStore):
    def __init__(self) -> None:
        self._sessions: dict[str, tuple[Session, float]] = {}  # id -> (session, expires at)

    async def create(self, session: Session) -> None:
        self._put(replace(session, messages=list(session.messages)))  # ours, not the caller's

    async def get(self, tenant: str, session_id: str) -> Session | None:
        entry = self._sessions.get(session_id)
        if entry is None:
            return None
        session, expires = entry
        if time.monotonic() >= expires:
            del self._sessions[session_id]
            return None
        if session.tenant != tenant:
            return None
        return replace(session, messages=list(session.messages))

    async def append(self, session: Session, messages: list[Message]) -> None:
        stored = self._sessions.get(session.id)
        if stored is not None:
            stored[0].messages.extend(messages)
            self._put(stored[0])
        session.messages.extend(messages)

    async def append_at(self, session: Session, length: int, messages: list[Message]) -> bool:
        stored = await self.get(session.tenant, session.id)
        if stored is None or len(stored.messages) != length:
            return False
        await self.append(session, messages)
        return True

    async def delete(self, tenant: str, session_id: str) -> bool:
        if await self.get(tenant, session_id) is None:
            return False
        del self._sessions[session_id]
        return True

    async def splice(self, tenant: str, session_id: str, start: int, end: int | None) -> int:
        if await self.get(tenant, session_id) is None:
            return 0
        messages = self._sessions[session_id][0].messages
        removed = sum(len(json.dumps(m).encode()) for m in messages[start:end])
        del messages[start:end]
        return removed

    def _put(self, session: Session) -> None:
        ttl = session.ttl_seconds
        expires = float("inf") if ttl is None else time.monotonic() + ttl
        self._sessions[session.id] = (session, expires)


class RedisStore(SessionStore):
    """Keys: `{prefix}{id}` (hash: tenant, model, tools, ttl_seconds, created) and
    `{prefix}{id}:messages` (list of JSON messages).

    `redis` is a text client from `redis_store`: it never retries, since a write whose reply
    was lost may have been applied, and a retried RPUSH would store the turn twice. A failure
    is a 503 and the client retries the turn. The client's owner closes it."""

    def __init__(self, redis: Redis, prefix: str = SESSION):
        self._redis = redis
        self.prefix = prefix

    async def create(self, session: Session) -> None:
        key = self.prefix + session.id
        meta = {"tenant": session.tenant, "model": session.model,
                "tools": json.dumps(session.tools), "created": session.created,
                "ttl_seconds": "" if session.ttl_seconds is None else session.ttl_seconds}
        async with store_errors("session store"):
            pipe = self._redis.pipeline(transaction=True)
            pipe.hset(key, mapping=meta)
            if session.messages:
                pipe.rpush(key + ":messages", *map(json.dumps, session.messages))
            self._expire(pipe, session)
            await pipe.execute()

    async def get(self, tenant: str, session_id: str) -> Session | None:
        key = self.prefix + session_id
        async with store_errors("session store"):
            flat, messages = await self._redis.eval(_GET, 2, key, key + ":messages")
        meta = dict(zip(flat[::2], flat[1::2], strict=True))
        if not meta or meta.get("tenant") != tenant:
            return None
        ttl = meta.get("ttl_seconds") or None
        return Session(tenant=tenant, model=meta["model"], id=session_id,
                       messages=[json.loads(m) for m in messages],
                       tools=json.loads(meta.get("tools") or "null"),
                       ttl_seconds=None if ttl is None else int(ttl),
                       created=int(meta.get("created") or 0))

    async def append(self, session: Session, messages: list[Message]) -> None:
        key = self.prefix + session.id
        if messages:
            async with store_errors("session store"):
                pipe = self._redis.pipeline(transaction=True)
                pipe.rpush(key + ":messages", *map(json.dumps, messages))
                self._expire(pipe, session)
                await pipe.execute()
        session.messages.extend(messages)

    async def append_at(self, session: Session, length: int, messages: list[Message]) -> bool:
        key = self.prefix + session.id
        ttl = session.ttl_seconds or 0
        async with store_errors("session store"):
            done = await self._redis.eval(_APPEND_AT, 2, key, key + ":messages", session.tenant,
                                          length, ttl, *map(json.dumps, messages))
        if done:
            session.messages.extend(messages)
        return bool(done)

    async def delete(self, tenant: str, session_id: str) -> bool:
        if await self.get(tenant, session_id) is None:
            return False
        key = self.prefix + session_id
        async with store_errors("session store"):
            await self._redis.delete(key, key + ":messages")
        return True

    async def splice(self, tenant: str, session_id: str, start: int, end: int | None) -> int:
        key = self.prefix + session_id
        async with store_errors("session store"):
            removed = await self._redis.eval(_SPLICE, 2, key, key + ":messages", tenant, start,
                                             -1 if end is None else end)
        return max(int(removed), 0)

    def _expire(self, pipe: Redis, session: Session) -> None:
        if session.ttl_seconds is not None:
            key = self.prefix + session.id
            pipe.expire(key, session.ttl_seconds)
            pipe.expire(key + ":messages", session.ttl_seconds)


# KEYS: the session's hash and list. One consistent read (a MULTI would be refused while Redis
# is out of memory, even for reads; a read-only script is not).
_GET = """#!lua flags=no-writes
return {redis.call('HGETALL', KEYS[1]), redis.call('LRANGE', KEYS[2], 0, -1)}
"""

# KEYS: the session's hash and list; ARGV: tenant, expected length, TTL (0: none), messages.
_APPEND_AT = """
if redis.call('HGET', KEYS[1], 'tenant') ~= ARGV[1] then return 0 end
if redis.call('LLEN', KEYS[2]) ~= tonumber(ARGV[2]) then return 0 end
if #ARGV > 3 then redis.call('RPUSH', KEYS[2], unpack(ARGV, 4)) end
if tonumber(ARGV[3]) > 0 then
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  redis.call('EXPIRE', KEYS[2], ARGV[3])
end
return 1
"""



# KEYS: the session's hash and list; ARGV: tenant, start, end (-1: to the end). Returns the
# bytes removed (-1: not the tenant's session). The rebuilt list keeps the hash's TTL.
_SPLICE = """
if redis.call('HGET', KEYS[1], 'tenant') ~= ARGV[1] then return -1 end
local start, stop = tonumber(ARGV[2]), tonumber(ARGV[3])
local all = redis.call('LRANGE', KEYS[2], 0, -1)
local keep, removed = {}, 0
for i, m in ipairs(all) do
  if i - 1 < start or (stop >= 0 and i - 1 >= stop) then keep[#keep + 1] = m
  else removed = removed + #m end
end
redis.call('DEL', KEYS[2])
for i = 1, #keep, 1000 do
  redis.call('RPUSH', KEYS[2], unpack(keep, i, math.min(i + 999, #keep)))
end
local ttl = redis.call('PTTL', KEYS[1])
if ttl > 0 and #keep > 0 then redis.call('PEXPIRE', KEYS[2], ttl) end
return removed
"""
