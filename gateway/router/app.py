"""The router's FastAPI app: every `/v1/...` request goes to one replica (gateway/router/pool.py
decides which), and the answer comes back with `x-switchboard-replica`.

Sessions: a turn (`session_id` in a chat completion) and `/v1/sessions/{id}[/fork]` go to the
replica recorded for the session (likewise a response continuing `previous_response_id` or a
`conversation`, keyed by that id; each response's replica is recorded from its
`x-switchboard-response-id` header), `switchboard:affinity:{session_id}` -> replica id (TTL
`AFFINITY_TTL_S`, renewed every turn); a new session or fork is recorded where it was made.
When that replica is gone, the turn runs elsewhere and the affinity moves with it: the
history is in Redis, so the new replica re-prefills it; a turn is acknowledged only once the
replica stored it, so nothing acknowledged is lost.

The router authenticates nothing itself (replicas do) and reads bodies only to find the
session and the prompt prefix; a body it cannot parse is forwarded as is, for the replica to
answer with its 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import re
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

from gateway import redis_store
from gateway.body import read_capped
from gateway.errors import APIError, install_error_handlers
from gateway.redis_store import AFFINITY, Redis
from gateway.registry import HEARTBEAT_S, ReplicaInfo
from gateway.responses.items import RESPONSE_ID_HEADER
from gateway.router import proxy
from gateway.router.pool import ReplicaPool

log = logging.getLogger(__name__)

AFFINITY_TTL_S = 24 * 3600
SESSION_PATH = re.compile(r"/v1/sessions/([^/]+)(/fork)?")
CONVERSATION_PATH = re.compile(r"/v1/conversations/([^/]+)(/.*)?")
TIMEOUT = httpx.Timeout(connect=2.0, read=None, write=60.0, pool=None)


def create_router_app(redis_url: str, max_body_bytes: int) -> FastAPI:
    """The router over the replicas registered in `redis_url`; request bodies over
    `max_body_bytes` are refused (413)."""
    redis = redis_store.connect(redis_url)
    pool = ReplicaPool(redis)
    client = httpx.AsyncClient(timeout=TIMEOUT, limits=httpx.Limits(max_connections=None))

    async def watch() -> None:
        while True:
            try:
                await pool.refresh()
            except Exception as e:  # noqa: BLE001 - Redis down: route on the last view
                log.warning("cannot read the replicas from Redis: %s", e)
            await asyncio.sleep(HEARTBEAT_S / 2)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        with contextlib.suppress(Exception):
            await pool.refresh()
        task = asyncio.create_task(watch())
        yield
        task.cancel()
        await client.aclose()
        await redis.aclose()

    app = FastAPI(title="Switchboard router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.pool = pool
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> dict[str, object]:
        if not pool.candidates():
            raise no_replica()
        return {"status": "ready", "replicas": len(pool.candidates())}

    @app.get("/router/replicas")
    async def replicas() -> dict[str, object]:
        return pool.status()

    @app.api_route("/v1/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def forward(request: Request, path: str) -> Response:
        body = await read_capped(request, max_body_bytes)
        session, creates = _session_of(request, body)
        affinity = await _get_affinity(redis, session) if session else None
        prefix = None if session else _prefix_key(request, body)
        tried: list[str] = []
        while (replica := pool.pick(affinity, prefix, exclude=tried)) is not None:
            tried.append(replica.id)
            pool.inflight[replica.id] += 1
            try:
                upstream = await proxy.send(client, replica, request, body)
            except (httpx.ConnectError, httpx.ConnectTimeout):
                pool.inflight[replica.id] -= 1
                pool.mark_down(replica)  # nothing reached it: try the next one
                continue
            except httpx.HTTPError as e:
                pool.inflight[replica.id] -= 1
                raise replica_failed(replica, e) from None
            if session and replica.id != affinity and not creates:
                await _set_affinity(redis, session, replica)
            if made := upstream.headers.get(RESPONSE_ID_HEADER):  # a response: its KV is here
                await _set_affinity(redis, made, replica)
            if creates or (session and request.method == "DELETE"):
                try:
                    response = await proxy.buffered(upstream, replica)
                except httpx.HTTPError as e:
                    raise replica_failed(replica, e) from None
                finally:
                    pool.inflight[replica.id] -= 1
                await _record(redis, request, session, replica, response)
                return response
            return proxy.Relay(upstream, replica, functools.partial(_done, pool, replica))
        raise no_replica()

    return app


def replica_failed(replica: ReplicaInfo, e: Exception) -> APIError:
    return APIError(502, f"The replica failed before answering: {e!r}", "server_error",
                    code="replica_failed", headers={proxy.REPLICA_HEADER: replica.address})


def no_replica() -> APIError:
    return APIError(503, "No healthy replica is available; retry shortly.", "server_error",
                    code="no_replica", headers={"Retry-After": str(int(HEARTBEAT_S * 2))})


def _done(pool: ReplicaPool, replica: ReplicaInfo) -> None:
    pool.inflight[replica.id] -= 1


def _session_of(request: Request, body: bytes) -> tuple[str | None, bool]:
    """(the session whose replica should serve this, whether the answer creates a session
    whose affinity to record). `POST /v1/sessions` creates one with no parent."""
    path = request.url.path
    if path in ("/v1/sessions", "/v1/conversations") and request.method == "POST":
        return None, True
    if m := SESSION_PATH.fullmatch(path):
        return m.group(1), m.group(2) is not None and request.method == "POST"
    if m := CONVERSATION_PATH.fullmatch(path):
        return m.group(1), False
    if path == "/v1/responses" and request.method == "POST":  # the response it continues
        data = _json(body)
        conv = data.get("conversation")
        key = data.get("previous_response_id") or (
            conv.get("id") if isinstance(conv, dict) else conv)
        return (key, False) if isinstance(key, str) else (None, False)
    if path == "/v1/chat/completions":
        sid = _json(body).get("session_id")
        return (sid, False) if isinstance(sid, str) else (None, False)
    return None, False


def _prefix_key(request: Request, body: bytes) -> str | None:
    """What must match for two requests to share cached KV: the tenant (its key), the model
    (base or adapter) and the start of the prompt."""
    if request.url.path not in ("/v1/chat/completions", "/v1/completions"):
        return None
    data = _json(body)
    messages, prompt = data.get("messages"), data.get("prompt")
    start = messages[0] if isinstance(messages, list) and messages else prompt
    if start is None:
        return None
    text = json.dumps([request.headers.get("authorization"), data.get("model"), start])
    return hashlib.sha256(text[:4096].encode()).hexdigest()


def _json(body: bytes) -> dict[str, object]:
    try:
        data = json.loads(body)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


async def _get_affinity(redis: Redis, session: str) -> str | None:
    try:
        return await redis.get(AFFINITY + session)
    except Exception as e:  # noqa: BLE001 - Redis down: the least loaded replica serves it
        log.warning("cannot read session affinity: %s", e)
        return None


async def _set_affinity(redis: Redis, session: str, replica: ReplicaInfo) -> None:
    try:
        await redis.set(AFFINITY + session, replica.id, ex=AFFINITY_TTL_S)
    except Exception as e:  # noqa: BLE001 - a lost affinity costs a re-prefill, not data
        log.warning("cannot record session affinity: %s", e)


async def _record(redis: Redis, request: Request, session: str | None, replica: ReplicaInfo,
                  response: Response) -> None:
    """After a session was created or forked (record where) or deleted (forget it)."""
    if response.status_code >= 300:
        return
    if request.method == "DELETE":
        with contextlib.suppress(Exception):
            await redis.delete(AFFINITY + str(session))
        return
    created = _json(bytes(response.body)).get("id")
    if isinstance(created, str):
        await _set_affinity(redis, created, replica)

