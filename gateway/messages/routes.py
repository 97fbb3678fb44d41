"""`/v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API over the chat
machinery.

One request: auth (`x-api-key`, or `Authorization: Bearer`: the same keys and tenants) -> body
(MessagesRequest) -> model (`base:adapter` as elsewhere) -> admission (gateway/admission.py:
queue bound, tenant limits) -> plan, in a worker thread (gateway/messages/prompt.py: the
request as a chat completion, then gateway/openai/params.py's `plan_chat`) -> grammar compile
-> engine -> the message, or its stream (gateway/messages/output.py). Nothing is stored: the
Messages API is stateless, and the prefix cache makes a conversation's next turn cheap
(`usage.cache_read_input_tokens`). `anthropic-version` and `anthropic-beta` are accepted and
change nothing.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from gateway.access.auth import Authenticate
from gateway.adapters.routes import ensure_adapter
from gateway.admission import admit
from gateway.body import read_body
from gateway.errors import generation_failed
from gateway.messages.output import MessageFormat
from gateway.messages.prompt import to_input
from gateway.messages.schemas import CountTokensRequest, MessagesRequest
from gateway.openai.params import EngineFacts, Plan, plan_chat, resolve_adapter
from gateway.openai.sse import SSEResponse
from gateway.openai.tokenizer import GatewayTokenizer
from gateway.responses.items import new_id
from gateway.runtime import Runtime


def message_routes(rt: Runtime, authenticate: Authenticate) -> APIRouter:
    router = APIRouter()
    limit = rt.config.max_request_bytes

    @router.post("/v1/messages")
    async def create_message(request: Request, tenant: str = Depends(authenticate)) -> Response:
        body = await read_body(request, MessagesRequest, limit)
        gen = await admit(rt, request, tenant, body.model, 1, new_id("msg"),
                          MessagesFront(body))
        omit = body.thinking is not None and body.thinking.display == "omitted"
        fmt = MessageFormat(gen, body.model, omit)
        if body.stream:
            return SSEResponse(fmt.events(), on_close=gen.close)
        try:
            async for _ in gen.outputs(request.is_disconnected):
                pass
        finally:
            gen.close()
        c = fmt.choice
        if c.finish_reason == "error":
            raise generation_failed(c.error, c.error_code)
        return JSONResponse(fmt.body())

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request,
                           tenant: str = Depends(authenticate)) -> dict[str, int]:
        body = await read_body(request, CountTokensRequest, limit)
        await ensure_adapter(rt, tenant, body.model)
        adapter = resolve_adapter(body.model, rt.config.model_name, tenant, rt.engine.adapters)
        tok, facts = rt.require_ready()
        plan = await asyncio.to_thread(_plan, body, tok, facts, adapter, 1)
        return {"input_tokens": len(plan.jobs[0].prompt_ids)}

    return router


class MessagesFront:
    """The Messages API's side of admission (gateway/admission.py): no history (the request
    carries its conversation), nothing stored."""

    def __init__(self, body: MessagesRequest):
        self.body = body

    async def prepare(self, tok: GatewayTokenizer, facts: EngineFacts,
                      adapter: str | None) -> Plan:
        return await asyncio.to_thread(_plan, self.body, tok, facts, adapter,
                                       self.body.max_tokens)

    def grammar_param(self, param: str | None) -> str | None:
        return param or ("tools" if self.body.tools else "output_config.format")

    async def reserve(self, plan: Plan) -> str | None:
        return None

    async def release(self) -> None:
        pass


def _plan(body: CountTokensRequest, tok: GatewayTokenizer, facts: EngineFacts,
          adapter: str | None, max_tokens: int) -> Plan:
    """The plan of `body`'s reply, in a worker thread. Errors name the Messages parameters."""
    return plan_chat(to_input(body, max_tokens), tok, facts, adapter)
