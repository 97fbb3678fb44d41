"""`/v1/responses`: OpenAI's Responses API over the chat machinery and sessions.

One request: auth -> body (ResponsesRequest) -> model -> admission (queue bound, tenant
limits) -> chain (`previous_response_id` / `conversation`: the history, gateway/responses/chain.py)
-> plan, in a worker thread (items -> chat messages -> `responses_input`: tools, `text.format`,
sampling -> gateway/openai/params.py's `plan_chat`: template, tokens) -> grammar compile -> the
room it will store, reserved in the tenant's storage ledger (403 over quota, 503 with the
store full or down: before generation) -> engine -> output items (gateway/responses/output.py)
-> the turn written to its session and the response stored (when `store`) -> the body, or the
stream's `response.completed`. From model to engine is chat completions' path
(gateway/admission.py), `ResponseFront` this module's side of it. A response is acknowledged
only once stored; one that failed is never stored.

Each response's id is sent as the `x-switchboard-response-id` header too, before the body, so
the router (gateway/router/app.py) can send the next turn to the replica holding its KV.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from gateway.access.auth import Authenticate
from gateway.access.quota import REPLY_BYTES_PER_TOKEN, Reservation, json_size, messages_size
from gateway.admission import admit
from gateway.body import read_body
from gateway.errors import bad_request, generation_failed, store_unavailable
from gateway.openai.generation import Generation
from gateway.openai.params import EngineFacts, Plan, plan_chat
from gateway.openai.sse import SSEResponse
from gateway.openai.tokenizer import GatewayTokenizer
from gateway.redis_store import StoreUnavailable
from gateway.responses.chain import Chain, Stores, commit, forget, not_found, resolve_chain
from gateway.responses.items import (
    RESPONSE_ID_HEADER,
    Item,
    ResponsesRequest,
    input_messages,
    message_items,
    new_id,
    reply_message,
    responses_input,
)
from gateway.responses.output import OutputBuilder, response_body, response_usage
from gateway.runtime import Runtime
from gateway.sessions.store import Message

INCOMPLETE = {"length": "max_output_tokens"}


def response_routes(rt: Runtime, stores: Stores, authenticate: Authenticate) -> APIRouter:
    router = APIRouter()
    limit = rt.config.max_request_bytes

    @router.post("/v1/responses")
    async def create_response(request: Request, tenant: str = Depends(authenticate)) -> Response:
        body = await read_body(request, ResponsesRequest, limit)
        response_id = new_id("resp")
        front = ResponseFront(rt, stores, tenant, body, response_id)
        gen = await admit(rt, request, tenant, body.model, 1, response_id, front)
        turn = Turn(stores, body, front.chain, front.new, gen, tenant, front.room)
        headers = {RESPONSE_ID_HEADER: response_id}
        if body.stream:
            sse = SSEResponse(turn.events(), on_close=gen.close)
            sse.headers.update(headers)
            return sse
        try:
            async for _ in gen.outputs(request.is_disconnected):
                pass
            return JSONResponse(await turn.finish(), headers=headers)
        finally:
            gen.close()
            await turn.release()

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, tenant: str = Depends(authenticate)) -> object:
        return (await _record(stores, tenant, response_id))["body"]

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(
        response_id: str, tenant: str = Depends(authenticate)
    ) -> dict[str, object]:
        record = await _record(stores, tenant, response_id)
        await forget(stores, tenant, response_id, record)
        return {"id": response_id, "object": "response", "deleted": True}

    @router.get("/v1/responses/{response_id}/input_items")
    async def input_items(
        response_id: str,
        tenant: str = Depends(authenticate),
        after: str | None = None,
        limit: int = Query(20, ge=1, le=100),
        order: str = Query("desc", pattern="^(asc|desc)$"),
    ) -> dict[str, object]:
        items = (await _record(stores, tenant, response_id))["input"]
        assert isinstance(items, list)
        return page(items, after, limit, order)

    return router


def page(items: list[Item], after: str | None, limit: int, order: str) -> dict[str, object]:
    """One page of a list, as OpenAI's cursor pages shape it."""
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [i.get("id") for i in ordered]
        if after not in ids:
            raise bad_request(f"No item with id '{after}' in this list.", "after")
        ordered = ordered[ids.index(after) + 1:]
    data = ordered[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(ordered) > limit}


async def _record(stores: Stores, tenant: str, response_id: str) -> dict[str, object]:
    record = await stores.responses.get(tenant, response_id)
    if record is None:
        raise not_found("response", response_id)
    return record


class ResponseFront:
    """The Responses API's side of admission (gateway/admission.py): the chain the response
    continues, and the room its commit will store (when `store`, or in a conversation)."""

    # Set by `prepare`: the chain, and this turn's input as messages.
    chain: Chain
    new: list[Message]

    def __init__(self, rt: Runtime, stores: Stores, tenant: str, body: ResponsesRequest,
                 response_id: str):
        self.rt, self.stores, self.tenant, self.body = rt, stores, tenant, body
        self.response_id = response_id
        self.nbytes = 0  # what the commit stores besides the reply (`_plan`'s)
        self.room: Reservation | None = None

    async def prepare(self, tok: GatewayTokenizer, facts: EngineFacts,
                      adapter: str | None) -> Plan:
        self.chain = await resolve_chain(self.stores, self.tenant, self.body)
        self.new, plan, self.nbytes = await asyncio.to_thread(_plan, self.body, self.chain, tok,
                                                              facts, adapter)
        return plan

    def grammar_param(self, param: str | None) -> str | None:
        return param or "text.format"

    async def reserve(self, plan: Plan) -> str | None:
        if not (self.body.store or self.chain.conversation):  # the commit writes nothing
            return None
        nbytes = self.nbytes + 2 * REPLY_BYTES_PER_TOKEN * plan.jobs[0].params.max_tokens
        entry = (f"s:{self.chain.session.id}" if self.chain.conversation
                 else f"sp:{self.response_id}")
        self.room = await Reservation(self.stores.ledger, self.tenant, entry, nbytes,
                                      self.stores.ttl_s).take(self.rt.storage_quota(self.tenant))
        return self.chain.session.id

    async def release(self) -> None:
        if self.room is not None:
            await self.room.release()


def _plan(body: ResponsesRequest, chain: Chain, tok: GatewayTokenizer, facts: EngineFacts,
          adapter: str | None) -> tuple[list[Message], Plan, int]:
    """(this turn's input as messages, its plan, the bytes its commit stores besides the
    reply: the input twice (history and record), and the history when the commit copies
    it into a new session); in a worker thread. Errors name the Responses parameters
    (`input`, `text.format`, `tools[i].parameters`)."""
    origins: list[int] = []
    new = input_messages(body.input, origins=origins)
    plan = plan_chat(responses_input(body, chain.history, new, origins), tok, facts, adapter)
    copied = 0 if chain.stored else messages_size(chain.history)
    return new, plan, 2 * messages_size(new) + copied


class Turn:
    """One response being generated: its output, then its commit (session + record)."""

    def __init__(self, stores: Stores, body: ResponsesRequest, chain: Chain,
                 new: list[Message], gen: Generation, tenant: str, room: Reservation | None):
        self.stores, self.body, self.chain, self.new, self.gen = stores, body, chain, new, gen
        self.tenant, self.room = tenant, room
        self.choice = gen.ordered[0]
        spec = self.choice.job.params.constraint
        self.output = OutputBuilder(spec if spec is not None and spec.kind == "tool_calls"
                                    else None)
        self.created_at = int(time.time())
        self._seq = 0

    def body_now(self, status: str, output: list[Item], usage: dict[str, object] | None = None,
                 error: dict[str, object] | None = None,
                 incomplete: str | None = None) -> dict[str, object]:
        return response_body(self.body, self.gen.response_id, self.created_at, status, output,
                             usage, error, incomplete)

    async def finish(self) -> dict[str, object]:
        """The finished response's body, stored first (non-streamed: the whole text at once).
        A generation that failed is a 500 and stores nothing."""
        c = self.choice
        if c.finish_reason in (None, "abort"):  # the client left: nothing to store
            return self.body_now("cancelled", [])
        if c.finish_reason == "error":
            raise generation_failed(c.error, c.error_code)
        self.output.reason(c.reasoning)
        self.output.feed(c.text, final=True)
        self.output.finish(self._item_status())
        return await self._commit()

    async def events(self) -> AsyncGenerator[str, None]:
        """The Responses stream: created, in_progress, the items' events, then completed
        (or incomplete) once stored; response.failed when generation fails."""
        try:
            yield self._event({"type": "response.created",
                               "response": self.body_now("in_progress", [])})
            yield self._event({"type": "response.in_progress",
                               "response": self.body_now("in_progress", [])})
            async for c, out in self.gen.outputs():
                if c.finish_reason == "error":
                    failure = generation_failed(c.error, c.error_code)
                    error: dict[str, object] = {"code": failure.code or "server_error",
                                                "message": failure.message}
                    yield self._event({"type": "response.failed", "response": self.body_now(
                        "failed", self.output.items, error=error)})
                    return
                for e in [*self.output.reason(out.new_reasoning_text),
                          *self.output.feed(out.new_text, final=out.finished)]:
                    yield self._event(e)
                if out.finished:
                    for e in self.output.finish(self._item_status()):
                        yield self._event(e)
            if self.choice.finish_reason in (None, "abort"):
                return
            try:
                body = await self._commit()
            except StoreUnavailable as err:
                failure = store_unavailable(err)
                yield self._event({"type": "error", "code": failure.code,
                                   "message": failure.message, "param": None})
                return
            kind = "response.incomplete" if body["status"] == "incomplete" else \
                "response.completed"
            yield self._event({"type": kind, "response": body})
        finally:
            self.gen.close()
            try:
                await self.release()
            except StoreUnavailable:
                pass  # the room stays taken until its ledger entry expires

    async def release(self) -> None:
        """Give back the reserved room if nothing was committed."""
        if self.room is not None:
            await self.room.release()

    async def _commit(self) -> dict[str, object]:
        finish = self.choice.finish_reason or "stop"
        output = self.output.final_items()
        incomplete = INCOMPLETE.get(finish, None)
        body = self.body_now("incomplete" if incomplete else "completed", output,
                             usage=response_usage(self.gen.usage()), incomplete=incomplete)
        if self.body.store or self.chain.conversation:
            chain, grown = await commit(self.stores, self.chain, self.tenant,
                                        [*self.new, reply_message(output)])
            evicted: list[str] = []
            if self.body.store:
                record = {"session": chain.session.id, "length": chain.length, "body": body,
                          "input": message_items(self.new),
                          "start": chain.length - len(self.new) - 1}
                evicted = await self.stores.responses.put(self.tenant, self.gen.response_id,
                                                          record)
                grown[f"r:{self.gen.response_id}"] = json_size(record)
            if self.room is not None:
                await self.room.settle(grown, self.stores.ttl_s)
            await self.stores.drop_responses(self.tenant, evicted)
        return body

    def _item_status(self) -> str:
        return "incomplete" if self.choice.finish_reason == "length" else "completed"

    def _event(self, data: dict[str, object]) -> str:
        data["sequence_number"] = self._seq
        self._seq += 1
        text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        return f"event: {data['type']}\ndata: {text}\n\n"

