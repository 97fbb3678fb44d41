"""Where a response sits in a session's history, and how it is written there.

A stored response is a point in a session: its record names the session and how many of its
messages the history up to and including the response is (`length`). Continuing from it:

- it is the session's latest point: the new turn is appended to the same session, whose KV
  the engine kept pinned (`GenerateRequest.session_id`), so the turn computes only its new
  tokens;
- it is not (a second response already continued from it), or the model changed: the turn
  forks a new session holding the history up to that point; the fork's prompt still starts
  with the parent's tokens, so it hits the parent's cached KV.

A conversation is one session, appended to by every response that names it. Sessions made for
responses are indexed per tenant (`Stores.threads`, least recently used first): beyond
`--max-stored-responses` the oldest are deleted and their KV released, so neither records nor
histories grow without bound. Nothing is written until a turn has finished: a failed or
refused one leaves no state behind. What a turn writes is charged to its tenant's storage
ledger (gateway/access/quota.py): `commit` returns the entries it grew, which settle the
room the turn reserved before generation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from gateway.access.quota import Ledger, messages_size
from gateway.errors import APIError, clip
from gateway.redis_store import (
    CONVERSATION,
    CONVERSATIONS,
    RESPONSE,
    RESPONSE_SESSION,
    RESPONSE_SESSIONS,
    RESPONSES,
)
from gateway.responses.items import ResponsesRequest
from gateway.responses.store import MemoryRecords, Records, RedisRecords
from gateway.sessions.store import Message, Session, SessionStore

if TYPE_CHECKING:
    from gateway.runtime import Runtime


@dataclass
class Stores:
    """The Responses API's state: records of responses and conversations, the index of the
    sessions made for responses, and the session store holding every history."""

    responses: Records
    conversations: Records
    threads: Records
    sessions: SessionStore
    release: Callable[[str], None]  # the engine's: unpin a session's KV
    ttl_s: int
    ledger: Ledger

    @classmethod
    def of(cls, rt: Runtime) -> Stores:
        ttl, bound = rt.config.response_ttl, rt.config.max_stored_responses
        if rt.cluster is None:
            return cls(MemoryRecords(ttl, bound), MemoryRecords(ttl, bound),
                       MemoryRecords(ttl, bound), rt.sessions, rt.engine.release_session, ttl,
                       rt.ledger)
        redis = rt.cluster.redis
        return cls(RedisRecords(redis, RESPONSE, RESPONSES, ttl, bound),
                   RedisRecords(redis, CONVERSATION, CONVERSATIONS, ttl, bound),
                   RedisRecords(redis, RESPONSE_SESSION, RESPONSE_SESSIONS, ttl, bound),
                   rt.sessions, rt.engine.release_session, ttl, rt.ledger)

    async def drop_sessions(self, tenant: str, ids: list[str]) -> None:
        """Delete evicted sessions and release their pinned KV."""
        for sid in ids:
            await self.sessions.delete(tenant, sid)
            await self.ledger.drop(tenant, f"s:{sid}")
            self.release(sid)

    async def drop_responses(self, tenant: str, ids: list[str]) -> None:
        """Uncharge records evicted beyond the bound (the store deleted them)."""
        await self.ledger.drop(tenant, *(f"r:{rid}" for rid in ids))


def not_found(what: str, item_id: str, param: str | None = None) -> APIError:
    code = f"{what.replace(' ', '_')}_not_found"
    return APIError(404, f"{what.capitalize()} with id '{clip(item_id)}' not found.",
                    param=param, code=code)


@dataclass
class Chain:
    """The history a response continues: the first `length` messages of `session` (a stored
    session, or a new one written at commit when `stored` is False)."""

    session: Session
    length: int
    stored: bool
    conversation: bool = False

    @property
    def history(self) -> list[Message]:
        return self.session.messages[: self.length]


async def resolve_chain(stores: Stores, tenant: str, body: ResponsesRequest) -> Chain:
    """The chain `previous_response_id` or `conversation` names (a new one for neither); a
    404 for an unknown, expired or another tenant's id, as if it never existed."""
    prev, conv = body.previous_response_id, body.conversation_id
    if prev is not None and conv is not None:
        raise APIError(400, "previous_response_id and conversation cannot both be given.",
                       param="conversation", code="mutually_exclusive")
    if conv is not None:
        session = await stores.sessions.get(tenant, conv)
        if session is None or await stores.conversations.get(tenant, conv) is None:
            raise not_found("conversation", conv, "conversation")
        return Chain(session, len(session.messages), True, conversation=True)
    if prev is None:
        return Chain(_new_session(stores, tenant, body.model, []), 0, False)
    record = await stores.responses.get(tenant, prev) or {}
    sid, length = record.get("session"), record.get("length")
    session = await stores.sessions.get(tenant, sid) if isinstance(sid, str) else None
    if session is None or not isinstance(length, int) or length > len(session.messages):
        raise not_found("previous response", prev, "previous_response_id")
    if session.model != body.model or len(session.messages) != length:
        return Chain(_new_session(stores, tenant, body.model, session.messages[:length]),
                     length, False)
    return Chain(session, length, True)


async def commit(stores: Stores, chain: Chain, tenant: str,
                 messages: list[Message]) -> tuple[Chain, dict[str, int]]:
    """Write this turn's `messages` (its input and reply) after the chain's history: the
    chain they now end (a fork when another turn continued the session meanwhile), and the
    ledger entries that grew (entry -> bytes)."""
    session, end = chain.session, chain.length + len(messages)
    grown = {f"s:{session.id}": messages_size(messages)}
    if chain.conversation:
        await stores.sessions.append(session, messages)
        return replace(chain, length=len(session.messages)), grown
    if chain.stored and await stores.sessions.append_at(session, chain.length, messages):
        await _track(stores, tenant, session.id)
        return replace(chain, length=end), grown
    if chain.stored:  # continued meanwhile: fork from our point instead
        session = _new_session(stores, tenant, session.model, chain.history)
    session = replace(session, messages=[*chain.history, *messages])
    await stores.sessions.create(session)
    await _track(stores, tenant, session.id)
    return Chain(session, end, True), {f"s:{session.id}": messages_size(session.messages)}


def _new_session(stores: Stores, tenant: str, model: str, history: list[Message]) -> Session:
    return Session(tenant=tenant, model=model, messages=list(history), ttl_seconds=stores.ttl_s)


async def _track(stores: Stores, tenant: str, session_id: str) -> None:
    """Renew the session in the tenant's index; delete those evicted beyond the bound."""
    await stores.drop_sessions(tenant, await stores.threads.put(tenant, session_id, {}))


async def forget(stores: Stores, tenant: str, response_id: str, record: dict[str, object]) -> None:
    """Delete a stored response, and its input and output from every history that holds
    them: its session loses the turn and what continued from it (later responses there 404,
    as continuing them would replay the deleted turn); sessions forked with a copy of it are
    cut the same way; in a conversation only the turn's own items go."""
    await stores.responses.delete(tenant, response_id)
    await stores.drop_responses(tenant, [response_id])
    sid, end, start = record.get("session"), record.get("length"), record.get("start")
    if not isinstance(sid, str) or not isinstance(end, int):
        return
    if not isinstance(start, int):  # a record stored before "start" was kept
        items = record.get("input")
        start = end - (len(items) if isinstance(items, list) else 0) - 1
    session = await stores.sessions.get(tenant, sid)
    if session is None:
        return
    turn = session.messages[start:end]
    conversation = await stores.conversations.get(tenant, sid) is not None
    await _cut(stores, tenant, sid, start, end if conversation else None)
    for other in await stores.threads.ids(tenant):
        fork = None if other == sid else await stores.sessions.get(tenant, other)
        if fork is not None and fork.messages[start:end] == turn:
            await _cut(stores, tenant, other, start, None)


async def forget_conversation(stores: Stores, tenant: str, cid: str) -> None:
    """Delete a conversation: its record, its items, and the stored responses made in it
    (their records hold its items too)."""
    await stores.conversations.delete(tenant, cid)
    await stores.ledger.drop(tenant, f"c:{cid}")
    for rid in await stores.responses.ids(tenant):
        record = await stores.responses.get(tenant, rid)
        if record is not None and record.get("session") == cid:
            await stores.responses.delete(tenant, rid)
            await stores.drop_responses(tenant, [rid])
    await stores.drop_sessions(tenant, [cid])


async def _cut(stores: Stores, tenant: str, sid: str, start: int, end: int | None) -> None:
    removed = await stores.sessions.splice(tenant, sid, start, end)
    if removed:
        await stores.ledger.apply(tenant, {f"s:{sid}": -removed}, stores.ttl_s)
    stores.release(sid)  # its pinned KV held the turn too
