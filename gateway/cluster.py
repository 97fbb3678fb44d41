"""This replica's part in a scale-out deployment (`--redis-url`): the API keys, rate limits
and adapter registry it shares with the other replicas, and the heartbeat that registers it
with routers (router/registry.py). Sessions are shared through sessions/store.py.

The heartbeat runs from start-up, so the record exists while the process lives (the shared
concurrency limit counts a replica's requests only while it does); it says `ready` once the
model is loaded and the server listens, and only then do routers send it requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.auth import SharedKeys
from gateway.limits import SharedLimiter
from gateway.shared_adapters import SharedAdapters
from lora.shared_store import SharedAdapterStore
from router import registry

if TYPE_CHECKING:
    from gateway.runtime import Runtime

log = logging.getLogger(__name__)


class Cluster:
    def __init__(self, rt: Runtime, url: str):
        import redis.asyncio as aioredis  # only replicas given --redis-url need the package

        cfg = rt.config
        self.rt = rt
        self.redis = aioredis.Redis.from_url(url, decode_responses=True,
                                             socket_connect_timeout=2, socket_timeout=5)
        self.info = registry.ReplicaInfo(model=cfg.model_name)
        self.advertise_url = cfg.advertise_url
        publish = ((cfg.api_keys, cfg.tenants, cfg.admin_keys) if cfg.api_keys is not None
                   else None)
        self.keys = SharedKeys(self.redis, rt.auth, publish)
        self.limiter = SharedLimiter(self.redis, self.info.id, rt.auth.limits_for)
        self.adapter_store = SharedAdapterStore(url)
        self.adapters = SharedAdapters(self.adapter_store, lambda: rt.engine.adapters)
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def id(self) -> str:
        return self.info.id

    def advertise(self, url: str) -> None:
        """The server listens at `url` (unless `--advertise-url` says how routers reach it)."""
        self.advertise_url = self.advertise_url or url

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self.keys.run()),
                       asyncio.create_task(self._heartbeat())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.limiter.drain()
        try:
            await registry.withdraw(self.redis, self.id)
        except Exception as e:  # noqa: BLE001 - unreachable: the record expires by itself
            log.warning("could not withdraw replica %s: %s", self.id, e)
        await self.redis.aclose()
        await self.adapter_store.close()

    async def _heartbeat(self) -> None:
        while True:
            ready = self.rt.ready and self.advertise_url is not None
            base = self.info.base or (fingerprint(self.rt.engine.model_dir) if ready else "")
            self.info = dataclasses.replace(self.info, url=self.advertise_url or "", base=base,
                                            ready=ready, load=self.rt.engine.num_outstanding)
            try:
                await registry.publish(self.redis, self.info)
            except Exception as e:  # noqa: BLE001 - Redis down: routers will drop us; retry
                log.warning("heartbeat to Redis failed: %s", e)
            await asyncio.sleep(registry.HEARTBEAT_S)


def fingerprint(model_dir: str | Path) -> str:
    """Which base checkpoint: a digest of its config.json (architecture and sizes)."""
    return hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()[:16]
