"""The one Redis that replicas and routers share (`--redis-url`): every key name, and the
clients that reach it. Nothing else in the project names a key or opens a connection.

Keys (all under `switchboard:`):

    replica:{id}                      hash: a replica's `ReplicaInfo`, TTL (gateway/registry.py)
    replicas                          set of replica ids: the index routers scan
    auth:keys / auth:tenants / auth:admins
                                      the shared API-key table (gateway/access/auth.py)
    limit:{tenant}:bucket / :inflight tokens-per-minute bucket and requests in flight per
                                      replica (gateway/access/limits.py)
    adapters:{tenant}                 hash name -> adapter entry (gateway/adapters/store.py)
    adapter-files:{tenant}:{name}:{version}
                                      hash file name -> bytes
    session:{id} / session:{id}:messages
                                      a session's metadata and history (gateway/sessions/store.py)
    affinity:{session_id}             the replica holding a session's KV (gateway/router/app.py);
                                      also keyed by a response or conversation id
    response:{id} / responses:{tenant}
                                      a stored response (JSON, TTL) and the tenant's index of
                                      them, oldest first (gateway/responses/store.py)
    conversation:{id} / conversations:{tenant}
                                      a conversation's record and the tenant's index
    response-session:{id} / response-sessions:{tenant}
                                      the sessions made for responses, least recently used first
    usage:{tenant}:sizes / :expiries / :totals
                                      the tenant's storage ledger (gateway/access/quota.py)

A replica holds one `Clients`: `text` for everything but adapter files, `files` for those.
Neither retries a command: a write whose reply was lost may have been applied, and a retried
RPUSH or HINCRBY would count twice. Callers treat every `failures()` error as "the store is
unavailable" (down, full, read-only): a 503 with Retry-After, never a 500.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

REPLICA = "switchboard:replica:"
REPLICAS = "switchboard:replicas"
AUTH_KEYS = "switchboard:auth:keys"
AUTH_TENANTS = "switchboard:auth:tenants"
AUTH_ADMINS = "switchboard:auth:admins"
ADAPTERS = "switchboard:adapters:"
SESSION = "switchboard:session:"
AFFINITY = "switchboard:affinity:"
RESPONSE, RESPONSES = "switchboard:response:", "switchboard:responses:"
CONVERSATION, CONVERSATIONS = "switchboard:conversation:", "switchboard:conversations:"
RESPONSE_SESSION, RESPONSE_SESSIONS = ("switchboard:response-session:",
                                       "switchboard:response-sessions:")

# A redis.asyncio.Redis client. redis-py types every result `T | Awaitable[T]` (one class
# serves its sync and async clients), so typing it buys nothing but casts at each call.
Redis = Any


def limit_keys(tenant: str) -> list[str]:
    """The tenant's token bucket and in-flight counts (the admission script's KEYS)."""
    return [f"switchboard:limit:{tenant}:bucket", f"switchboard:limit:{tenant}:inflight"]


def usage_keys(tenant: str) -> list[str]:
    """The tenant's storage ledger: entry sizes, entry expiries, totals (the script's KEYS)."""
    return [f"switchboard:usage:{tenant}:{part}" for part in ("sizes", "expiries", "totals")]


def adapter_files(tenant: str, name: str, version: str) -> str:
    return f"switchboard:adapter-files:{tenant}:{name}:{version}"


@dataclass
class Clients:
    text: Redis  # strings in and out
    files: Redis  # bytes in and out, a longer timeout for adapter files

    async def close(self) -> None:
        await self.text.aclose()
        await self.files.aclose()


def connect(url: str, decode: bool = True, timeout_s: float = 5.0) -> Redis:
    """One client (lazily connected; the pool reconnects by itself once Redis is back)."""
    import redis.asyncio as aioredis  # only deployments given --redis-url need the package
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    return aioredis.Redis.from_url(url, decode_responses=decode, socket_connect_timeout=2,
                                   socket_timeout=timeout_s, retry=Retry(NoBackoff(), 0))


def connect_replica(url: str) -> Clients:
    """A replica's clients. Adapters are up to a few hundred MB: their files get 30 s."""
    return Clients(text=connect(url), files=connect(url, decode=False, timeout_s=30.0))


def failures() -> tuple[type[Exception], ...]:
    """Every error a Redis command can raise: unreachable, out of memory (`maxmemory` with
    `noeviction`), read-only replica, loading, a refused script. Stores answer them all as
    "the store is unavailable" (503), never a 500."""
    from redis.exceptions import RedisError

    return (RedisError,)


class StoreUnavailable(RuntimeError):
    """A store (sessions, records, the storage ledger) cannot be reached or refused a write:
    a 503 `store_unavailable` with Retry-After."""


@asynccontextmanager
async def store_errors(what: str) -> AsyncIterator[None]:
    """Every Redis failure inside as `StoreUnavailable`, naming `what` failed."""
    try:
        yield
    except failures() as e:
        raise StoreUnavailable(f"the {what} is unavailable: {e}") from e
