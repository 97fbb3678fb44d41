"""Per-tenant storage quotas: everything a tenant makes the server keep, counted and bounded.

Each stored object is one entry of the tenant's ledger, with its size and its expiry:

    s:{session id}        a session's history: `/v1/sessions` and their forks, conversations,
                          the sessions made for stored responses
    r:{response id}       a stored response's record
    c:{conversation id}   a conversation's record
    p:{request id}        a reservation for a turn in flight: its input and a reply allowance,
    sp:{request id}       ... `sp:` when the turn may also create a session

Entries whose name starts with `s` count toward `max_sessions`; every entry's bytes (the JSON
written, plus `OVERHEAD` for the keys around it) toward `max_storage_bytes`. A change is
checked and applied in one step (`Ledger.apply`: in-process, or one Lua script on the shared
Redis, so replicas never both take the last slot); past a quota it raises `QuotaExceeded`
and changes nothing. Routes charge before they write, and a turn reserves its room before
generation starts and settles it when it commits, so a refused request has written nothing
and a full or unreachable store is known before any tokens are spent. An entry expires with
the object it stands for (each change restarts its TTL, as the store's write does), so
objects that Redis expires leave the ledger too. No torch here.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gateway.redis_store import Redis, store_errors, usage_keys

OVERHEAD = 256  # bytes counted per stored object: its keys, TTLs and index entries
RESERVATION_TTL_S = 3600  # a reservation outlives any turn; a crashed replica's expires
REPLY_BYTES_PER_TOKEN = 4  # the reply allowance a turn reserves per max_tokens


class QuotaExceeded(Exception):
    """A change past its tenant's storage quota; `quota` names it."""

    def __init__(self, quota: str, message: str):
        super().__init__(message)
        self.quota = quota


@dataclass(frozen=True)
class StorageQuota:
    max_sessions: int
    max_bytes: int  # everything together
    max_history_bytes: int  # one entry: a session's or conversation's history


def json_size(obj: object) -> int:
    """The bytes `obj` takes as the stores write it (JSON)."""
    return len(json.dumps(obj).encode())


def messages_size(messages: Iterable[object]) -> int:
    return sum(json_size(m) for m in messages)


class Ledger(ABC):
    """Contract: `apply` first drops the `drops` entries, then adds each `adds` delta (bytes;
    a new entry also counts `OVERHEAD`) and restarts the entry's TTL (`ttl_s`). With a
    `quota`, a change that grows the tenant's bytes or sessions past it raises
    `QuotaExceeded` and applies nothing; without, it always applies (settling what was
    reserved). A store that cannot be reached, or refuses the write, raises
    `StoreUnavailable`."""

    @abstractmethod
    async def apply(self, tenant: str, adds: Mapping[str, int], ttl_s: int,
                    quota: StorageQuota | None = None, drops: Iterable[str] = ()) -> None: ...

    @abstractmethod
    async def usage(self, tenant: str) -> tuple[int, int]:
        """(sessions, bytes) the tenant stores now."""

    async def drop(self, tenant: str, *entries: str) -> None:
        if entries:
            await self.apply(tenant, {}, 0, drops=entries)


class MemoryLedger(Ledger):
    def __init__(self) -> None:
        # tenant -> entry -> [bytes, expires at (monotonic)]
        self._entries: dict[str, dict[str, list[float]]] = {}

    async def apply(self, tenant: str, adds: Mapping[str, int], ttl_s: int,
                    quota: StorageQuota | None = None, drops: Iterable[str] = ()) -> None:
        entries = self._live(tenant)
        kept = {e: entries.pop(e) for e in drops if e in entries}
        if quota is not None:
            sessions, used = _totals(entries)
            new = [e for e in adds if e not in entries]
            grow = sum(max(d, 0) for d in adds.values()) + OVERHEAD * len(new)
            largest = max((entries[e][0] if e in entries else OVERHEAD) + d
                          for e, d in adds.items()) if adds else 0
            problem = _problem(quota, sessions + sum(e[0] == "s" for e in new), used + grow,
                               grow, largest)
            if problem is not None:
                entries.update(kept)  # nothing applied
                raise problem
        expires = time.monotonic() + ttl_s
        for e, delta in adds.items():
            size = entries[e][0] + delta if e in entries else OVERHEAD + delta
            entries[e] = [max(size, 0), expires]

    async def usage(self, tenant: str) -> tuple[int, int]:
        sessions, used = _totals(self._live(tenant))
        return sessions, int(used)

    def _live(self, tenant: str) -> dict[str, list[float]]:
        entries = self._entries.setdefault(tenant, {})
        now = time.monotonic()
        for e in [e for e, (_, expires) in entries.items() if expires <= now]:
            del entries[e]
        return entries


def _totals(entries: Mapping[str, list[float]]) -> tuple[int, float]:
    return sum(e[0] == "s" for e in entries), sum(v[0] for v in entries.values())


def _problem(quota: StorageQuota, sessions: int, used: float, grow: float,
             largest: float) -> QuotaExceeded | None:
    """The quota that the change breaks (the same order of checks as the Lua script)."""
    if sessions > quota.max_sessions:
        return exceeded(quota, "max_sessions")
    if grow > 0 and largest > quota.max_history_bytes:
        return exceeded(quota, "max_history_bytes")
    if grow > 0 and used > quota.max_bytes:
        return exceeded(quota, "max_storage_bytes")
    return None


def exceeded(quota: StorageQuota, name: str) -> QuotaExceeded:
    if name == "max_sessions":
        return QuotaExceeded(name, f"Storage quota exceeded: the tenant may keep "
                             f"{quota.max_sessions} sessions (max_sessions; conversations and "
                             "the sessions of stored responses count); delete some first.")
    if name == "max_history_bytes":
        return QuotaExceeded(name, f"Storage quota exceeded: one session's or conversation's "
                             f"history may hold {quota.max_history_bytes} bytes "
                             "(max_history_bytes); start a new one.")
    return QuotaExceeded(name, f"Storage quota exceeded: the tenant may store "
                         f"{quota.max_bytes} bytes (max_storage_bytes: sessions, conversations "
                         "and stored responses together); delete some first.")


class RedisLedger(Ledger):
    """Three keys per tenant (gateway/redis_store.py): a hash entry -> bytes, a sorted set
    entry -> expires at (Unix seconds), and a hash of the totals (`sessions`, `bytes`). The
    script purges expired entries, checks, and applies, atomically."""

    def __init__(self, redis: Redis):
        self._redis = redis
        self._apply = redis.register_script(_APPLY)

    async def apply(self, tenant: str, adds: Mapping[str, int], ttl_s: int,
                    quota: StorageQuota | None = None, drops: Iterable[str] = ()) -> None:
        drops = list(drops)
        limits = ((-1, -1, -1) if quota is None
                  else (quota.max_sessions, quota.max_bytes, quota.max_history_bytes))
        args = [time.time(), ttl_s, *limits, OVERHEAD, len(drops), *drops]
        for entry, delta in adds.items():
            args += [entry, delta]
        async with store_errors("storage ledger"):
            refused = await self._apply(keys=usage_keys(tenant), args=args)
        if refused:
            assert quota is not None
            raise exceeded(quota, refused)

    async def usage(self, tenant: str) -> tuple[int, int]:
        async with store_errors("storage ledger"):
            totals = await self._redis.hgetall(usage_keys(tenant)[2])
        return int(totals.get("sessions", 0)), int(totals.get("bytes", 0))


# KEYS: sizes (hash), expiries (zset), totals (hash). ARGV: now, ttl_s, max_sessions (-1:
# unchecked), max_bytes, max_history_bytes, overhead, number of drops, the drops, then
# (entry, delta) pairs.
# The shebang makes Redis refuse the whole script up front when it is out of memory.
_APPLY = """#!lua
local sizes, expiries, totals = KEYS[1], KEYS[2], KEYS[3]
local now, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
local max_sessions, max_bytes = tonumber(ARGV[3]), tonumber(ARGV[4])
local max_history, overhead, ndrops = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local first = 8 + ndrops
local function remove(e)
  local size = redis.call('HGET', sizes, e)
  if not size then return end
  redis.call('HDEL', sizes, e)
  redis.call('ZREM', expiries, e)
  redis.call('HINCRBY', totals, 'bytes', -tonumber(size))
  if string.sub(e, 1, 1) == 's' then redis.call('HINCRBY', totals, 'sessions', -1) end
end
for _, e in ipairs(redis.call('ZRANGEBYSCORE', expiries, '-inf', now, 'LIMIT', 0, 1000)) do
  remove(e)
end
local dropped = {}
for i = 8, 7 + ndrops do dropped[ARGV[i]] = redis.call('HGET', sizes, ARGV[i]) end
if max_sessions >= 0 then
  local sessions = tonumber(redis.call('HGET', totals, 'sessions') or '0')
  local used = tonumber(redis.call('HGET', totals, 'bytes') or '0')
  local grow, new_sessions, largest = 0, 0, 0
  for e, size in pairs(dropped) do
    if size then
      used = used - tonumber(size)
      if string.sub(e, 1, 1) == 's' then sessions = sessions - 1 end
    end
  end
  for i = first, #ARGV, 2 do
    local e, delta = ARGV[i], tonumber(ARGV[i + 1])
    local size = overhead + delta
    if delta > 0 then grow = grow + delta end
    if (dropped[e] ~= nil) or redis.call('HEXISTS', sizes, e) == 0 then
      grow = grow + overhead
      if string.sub(e, 1, 1) == 's' then new_sessions = new_sessions + 1 end
    else
      size = tonumber(redis.call('HGET', sizes, e)) + delta
    end
    if size > largest then largest = size end
  end
  if sessions + new_sessions > max_sessions then return 'max_sessions' end
  if grow > 0 and largest > max_history then return 'max_history_bytes' end
  if grow > 0 and used + grow > max_bytes then return 'max_storage_bytes' end
end
for e, _ in pairs(dropped) do remove(e) end
for i = first, #ARGV, 2 do
  local e, delta = ARGV[i], tonumber(ARGV[i + 1])
  local old = redis.call('HGET', sizes, e)
  local size
  if old then size = tonumber(old) + delta else size = overhead + delta end
  if size < 0 then size = 0 end
  redis.call('HSET', sizes, e, size)
  redis.call('ZADD', expiries, now + ttl, e)
  redis.call('HINCRBY', totals, 'bytes', size - (tonumber(old) or 0))
  if not old and string.sub(e, 1, 1) == 's' then redis.call('HINCRBY', totals, 'sessions', 1) end
end
return false
"""



class Reservation:
    """The room a turn in flight holds in its tenant's ledger: taken (and checked) before
    generation, then settled by what the turn wrote, or released if it wrote nothing.

    `entry` is the session the turn appends to (`s:{id}`: its history grows by `nbytes`) or
    a placeholder (`p:` / `sp:{request id}`) for what the commit will create."""

    def __init__(self, ledger: Ledger, tenant: str, entry: str, nbytes: int, ttl_s: int):
        self.ledger, self.tenant, self.entry = ledger, tenant, entry
        self.nbytes, self.ttl_s = nbytes, ttl_s
        self.open = False

    async def take(self, quota: StorageQuota) -> Reservation:
        await self.ledger.apply(self.tenant, {self.entry: self.nbytes}, self.ttl_s, quota)
        self.open = True
        return self

    async def settle(self, written: Mapping[str, int], ttl_s: int) -> None:
        """Replace the reservation by the entries the commit wrote (`written`: entry ->
        bytes added), unchecked: the room was checked when taken."""
        adds, drops = self._undo()
        for entry, delta in written.items():
            adds[entry] = adds.get(entry, 0) + delta
        await self.ledger.apply(self.tenant, adds, ttl_s, drops=drops)
        self.open = False

    async def release(self) -> None:
        """Nothing was written: give the room back (a failure here only leaves the room
        taken until the entry expires)."""
        if self.open:
            self.open = False
            adds, drops = self._undo()
            await self.ledger.apply(self.tenant, adds, self.ttl_s, drops=drops)

    def _undo(self) -> tuple[dict[str, int], list[str]]:
        if self.entry.startswith("s:"):
            return {self.entry: -self.nbytes}, []
        return {}, [self.entry]
