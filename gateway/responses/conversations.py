"""`/v1/conversations`: OpenAI's Conversations, each one session.

A conversation's items are its session's history (items <-> chat messages:
gateway/responses/items.py); its record (`created_at`, `metadata`) is one of the tenant's
bounded records (gateway/responses/store.py). A response created with `conversation` reads the
history as its prompt and appends its input and output items (gateway/responses/chain.py).
Another tenant's conversation is a 404, as one that never existed. Its record and its items
count toward the tenant's storage quota (gateway/access/quota.py): past it, a 403 and
nothing written; deleting a conversation deletes the responses stored in it too.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.access.auth import Authenticate
from gateway.access.quota import json_size, messages_size
from gateway.body import read_body
from gateway.redis_store import StoreUnavailable
from gateway.responses.chain import Stores, forget_conversation, not_found
from gateway.responses.items import Item, check_metadata, input_messages, message_items, new_id
from gateway.responses.routes import page
from gateway.runtime import Runtime
from gateway.sessions.store import Session

MAX_ITEMS = 20  # OpenAI's limit per call


class _Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    metadata: dict[str, str] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        check_metadata(v)
        return v


class CreateConversation(_Metadata):
    items: list[Item] | None = Field(None, max_length=MAX_ITEMS)


class AddItems(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    items: list[Item] = Field(min_length=1, max_length=MAX_ITEMS)


def conversation_routes(
    rt: Runtime, stores: Stores, authenticate: Authenticate
) -> APIRouter:
    router = APIRouter()
    limit = rt.config.max_request_bytes

    async def find(tenant: str, cid: str) -> tuple[dict[str, object], Session]:
        record = await stores.conversations.get(tenant, cid)
        session = None if record is None else await stores.sessions.get(tenant, cid)
        if record is None or session is None:
            raise not_found("conversation", cid)
        return record, session

    @router.post("/v1/conversations")
    async def create(request: Request, tenant: str = Depends(authenticate)) -> dict[str, object]:
        body = await read_body(request, CreateConversation, limit, default=CreateConversation())
        messages = input_messages(body.items or [], "items")
        cid = new_id("conv")
        record: dict[str, object] = {"created_at": int(time.time()),
                                     "metadata": body.metadata or {}}
        entries = {f"s:{cid}": messages_size(messages), f"c:{cid}": json_size(record)}
        await stores.ledger.apply(tenant, entries, stores.ttl_s, rt.storage_quota(tenant))
        try:
            await stores.sessions.create(Session(tenant=tenant, model="", messages=messages,
                                                 id=cid, ttl_seconds=stores.ttl_s))
            evicted = await stores.conversations.put(tenant, cid, record)
        except StoreUnavailable:
            await stores.sessions.delete(tenant, cid)
            await stores.ledger.drop(tenant, *entries)
            raise
        for old in evicted:
            await forget_conversation(stores, tenant, old)
        return _public(cid, record)

    @router.get("/v1/conversations/{cid}")
    async def retrieve(cid: str, tenant: str = Depends(authenticate)) -> dict[str, object]:
        return _public(cid, (await find(tenant, cid))[0])

    @router.post("/v1/conversations/{cid}")
    async def update(
        cid: str, request: Request, tenant: str = Depends(authenticate)
    ) -> dict[str, object]:
        body = await read_body(request, _Metadata, limit)
        record, _ = await find(tenant, cid)
        record["metadata"] = body.metadata or {}
        entry = f"c:{cid}"
        await stores.ledger.apply(tenant, {entry: json_size(record)}, stores.ttl_s,
                                  rt.storage_quota(tenant), drops=[entry])
        await stores.conversations.put(tenant, cid, record)
        return _public(cid, record)

    @router.delete("/v1/conversations/{cid}")
    async def delete(cid: str, tenant: str = Depends(authenticate)) -> dict[str, object]:
        await find(tenant, cid)
        await forget_conversation(stores, tenant, cid)
        return {"id": cid, "object": "conversation.deleted", "deleted": True}

    @router.get("/v1/conversations/{cid}/items")
    async def list_items(
        cid: str,
        tenant: str = Depends(authenticate),
        after: str | None = None,
        limit: int = Query(20, ge=1, le=100),
        order: str = Query("desc", pattern="^(asc|desc)$"),
    ) -> dict[str, object]:
        _, session = await find(tenant, cid)
        items = await asyncio.to_thread(message_items, session.messages)
        return page(items, after, limit, order)

    @router.post("/v1/conversations/{cid}/items")
    async def add_items(
        cid: str, request: Request, tenant: str = Depends(authenticate)
    ) -> dict[str, object]:
        body = await read_body(request, AddItems, limit)
        messages = input_messages(body.items, "items")
        _, session = await find(tenant, cid)
        grown = {f"s:{cid}": messages_size(messages)}
        await stores.ledger.apply(tenant, grown, stores.ttl_s, rt.storage_quota(tenant))
        try:
            await stores.sessions.append(session, messages)
        except StoreUnavailable:
            await stores.ledger.apply(tenant, {f"s:{cid}": -grown[f"s:{cid}"]}, stores.ttl_s)
            raise
        return page(message_items(messages), None, MAX_ITEMS * 2, "asc")

    @router.get("/v1/conversations/{cid}/items/{item_id}")
    async def get_item(
        cid: str, item_id: str, tenant: str = Depends(authenticate)
    ) -> dict[str, object]:
        _, session = await find(tenant, cid)
        items = await asyncio.to_thread(message_items, session.messages)
        for item in items:
            if item.get("id") == item_id:
                return item
        raise not_found("item", item_id)

    return router


def _public(cid: str, record: dict[str, object]) -> dict[str, object]:
    return {"id": cid, "object": "conversation", "created_at": record["created_at"],
            "metadata": record["metadata"]}
