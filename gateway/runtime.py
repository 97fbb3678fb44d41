"""The gateway's runtime state, built once per app: config, engine, auth, limits, metrics,
and (once the model is loaded) the tokenizer and engine facts the routes need. With
`--redis-url`, `cluster` shares keys, limits, adapters and sessions with the other replicas."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from typing import TYPE_CHECKING

from engine.ipc.async_engine import LOAD_STAGES, AsyncEngine
from engine.ipc.core_client import EngineProcess
from gateway.access.auth import Authenticator
from gateway.access.connections import Connections
from gateway.access.limits import Seats, SharedLimiter, TenantLimiter
from gateway.access.quota import Ledger, MemoryLedger, StorageQuota
from gateway.adapters.shared import SharedAdapters
from gateway.config import ServeConfig
from gateway.errors import APIError, engine_failed, not_ready
from gateway.metrics import Metrics
from gateway.openai.params import EngineFacts
from gateway.openai.tokenizer import GatewayTokenizer
from gateway.sessions.store import MemoryStore, SessionStore
from grammar.spec import ConstraintSpec

if TYPE_CHECKING:
    from gateway.cluster import Cluster

log = logging.getLogger(__name__)

STAGES = (*LOAD_STAGES[:-1], "loading tokenizer", "ready")
FLUSH_S = 5.0  # after the drain deadline: time for the failed requests' answers to go out


class Runtime:
    def __init__(self, config: ServeConfig, engine: AsyncEngine | EngineProcess | None = None):
        self.config = config
        self.engine = engine or _engine(config)
        shared = config.redis_url is not None
        self.auth = Authenticator(config.api_keys, config.tenants, config.default_limits,
                                  waiting=shared and config.api_keys is None,
                                  admin_keys=config.admin_keys)
        self.cluster: Cluster | None = None
        if config.redis_url:
            from gateway.cluster import Cluster  # imports redis, needed only with --redis-url

            self.cluster = Cluster(config, self.auth, self.engine, lambda: self.ready,
                                   config.redis_url)
        self.limiter: TenantLimiter | SharedLimiter = (
            self.cluster.limiter if self.cluster else TenantLimiter(self.auth.limits_for))
        # The engine settles an "auto" batch limit when it loads (`_finish_loading`).
        self.seats = Seats(lambda: self.engine.num_outstanding, config.max_num_seqs or 1,
                           config.max_queue)
        self.shared_adapters: SharedAdapters | None = (
            self.cluster.adapters if self.cluster else None)
        self.connections = Connections(config.connection_limits())  # gateway/server.py's
        self.metrics = Metrics(lambda: self.engine.stats, self.queue_depth, self.connections)
        self.sessions: SessionStore = self.cluster.sessions if self.cluster else MemoryStore()
        self.ledger: Ledger = self.cluster.ledger if self.cluster else MemoryLedger()
        self.tokenizer: GatewayTokenizer | None = None
        self.facts: EngineFacts | None = None
        self.load_error: BaseException | None = None
        self.loaded = threading.Event()  # set once ready or failed (for the CLI's progress)
        self.draining = False  # set by `drain`: new API requests get 503, running ones finish
        self._loader: asyncio.Task[None] | None = None

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Start loading in the background; the server answers /health at once and /ready
        (and the API) once the model is loaded."""
        self.engine.start(asyncio.get_running_loop())
        self._loader = asyncio.create_task(self._finish_loading())
        if self.cluster:
            await self.cluster.start()

    async def stop(self) -> None:
        if self._loader is not None:
            self._loader.cancel()
        if self.cluster:
            await self.cluster.stop()
        await asyncio.to_thread(self.engine.shutdown)
        await self.sessions.close()
        gc.unfreeze()  # what the engine held may go now, before the interpreter's exit

    def drain(self, timeout: float) -> bool:
        """Stop taking requests (503, /ready too) and wait up to `timeout` s for those in
        flight to finish; past it, fail what is left, so that its clients get an error rather
        than a cut connection. True when everything finished in time. Blocks (not for the
        event loop): `switchboard serve` calls it on SIGTERM, before stopping the server."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.busy and time.monotonic() < deadline:
            time.sleep(0.05)
        if not self.busy:
            return True
        log.warning("drain deadline passed: failing %d requests", self.engine.num_outstanding)
        self.engine.fail_all("the server is shutting down")
        deadline = time.monotonic() + FLUSH_S
        while self.busy and time.monotonic() < deadline:
            time.sleep(0.05)
        return False

    async def _finish_loading(self) -> None:
        try:
            await asyncio.to_thread(self.engine.wait_loaded)
            if self.engine.load_error is not None:
                raise self.engine.load_error
            self.tokenizer = await asyncio.to_thread(GatewayTokenizer.load, self.engine.model_dir)
            self.seats.max_num_seqs = self.engine.max_num_seqs
            self.facts = EngineFacts(
                max_model_len=self.engine.max_model_len,
                validate=self.engine.validate,
                default_max_tokens=self.config.default_max_tokens,
            )
            # What is loaded now lives as long as the process: out of the collector's sight, a
            # full collection walks only what requests and connections make. With 17,000 slow
            # connections open, one took 600 ms instead of 360 on this CPU (holding the GIL:
            # every stream and /health waited), and the model's objects alone 220 ms.
            gc.collect()
            gc.freeze()
        except Exception as e:
            log.error("model failed to load: %s", e)
            self.load_error = e
        finally:
            self.loaded.set()

    # -- state ----------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Loaded and taking requests (False while draining: routers stop sending any)."""
        return self.facts is not None and self.engine.ready and not self.draining

    @property
    def stage(self) -> str:
        """One of `STAGES`, for progress display."""
        if self.ready:
            return STAGES[-1]
        if self.engine.ready:
            return "loading tokenizer"
        return self.engine.load_stage

    @property
    def busy(self) -> bool:
        """API requests in flight, or engine requests not finished."""
        return self.metrics.in_flight > 0 or self.engine.num_outstanding > 0

    def require_ready(self) -> tuple[GatewayTokenizer, EngineFacts]:
        if self.draining:
            raise APIError(503, "The server is shutting down; retry shortly.", "server_error",
                           code="server_shutting_down", headers={"Retry-After": "1"})
        self.require_alive()
        if not self.ready or self.tokenizer is None or self.facts is None:
            if getattr(self.engine, "restarting", False):
                raise engine_failed("The engine failed and is restarting; retry shortly.")
            raise not_ready()
        return self.tokenizer, self.facts

    def require_alive(self) -> None:
        """/health: raise 503 once this process can never serve again (the model failed to
        load, or the engine stopped for good, e.g. a tensor-parallel rank died), so that a
        liveness probe restarts it. Loading and draining are alive."""
        if self.load_error is not None:
            raise APIError(503, f"The model failed to load: {self.load_error}", "server_error",
                           code="model_load_failed")
        fatal = self.engine.fatal_error
        if fatal is not None:
            raise engine_failed(f"The engine stopped: {fatal}")

    async def compile_grammar(self, spec: ConstraintSpec) -> None:
        """The engine's `compile_grammar` (a cached spec returns at once), timed into the
        grammar-wait histogram: a request's first token waits for its grammar."""
        t = time.monotonic()
        try:
            await self.engine.compile_grammar(spec)
        finally:
            self.metrics.grammar_wait.observe(time.monotonic() - t)

    def storage_quota(self, tenant: str) -> StorageQuota:
        """What `tenant` may keep in the stores (its limits shared with --redis-url)."""
        return self.config.storage_quota(self.auth.limits_for(tenant))

    def queue_depth(self) -> int:
        """Sequences submitted and not yet in the running batch."""
        return max(0, self.engine.num_outstanding - self.engine.stats.num_running)


def _engine(config: ServeConfig) -> AsyncEngine | EngineProcess:
    """The engine core `--engine-core` asks for: its own process (restarted when it dies) or a
    thread of this one."""
    if config.engine_core == "thread":
        return AsyncEngine(config.engine_config())
    return EngineProcess(config.engine_config(), restarts=config.engine_restarts)
