"""Admission control: the bounded engine queue and per-tenant limits.

`TenantLimiter` keeps one process's counters (plain, on the event loop). `SharedLimiter`
(`--redis-url`) enforces the same limits across every replica, each admission one atomic Lua
script in Redis. A refused request gets a 429 with `Retry-After` at once; nothing queues
without bound.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict, deque
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Protocol

from gateway.config import TenantLimits
from gateway.errors import bad_request, rate_limited
from gateway.redis_store import REPLICA, Redis, limit_keys

log = logging.getLogger(__name__)

WINDOW_S = 60.0


def check_capacity(outstanding: int, new: int, max_num_seqs: int, max_queue: int) -> None:
    """Refuse when the engine already holds a full batch plus a full queue of sequences."""
    capacity = max_num_seqs + max_queue
    if new > capacity:
        raise bad_request(f"the request needs {new} sequences; the server holds at most "
                          f"{capacity}", "n")
    if outstanding + new > capacity:
        raise rate_limited("The server is at capacity; retry shortly.", 1.0, "queue_full")


class Seats:
    """The engine's batch plus queue, holding sequences from admission on: a request is
    planned (in a worker thread) between its capacity check and its submission, so those in
    planning count too, or requests admitted together would overfill the queue."""

    def __init__(self, outstanding: Callable[[], int], max_num_seqs: int, max_queue: int):
        self.outstanding, self.max_num_seqs, self.max_queue = outstanding, max_num_seqs, max_queue
        self.planning = 0  # sequences admitted and not yet submitted to the engine

    @contextmanager
    def reserve(self, n: int) -> Iterator[None]:
        """Hold `n` sequences until the block ends (by then submitted: the engine counts
        them); a 429 (or a 400 when more than all) when they do not fit."""
        check_capacity(self.outstanding() + self.planning, n, self.max_num_seqs, self.max_queue)
        self.planning += n
        try:
            yield
        finally:
            self.planning -= n


class Ticket(Protocol):
    """A tenant's admitted request."""

    def record_tokens(self, n: int) -> None: ...

    def release(self) -> None:
        """Free its concurrency slot; idempotent."""


class LocalTicket:
    def __init__(self, limiter: TenantLimiter, tenant: str):
        self.limiter, self.tenant = limiter, tenant
        self._released = False

    def record_tokens(self, n: int) -> None:
        self.limiter.record_tokens(self.tenant, n)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.limiter.active[self.tenant] -= 1


class TenantLimiter:
    """Max concurrent requests and tokens per minute, per tenant, in this process.

    Tokens are prompt tokens (counted at admission) plus generated tokens (as they stream),
    over a sliding 60 s window. A request is admitted while the window is under the limit.
    """

    def __init__(
        self,
        limits_for: Callable[[str], TenantLimits],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.limits_for = limits_for
        self.clock = clock
        self.active: dict[str, int] = defaultdict(int)
        self._window: dict[str, deque[tuple[float, int]]] = defaultdict(deque)
        self._used: dict[str, int] = defaultdict(int)

    async def admit(self, tenant: str) -> LocalTicket:
        lim = self.limits_for(tenant)
        if lim.max_concurrent_requests is not None:
            if self.active[tenant] >= lim.max_concurrent_requests:
                raise _too_many(tenant, self.active[tenant], lim.max_concurrent_requests)
        if lim.tokens_per_minute is not None:
            used = self.tokens_used(tenant)
            if used >= lim.tokens_per_minute:
                raise rate_limited(
                    f"Tenant '{tenant}' used {used} tokens in the last minute "
                    f"(limit {lim.tokens_per_minute}).",
                    self._seconds_until_below(tenant, lim.tokens_per_minute),
                    "tokens_per_minute_exceeded",
                )
        self.active[tenant] += 1
        return LocalTicket(self, tenant)

    def record_tokens(self, tenant: str, n: int) -> None:
        if n > 0 and self.limits_for(tenant).tokens_per_minute is not None:
            self._window[tenant].append((self.clock(), n))
            self._used[tenant] += n

    def tokens_used(self, tenant: str) -> int:
        window, cutoff = self._window[tenant], self.clock() - WINDOW_S
        while window and window[0][0] <= cutoff:
            self._used[tenant] -= window.popleft()[1]
        return self._used[tenant]

    def _seconds_until_below(self, tenant: str, limit: int) -> float:
        used, now = self._used[tenant], self.clock()
        for t, n in self._window[tenant]:
            used -= n
            if used < limit:
                return t + WINDOW_S - now
        return WINDOW_S


def _too_many(tenant: str, active: int, limit: int) -> Exception:
    return rate_limited(f"Tenant '{tenant}' already has {active} requests in flight "
                        f"(limit {limit}).", 1.0, "concurrency_limit_exceeded")


# -- shared by all replicas (Redis) -------------------------------------------------------------

# Keys (redis_store.limit_keys): bucket    hash {level, ts}: tokens_per_minute as a token
#                                            bucket (capacity = the limit, refilled at limit/60
#                                            per s; it may go negative: debt). TTL: until full.
#                                 inflight hash replica id -> requests in flight there; fields
#                                            of replicas whose heartbeat expired are dropped.
# Redis' clock (TIME) is the only clock, so replicas' clocks may disagree.
_REFILL = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local cap, rate = tonumber(ARGV[1]), tonumber(ARGV[2])
local b = redis.call('HMGET', KEYS[1], 'level', 'ts')
local level = cap
if b[1] then level = math.min(cap, tonumber(b[1]) + (now - tonumber(b[2])) * rate) end
"""

# ARGV: capacity (0: no token limit), rate, max concurrent (0: none), replica id, prefix.
# Returns {verdict, number, seconds}: 'ok' | 'concurrency' (in flight) | 'tokens' (level).
ADMIT = _REFILL + """
local maxc = tonumber(ARGV[3])
if maxc > 0 then
  local active, counts = 0, redis.call('HGETALL', KEYS[2])
  for i = 1, #counts, 2 do
    if redis.call('EXISTS', ARGV[5] .. counts[i]) == 1 then
      active = active + tonumber(counts[i + 1])
    else
      redis.call('HDEL', KEYS[2], counts[i])
    end
  end
  if active >= maxc then return {'concurrency', tostring(active), '1'} end
end
if cap > 0 and level < 1 then
  return {'tokens', tostring(level), tostring((1 - level) / rate)}
end
if maxc > 0 then
  redis.call('HINCRBY', KEYS[2], ARGV[4], 1)
  redis.call('EXPIRE', KEYS[2], 86400)
end
return {'ok', '0', '0'}
"""

# ARGV: capacity, rate, tokens to take, replica id, '1' to release a concurrency slot.
SETTLE = _REFILL + """
local n = tonumber(ARGV[3])
if cap > 0 and n > 0 then
  level = level - n
  redis.call('HSET', KEYS[1], 'level', tostring(level), 'ts', tostring(now))
  redis.call('EXPIRE', KEYS[1], math.ceil((cap - level) / rate) + 1)
end
if ARGV[5] == '1' and (tonumber(redis.call('HGET', KEYS[2], ARGV[4])) or 0) > 0 then
  redis.call('HINCRBY', KEYS[2], ARGV[4], -1)
end
return 1
"""


class SharedLimiter:
    """The same limits over every replica of one Redis. Tokens per minute is a token bucket
    (a burst up to the limit, then limit/60 tokens a second); a request is admitted while the
    bucket holds at least one token, and its tokens are taken as they are counted (so it may
    overdraw). While Redis is unreachable, this replica falls back to its own counters."""

    def __init__(self, redis: Redis, replica_id: str, limits_for: Callable[[str], TenantLimits]):
        self.replica_id, self.limits_for = replica_id, limits_for
        self.local = TenantLimiter(limits_for)
        self._admit = redis.register_script(ADMIT)
        self._settle = redis.register_script(SETTLE)
        self._tasks: set[asyncio.Task[None]] = set()

    async def admit(self, tenant: str) -> Ticket:
        lim = self.limits_for(tenant)
        if lim.max_concurrent_requests is None and lim.tokens_per_minute is None:
            return await self.local.admit(tenant)
        try:
            verdict, number, seconds = await self._admit(
                keys=limit_keys(tenant),
                args=[*_bucket(lim), lim.max_concurrent_requests or 0, self.replica_id, REPLICA])
        except Exception as e:  # noqa: BLE001 - Redis down: limits per replica meanwhile
            log.warning("shared rate limits unavailable (%s); limiting this replica alone", e)
            return await self.local.admit(tenant)
        if verdict == "concurrency":
            raise _too_many(tenant, int(number), lim.max_concurrent_requests or 0)
        if verdict == "tokens":
            raise rate_limited(
                f"Tenant '{tenant}' is over its limit of {lim.tokens_per_minute} tokens per "
                f"minute across replicas (its bucket holds {float(number):.0f}).", float(seconds),
                "tokens_per_minute_exceeded")
        return SharedTicket(self, tenant, lim.max_concurrent_requests is not None)

    async def settle(self, tenant: str, tokens: int, release: bool) -> None:
        lim = self.limits_for(tenant)
        try:
            await self._settle(keys=limit_keys(tenant), args=[
                *_bucket(lim), tokens, self.replica_id, "1" if release else "0"])
        except Exception as e:  # noqa: BLE001 - lost accounting errs on the tenant's side
            log.warning("could not record tenant %s's usage in Redis: %s", tenant, e)

    def spawn(self, coro: Coroutine[object, object, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def drain(self) -> None:
        """Wait for the usage still being written (at shutdown)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)


def _bucket(lim: TenantLimits) -> tuple[int, float]:
    tpm = lim.tokens_per_minute or 0
    return tpm, tpm / WINDOW_S


class SharedTicket:
    """Usage is written to Redis in the background, one write in flight per ticket (tokens
    counted meanwhile go into the next), the slot's release with the last one."""

    def __init__(self, limiter: SharedLimiter, tenant: str, holds_slot: bool):
        self.limiter, self.tenant = limiter, tenant
        self.pending = 0
        self._release_due = False
        self._released = not holds_slot
        self._task: asyncio.Task[None] | None = None

    def record_tokens(self, n: int) -> None:
        if n > 0 and self.limiter.limits_for(self.tenant).tokens_per_minute is not None:
            self.pending += n
            self._kick()

    def release(self) -> None:
        if not self._released:
            self._released = self._release_due = True
            self._kick()

    def _kick(self) -> None:
        if self._task is None or self._task.done():
            self._task = self.limiter.spawn(self._write())

    async def _write(self) -> None:
        while self.pending or self._release_due:
            tokens, release = self.pending, self._release_due
            self.pending, self._release_due = 0, False
            await self.limiter.settle(self.tenant, tokens, release)
