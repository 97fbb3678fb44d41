"""This replica's part in a scale-out deployment (`--redis-url`): the API keys, rate limits
and adapter registry it shares with the other replicas, and the heartbeat that registers it
with routers (gateway/registry.py). Sessions are shared through gateway/sessions/store.py; the
keys and the clients are gateway/redis_store.py's.

The heartbeat runs from start-up, so the record exists while the process lives (the shared
concurrency limit counts a replica's requests only while it does); it says `ready` once the
model is loaded and the server listens, and only then do routers send it requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

from engine.protocols import EngineClient
from gateway import redis_store, registry
from gateway.access.auth import Authenticator, SharedKeys
from gateway.access.limits import SharedLimiter
from gateway.access.quota import RedisLedger
from gateway.adapters.shared import SharedAdapters
from gateway.adapters.store import SharedAdapterStore
from gateway.config import ServeConfig
from gateway.sessions.store import RedisStore

log = logging.getLogger(__name__)


class Cluster:
    """`ready()`: whether this replica takes requests now (the runtime's)."""

    def __init__(self, cfg: ServeConfig, auth: Authenticator, engine: EngineClient,
                 ready: Callable[[], bool], url: str):
        self.engine, self.ready = engine, ready
        self.clients = redis_store.connect_replica(url)
        self.redis = self.clients.text
        self.info = registry.ReplicaInfo(model=cfg.model_name)
        self.advertise_url = cfg.advertise_url
        publish = ((cfg.api_keys, cfg.tenants, cfg.admin_keys) if cfg.api_keys is not None
                   else None)
        self.keys = SharedKeys(self.redis, auth, publish)
        self.limiter = SharedLimiter(self.redis, self.info.id, auth.limits_for)
        self.adapters = SharedAdapters(SharedAdapterStore(self.clients.files),
                                       lambda: engine.adapters)
        self.sessions = RedisStore(self.redis)
        self.ledger = RedisLedger(self.redis)
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
        await self.clients.close()

    async def _heartbeat(self) -> None:
        while True:
            ready = self.ready() and self.advertise_url is not None
            base = self.info.base or (fingerprint(self.engine.model_dir) if ready else "")
            self.info = dataclasses.replace(self.info, url=self.advertise_url or "", base=base,
                                            ready=ready, load=self.engine.num_outstanding)
            try:
                await registry.publish(self.redis, self.info)
            except Exception as e:  # noqa: BLE001 - Redis down: routers will drop us; retry
                log.warning("heartbeat to Redis failed: %s", e)
            await asyncio.sleep(registry.HEARTBEAT_S)


def fingerprint(model_dir: str | Path) -> str:
    """Which base checkpoint: a digest of its config.json (architecture and sizes)."""
    return hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()[:16]
