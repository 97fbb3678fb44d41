"""Adapters across replicas (`--redis-url`): the shared registry (gateway/adapters/store.py) is the
truth, this replica's adapter manager a cache of validated copies.

An upload is validated here (as on a single server), then registered in Redis with its
files; a name taken meanwhile by another replica's upload is a 409 and the local copy is
dropped. A request naming an adapter this replica lacks fetches its files into a staging
folder and registers them through the manager, validated exactly as an upload; an adapter
deleted or replaced elsewhere is dropped here at its next use. One lock per (tenant, name)
keeps a replica from fetching one adapter twice at once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import shutil
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from engine.protocols import AdapterRegistry
from gateway.adapters.store import AdapterEntry, SharedAdapterStore
from gateway.errors import APIError, bad_request, clip
from gateway.redis_store import failures
from lora.quota import AdapterQuota, QuotaExceeded

log = logging.getLogger(__name__)


class SharedAdapters:
    def __init__(self, store: SharedAdapterStore, manager: Callable[[], AdapterRegistry | None]):
        """`manager()`: the engine's adapter manager (None until the engine is loaded)."""
        self.store, self.manager = store, manager
        self._locks: defaultdict[tuple[str, str], asyncio.Lock] = defaultdict(asyncio.Lock)

    def lock(self, tenant: str, name: str) -> asyncio.Lock:
        return self._locks[(tenant, name)]

    async def ensure(self, tenant: str, name: str) -> None:
        """Bring this replica's copy of the tenant's adapter `name` in line with the shared
        registry. With Redis unreachable, it keeps what it has."""
        if await self._in_step(tenant, name):
            return
        manager = self._local()
        async with self.lock(tenant, name):
            async with unavailable():
                meta = await self.store.get(tenant, name)
            version = None if meta is None else meta["version"]
            local = manager.get(tenant, name)
            if local is not None:
                if local.version == version:
                    return  # another request (or HTTP process of this core) fetched it
                await asyncio.to_thread(manager.remove, tenant, name)  # gone or replaced
            if version is not None:
                await self._fetch(manager, tenant, name, version)

    async def _in_step(self, tenant: str, name: str) -> bool:
        """True when there is nothing to do (checked without the lock, so that a stream of
        unknown model names creates no locks)."""
        try:
            meta = await self.store.get(tenant, name)
        except failures() as e:
            log.warning("adapter registry unreachable (%s); using local adapters", e)
            return True
        local = self._local().get(tenant, name)
        if meta is None:
            return local is None
        return local is not None and local.version == meta["version"]

    async def _fetch(
        self, manager: AdapterRegistry, tenant: str, name: str, version: str
    ) -> None:
        folder = staging_dir(manager)
        try:
            async with unavailable():
                await self.store.download(tenant, name, version, folder)
            await asyncio.to_thread(functools.partial(manager.add, tenant, name, folder,
                                                      move=True, version=version))
        except FileNotFoundError:
            return  # deleted between the two reads: as unknown as never uploaded
        except ValueError as e:  # AdapterError: the stored files do not validate here
            raise invalid(name, e) from None
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    async def claim(self, tenant: str, name: str) -> None:
        """Before an upload (under `lock`): 409 when the name is registered; a local copy of
        an adapter deleted elsewhere is dropped."""
        async with unavailable():
            if await self.store.get(tenant, name) is not None:
                raise exists(name)
        await asyncio.to_thread(self._local().remove, tenant, name)

    async def usage(self, tenant: str) -> tuple[int, int]:
        """The tenant's adapters fleet-wide: how many, and the bytes of their files."""
        async with unavailable():
            return await self.store.usage(tenant)

    async def publish(self, tenant: str, name: str, obj: dict[str, object],
                      files: dict[str, bytes], quota: AdapterQuota, version: str) -> bool:
        """Register a validated upload (already in the local manager, as `version`). False:
        name taken. Raises `QuotaExceeded` (checked in Redis, atomically across replicas)."""
        meta = {k: v for k, v in obj.items() if k not in ("tier", "pinned")}
        async with unavailable():
            return await self.store.publish(tenant, name, meta, files, quota, version)

    async def list(self, tenant: str) -> list[dict[str, object]]:
        async with unavailable():
            return [self._view(tenant, m) for m in await self.store.list(tenant)]

    async def get(self, tenant: str, name: str) -> dict[str, object] | None:
        async with unavailable():
            meta = await self.store.get(tenant, name)
        return None if meta is None else self._view(tenant, meta)

    async def delete(self, tenant: str, name: str) -> bool:
        async with self.lock(tenant, name), unavailable():
            meta = await self.store.get(tenant, name)
            deleted = meta is not None and await self.store.delete(tenant, name, meta["version"])
        await asyncio.to_thread(self._local().remove, tenant, name)
        return deleted

    def _view(self, tenant: str, meta: AdapterEntry) -> dict[str, object]:
        """The adapter object: the shared entry `meta`, with this replica's tier ("store": not
        fetched here yet)."""
        name, version = meta["id"], meta["version"]
        local = self._local().get(tenant, name)
        obj = {k: v for k, v in meta.items() if k != "version"}
        if local is None or local.version != version:
            return {**obj, "pinned": False, "tier": "store"}
        return {**obj, "pinned": local.pinned, "tier": local.tier}

    def _local(self) -> AdapterRegistry:
        """This replica's manager; the routes check that the engine has one before they
        come here."""
        manager = self.manager()
        if manager is None:
            raise RuntimeError("the engine has no adapter manager")
        return manager


# A staging folder nothing was written into for this long lost its upload with its process
# (a live one writes at least every 4 MB at --body-min-rate, every few minutes).
STALE_STAGING_S = 3600.0


def staging_dir(manager: AdapterRegistry) -> Path:
    """A fresh folder inside the store (same file system, so registering is a rename). Stale
    ones (`STALE_STAGING_S`), left by a process that died mid-upload, are removed first."""
    if manager.store_dir is None:  # the gateway always gives the engine one (--adapter-dir)
        raise RuntimeError("the engine's adapter manager has no store directory")
    root = manager.store_dir / ".staging"
    now = time.time()
    for old in root.iterdir() if root.is_dir() else ():
        try:
            written = max(p.stat().st_mtime for p in (old, *old.iterdir()))
        except OSError:  # removed meanwhile by its own upload
            continue
        if now - written > STALE_STAGING_S:
            log.warning("removing %s: an upload left it %.0f s ago", old, now - written)
            shutil.rmtree(old, ignore_errors=True)
    path = root / uuid.uuid4().hex
    path.mkdir(parents=True)
    return path


def exists(name: str) -> APIError:
    return APIError(409, f"adapter {name!r} already exists; delete it first", param="name",
                    code="adapter_exists")


def invalid(name: str, e: ValueError) -> APIError:
    problems = getattr(e, "problems", [str(e)])
    return bad_request(f"adapter {clip(name)!r} is invalid: " + "; ".join(problems), "files",
                       "invalid_adapter")


def over_quota(e: QuotaExceeded) -> APIError:
    return APIError(403, str(e), code="adapter_quota_exceeded")


@asynccontextmanager
async def unavailable() -> AsyncIterator[None]:
    """Redis unreachable, full (`noeviction`) or refusing writes -> 503 with Retry-After."""
    try:
        yield
    except failures() as e:
        raise APIError(503, f"The adapter registry is unavailable: {e}", "server_error",
                       code="adapter_store_unavailable", headers={"Retry-After": "1"}) from e
