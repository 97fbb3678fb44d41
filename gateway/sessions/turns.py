"""A session's turn: a chat completion with `session_id`.

The turn's messages are appended to the stored history, the whole history is the prompt, and
the reply is appended too. The engine keeps the turn's KV pinned in the prefix cache for the
next turn (`GenerateRequest.session_id`); whether it is still there or must be recomputed
changes only speed, never the reply. The turn is acknowledged (response body, or the
stream's `[DONE]`) only after its history is written.

Before generation the turn reserves its room in the tenant's storage ledger (its new
messages and a reply allowance, gateway/access/quota.py): a tenant over its quota gets a 403,
and a full or unreachable store a 503, before any tokens are spent.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from gateway.access.bounds import check_history
from gateway.access.quota import REPLY_BYTES_PER_TOKEN, Ledger, Reservation, messages_size
from gateway.config import MAX_TTL_S
from gateway.errors import APIError, bad_request, clip, store_unavailable
from gateway.openai.params import chat_messages
from gateway.openai.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from gateway.openai.sse import DONE, event
from gateway.redis_store import StoreUnavailable
from gateway.sessions.store import Message, Session, SessionStore

if TYPE_CHECKING:
    from gateway.openai.bodies import ChatFormat
    from gateway.openai.generation import Generation


class CreateSession(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    messages: list[ChatMessage] = Field(default_factory=list)
    tools: list[dict[str, object]] | None = None
    ttl_seconds: int | None = Field(default=None, ge=1, le=MAX_TTL_S,
                                    description="default: the server's --session-ttl")


class ForkSession(BaseModel):
    model_config = ConfigDict(extra="forbid")

    message_index: int | None = Field(default=None, ge=0,
                                      description="keep messages[:message_index]")


def session_not_found(session_id: str) -> APIError:
    return APIError(404, f"No session found with id '{clip(session_id)}'.", param="session_id",
                    code="session_not_found")


async def find_session(store: SessionStore, tenant: str, session_id: str) -> Session:
    """The tenant's session, or a 404 that does not say whether another tenant has it."""
    session = await store.get(tenant, session_id)
    if session is None:
        raise session_not_found(session_id)
    return session


async def resolve_session(
    body: ChatCompletionRequest | CompletionRequest, tenant: str, store: SessionStore
) -> SessionTurn | None:
    """The session turn `session_id` names (None: a sessionless request). 404 for an
    unknown, expired or other tenant's session; 400 for a `model` other than the session's."""
    if body.session_id is None:
        return None
    if not isinstance(body, ChatCompletionRequest):
        raise bad_request("session_id works with chat completions only", "session_id")
    session = await find_session(store, tenant, body.session_id)
    if body.model != session.model:
        raise bad_request(f"session '{session.id}' uses model '{session.model}', not "
                          f"'{clip(body.model)}'", "model")
    if body.n != 1:
        raise bad_request("a session turn has one reply: n must be 1", "n")
    return SessionTurn(store, session, chat_messages(body))


@dataclass
class SessionTurn:
    store: SessionStore
    session: Session
    new_messages: list[Message]  # what this turn adds before the reply
    room: Reservation | None = None  # taken by `reserve`

    def reservation(self, ledger: Ledger, max_tokens: int) -> Reservation:
        """The room this turn may take in the session's history: its new messages and a
        reply of `max_tokens`."""
        nbytes = messages_size(self.new_messages) + REPLY_BYTES_PER_TOKEN * max_tokens
        self.room = Reservation(ledger, self.session.tenant, f"s:{self.session.id}",
                                nbytes, self.session.ttl_seconds or MAX_TTL_S)
        return self.room

    def conversation(self) -> list[Message]:
        """The whole history (stored + new messages), the turn's prompt: a 400 when they are
        more than a request's messages may be."""
        history = self.session.messages + self.new_messages
        check_history(len(history))
        return history

    async def commit(self, gen: Generation, fmt: ChatFormat) -> None:
        """Append this turn and its reply, the message the client got (tool calls included),
        to the history; nothing if generation failed."""
        choice = gen.ordered[0]
        if choice.finish_reason in (None, "error", "abort"):
            await self.release()
            return
        reply, _ = fmt.message(choice)
        written = [*self.new_messages, reply]
        try:
            await self.store.append(self.session, written)
        except StoreUnavailable:
            await self.release()
            raise
        if self.room is not None:
            await self.room.settle({self.room.entry: messages_size(written)},
                                   self.room.ttl_s)

    async def release(self) -> None:
        """The turn writes nothing (it failed, or was refused before generation)."""
        if self.room is not None:
            await self.room.release()

    async def commit_before_done(
        self, events: AsyncGenerator[str, None], gen: Generation, fmt: ChatFormat
    ) -> AsyncGenerator[str, None]:
        """A stream whose `[DONE]` comes only after the history is written."""
        try:
            async for e in events:
                if e == DONE:
                    try:
                        await self.commit(gen, fmt)
                    except StoreUnavailable as err:
                        yield event(store_unavailable(err).body())
                yield e
        finally:
            await events.aclose()
            try:
                await self.release()  # a stream cut before [DONE] wrote nothing
            except StoreUnavailable:
                pass  # the room stays taken until the ledger entry expires

