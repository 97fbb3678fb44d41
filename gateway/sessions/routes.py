"""`/v1/sessions`: create, read, delete and fork stateful agent sessions.

A session belongs to the tenant that created it; every other tenant gets the same 404 as for
a session that never existed. Store failures (Redis unreachable or full) answer 503, a tenant
past its storage quota 403 (gateway/access/quota.py), both with nothing written; sessionless
requests never touch the store. A session created without `ttl_seconds` gets `--session-ttl`,
restarted by every turn.
"""

from __future__ import annotations

from fastapi import Depends, FastAPI, Request

from gateway.access.auth import Authenticate
from gateway.access.quota import json_size, messages_size
from gateway.adapters.routes import ensure_adapter
from gateway.body import read_body
from gateway.config import MAX_TTL_S
from gateway.errors import bad_request
from gateway.openai.params import resolve_adapter
from gateway.redis_store import StoreUnavailable
from gateway.runtime import Runtime
from gateway.sessions.store import Message, Session
from gateway.sessions.turns import CreateSession, ForkSession, find_session


def add_session_routes(app: FastAPI, rt: Runtime, authenticate: Authenticate) -> None:
    store, limit = rt.sessions, rt.config.max_request_bytes

    async def create(session: Session) -> None:
        """Charge the new session to its tenant's quota, then write it (nothing on a 403)."""
        entry = f"s:{session.id}"
        size = messages_size(session.messages) + json_size(session.tools)
        await rt.ledger.apply(session.tenant, {entry: size}, session.ttl_seconds or MAX_TTL_S,
                              rt.storage_quota(session.tenant))
        try:
            await store.create(session)
        except StoreUnavailable:
            await rt.ledger.drop(session.tenant, entry)
            raise

    @app.post("/v1/sessions")
    async def create_session(
        request: Request, tenant: str = Depends(authenticate)
    ) -> dict[str, object]:
        body = await read_body(request, CreateSession, limit)
        await ensure_adapter(rt, tenant, body.model)
        resolve_adapter(body.model, rt.config.model_name, tenant, rt.engine.adapters)
        messages: list[Message] = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in body.messages
        ]
        session = Session(tenant=tenant, model=body.model, messages=messages, tools=body.tools,
                          ttl_seconds=body.ttl_seconds or rt.config.session_ttl)
        await create(session)
        return session.public()

    @app.get("/v1/sessions/{session_id}")
    async def get_session(
        session_id: str, tenant: str = Depends(authenticate)
    ) -> dict[str, object]:
        return (await find_session(store, tenant, session_id)).public()

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(
        session_id: str, tenant: str = Depends(authenticate)
    ) -> dict[str, object]:
        await find_session(store, tenant, session_id)
        await store.delete(tenant, session_id)
        await rt.ledger.drop(tenant, f"s:{session_id}")
        rt.engine.release_session(session_id)
        return {"id": session_id, "object": "session.deleted", "deleted": True}

    @app.post("/v1/sessions/{session_id}/fork")
    async def fork_session(
        session_id: str, request: Request, tenant: str = Depends(authenticate)
    ) -> dict[str, object]:
        body = await read_body(request, ForkSession, limit, default=ForkSession())
        parent = await find_session(store, tenant, session_id)
        index = len(parent.messages) if body.message_index is None else body.message_index
        if index > len(parent.messages):
            raise bad_request(f"message_index {index} is out of range: the session has "
                              f"{len(parent.messages)} messages", "message_index")
        child = parent.fork(index)
        child.ttl_seconds = child.ttl_seconds or rt.config.session_ttl
        await create(child)
        return child.public()
