"""`/v1/sessions`: create, read, delete and fork stateful agent sessions.

A session belongs to the tenant that created it; every other tenant gets the same 404 as for
a session that never existed. Store failures (Redis unreachable) answer 503; sessionless
requests never touch the store.
"""

from __future__ import annotations

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from gateway.adapters import ensure_adapter
from gateway.auth import Authenticate
from gateway.body import read_body
from gateway.errors import bad_request
from gateway.params import resolve_adapter
from gateway.runtime import Runtime
from gateway.session_store import Message, Session, StoreUnavailable
from gateway.sessions import CreateSession, ForkSession, find_session, store_unavailable


def add_session_routes(app: FastAPI, rt: Runtime, authenticate: Authenticate) -> None:
    store, limit = rt.sessions, rt.config.max_request_bytes

    @app.exception_handler(StoreUnavailable)
    async def _unavailable(_: Request, exc: StoreUnavailable) -> JSONResponse:
        return store_unavailable(exc).response()

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
                          ttl_seconds=body.ttl_seconds)
        await store.create(session)
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
        await store.create(child)
        return child.public()
