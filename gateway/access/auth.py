"""Bearer auth: API key -> tenant, and tenant -> limits. With no keys configured, auth is off
and every request belongs to the default tenant. Tenant names scope everything a tenant
creates later (adapters, sessions).

Keys are held as SHA-256 digests, so the lookup is a dict lookup on a digest (nothing to time)
and Redis never stores a usable key. With `--redis-url` the table is shared (`SharedKeys`):

    AUTH_KEYS     hash sha256(key) -> tenant          (no TTL; names in gateway/redis_store.py)
    AUTH_TENANTS  hash tenant -> JSON `TenantLimits`
    AUTH_ADMINS   set sha256(key) of admin keys

Admin keys (`"admin": true` in the keys file) may read `/metrics`, whose labels name every
tenant; with auth on, other keys get a 403 there (unless `--public-metrics`).

A replica started with `--api-keys FILE` publishes that file there (replacing the table, in
one transaction); every replica re-reads the table every `REFRESH_S`. A replica without
`--api-keys` answers 503 until its first read, then uses Redis' table (empty: auth off, as
without a keys file). Once a replica has seen keys it never turns auth off again, even if the
table vanishes from Redis; while Redis is unreachable it keeps the last table it read.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Collection

from gateway.config import DEFAULT_TENANT, TenantLimits
from gateway.errors import APIError, forbidden, unauthorized
from gateway.redis_store import AUTH_ADMINS, AUTH_KEYS, AUTH_TENANTS, Redis

log = logging.getLogger(__name__)

REFRESH_S = 2.0
# A route dependency resolving a request's tenant from its Authorization header (gateway/app.py).
Authenticate = Callable[..., Awaitable[str]]
KeyTable = tuple[dict[str, str], dict[str, TenantLimits], Collection[str]]  # keys, limits, admins


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Authenticator:
    def __init__(
        self,
        api_keys: dict[str, str] | None,
        tenants: dict[str, TenantLimits] | None = None,
        default_limits: TenantLimits | None = None,
        waiting: bool = False,
        admin_keys: Collection[str] = (),
    ):
        """`waiting=True`: the table comes from Redis and has not been read yet (503s)."""
        self._tenants = None if api_keys is None else {digest(k): t for k, t in api_keys.items()}
        self._admins = {digest(k) for k in admin_keys}
        self._limits = dict(tenants or {})
        self._default = default_limits or TenantLimits()
        self.waiting = waiting

    @property
    def enabled(self) -> bool:
        return self._tenants is not None

    def tenant_for(self, authorization: str | None) -> str:
        """The tenant of an `Authorization` header value; raises a 401 `APIError`."""
        if self.waiting:
            raise APIError(503, "The API keys have not been read from Redis yet; retry shortly.",
                           "server_error", code="keys_unavailable", headers={"Retry-After": "2"})
        if self._tenants is None:
            return DEFAULT_TENANT
        return self._tenants[self._known_key(authorization)]

    def require_admin(self, authorization: str | None) -> None:
        """Let an admin key through (anyone while auth is off); else 401 / 403 / 503."""
        if self.waiting or self._tenants is None:
            self.tenant_for(authorization)  # 503 while the table is unread; else auth is off
            return
        if self._known_key(authorization) not in self._admins:
            raise forbidden("This route needs an admin API key (\"admin\": true in the keys "
                            "file).")

    def _known_key(self, authorization: str | None) -> str:
        """The digest of the Bearer key, one of the table's; else a 401."""
        assert self._tenants is not None
        scheme, _, key = (authorization or "").strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise unauthorized(
                "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'."
            )
        hashed = digest(key)
        if hashed not in self._tenants:
            raise unauthorized(f"Incorrect API key provided: {_redact(key)}.")
        return hashed

    def limits_for(self, tenant: str) -> TenantLimits:
        return self._limits.get(tenant, self._default)

    def replace(
        self, tenants: dict[str, str], limits: dict[str, TenantLimits], admins: set[str]
    ) -> None:
        """Swap in a table read from Redis (`tenants`, `admins`: key digests). An empty table
        turns auth off only if it was never on."""
        self.waiting = False
        if tenants or self._tenants is None:
            self._tenants = tenants or None
            self._limits = limits
            self._admins = admins
        else:
            log.warning("the API-key table in Redis is empty; keeping the last one read")


class SharedKeys:
    """Keeps an `Authenticator` in step with the table in Redis."""

    def __init__(self, redis: Redis, auth: Authenticator, publish: KeyTable | None):
        """`publish`: (key -> tenant, tenant -> limits, admin keys) to write first
        (`--api-keys`)."""
        self.redis, self.auth, self.to_publish = redis, auth, publish

    async def run(self) -> None:
        """Publish (once it succeeds), then re-read every `REFRESH_S`, forever."""
        while True:
            try:
                if self.to_publish is not None:
                    await self.publish(*self.to_publish)
                    self.to_publish = None
                await self.refresh()
            except Exception as e:  # noqa: BLE001 - Redis down: keep the last table, retry
                log.warning("cannot read the API keys from Redis: %s", e)
            await asyncio.sleep(REFRESH_S)

    async def publish(
        self, keys: dict[str, str], limits: dict[str, TenantLimits], admins: Collection[str] = ()
    ) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(AUTH_KEYS, AUTH_TENANTS, AUTH_ADMINS)
        pipe.hset(AUTH_KEYS, mapping={digest(k): t for k, t in keys.items()})
        if limits:
            pipe.hset(AUTH_TENANTS, mapping={t: lim.model_dump_json() for t, lim in limits.items()})
        if admins:
            pipe.sadd(AUTH_ADMINS, *(digest(k) for k in admins))
        await pipe.execute()

    async def refresh(self) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.hgetall(AUTH_KEYS)
        pipe.hgetall(AUTH_TENANTS)
        pipe.smembers(AUTH_ADMINS)
        tenants, limits, admins = await pipe.execute()
        self.auth.replace(tenants, {t: TenantLimits.model_validate_json(v)
                                    for t, v in limits.items()}, set(admins))


def _redact(key: str) -> str:
    return key[:3] + "*" * max(0, min(len(key) - 7, 20)) + key[-4:] if len(key) > 8 else "***"
