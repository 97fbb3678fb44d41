"""The FastAPI app: OpenAI routes, health, readiness and metrics.

One request, end to end: auth (tenant) -> body (size, JSON, counts (gateway/access/bounds.py),
schema) -> model -> admission (queue bound, tenant limits) -> session -> plan, in a worker
thread (gateway/openai/params.py: bounds, the constraint parsed once, template, prompt ids +
SamplingParams per choice, validated by the engine) -> grammar compile -> a session turn's room
in the storage ledger -> engine -> JSON body or SSE stream. From model to engine is the path
the Responses API takes too (gateway/admission.py), `ChatFront` this module's side of it.
Nothing that grows with the request runs on the event loop, and none of it before the tenant
is admitted.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response

from engine.ipc.async_engine import AsyncEngine
from engine.ipc.core_client import EngineProcess
from gateway.adapters.routes import adapter_model_card, adapter_routes, ensure_adapter, model_cards
from gateway.admission import admit
from gateway.body import read_body
from gateway.config import ServeConfig
from gateway.errors import generation_failed, install_error_handlers
from gateway.messages.routes import message_routes
from gateway.messages.schemas import CountTokensRequest, MessagesRequest
from gateway.metrics import RequestCounter
from gateway.openai.bodies import ChatFormat, CompletionFormat
from gateway.openai.generation import Generation
from gateway.openai.params import (
    EngineFacts,
    Plan,
    chat_input,
    plan_chat,
    plan_completion,
    resolve_adapter,
)
from gateway.openai.schemas import ChatCompletionRequest, CompletionRequest
from gateway.openai.sse import SSEResponse, stream_events
from gateway.openai.tokenizer import GatewayTokenizer
from gateway.openapi import document_bodies
from gateway.responses.chain import Stores
from gateway.responses.conversations import AddItems, CreateConversation, conversation_routes
from gateway.responses.items import ResponsesRequest
from gateway.responses.routes import response_routes
from gateway.runtime import Runtime
from gateway.sessions.routes import add_session_routes
from gateway.sessions.turns import CreateSession, ForkSession, SessionTurn, resolve_session


def create_app(config: ServeConfig, engine: AsyncEngine | EngineProcess | None = None) -> FastAPI:
    """The app serving `config`. The engine starts loading when the app starts (lifespan)."""
    rt = Runtime(config, engine)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await rt.start()
        yield
        await rt.stop()

    app = FastAPI(
        title="Switchboard", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None
    )
    app.state.runtime = rt
    install_error_handlers(app)
    app.add_middleware(RequestCounter, metrics=rt.metrics)

    # Dependencies are coroutines: FastAPI runs a plain `def` one in its thread pool, a thread
    # hop per request (and a wait for a pool thread under load) for a dict lookup.
    # `x-api-key` is the Anthropic SDK's (and Claude Code's) way to send the same keys.
    async def authenticate(authorization: str | None = Header(None),
                           x_api_key: str | None = Header(None)) -> str:
        return rt.auth.tenant_for(f"Bearer {x_api_key}" if x_api_key else authorization)

    add_session_routes(app, rt, authenticate)

    @app.get("/health")
    async def health() -> dict[str, str]:
        rt.require_alive()
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> dict[str, str]:
        rt.require_ready()
        return {"status": "ready", "model": config.model_name}

    async def admin(authorization: str | None = Header(None)) -> None:
        rt.auth.require_admin(authorization)

    # Its labels name every tenant: with API keys, only admin keys read it.
    @app.get("/metrics", dependencies=[] if config.public_metrics else [Depends(admin)])
    async def metrics() -> Response:
        body, content_type = rt.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def list_models(tenant: str = Depends(authenticate)) -> dict[str, object]:
        return {"object": "list", "data": [_model_card(config, created),
                                           *await model_cards(rt, tenant)]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str, tenant: str = Depends(authenticate)) -> dict[str, object]:
        await ensure_adapter(rt, tenant, model)
        adapter = resolve_adapter(model, config.model_name, tenant, rt.engine.adapters)
        if adapter is None:
            return _model_card(config, created)
        return adapter_model_card(rt, tenant, adapter)

    app.include_router(adapter_routes(rt, authenticate))
    stores = Stores.of(rt)
    app.include_router(response_routes(rt, stores, authenticate))
    app.include_router(conversation_routes(rt, stores, authenticate))
    app.include_router(message_routes(rt, authenticate))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, tenant: str = Depends(authenticate)) -> Response:
        body = await read_body(request, ChatCompletionRequest, config.max_request_bytes)
        return await _generate(request, tenant, body, "chatcmpl")

    @app.post("/v1/completions")
    async def completions(request: Request, tenant: str = Depends(authenticate)) -> Response:
        body = await read_body(request, CompletionRequest, config.max_request_bytes)
        return await _generate(request, tenant, body, "cmpl")

    document_bodies(app, {"/v1/chat/completions": ChatCompletionRequest,
                          "/v1/completions": CompletionRequest,
                          "/v1/responses": ResponsesRequest,
                          "/v1/messages": MessagesRequest,
                          "/v1/messages/count_tokens": CountTokensRequest,
                          "/v1/conversations": CreateConversation,
                          "/v1/conversations/{cid}/items": AddItems,
                          "/v1/sessions": CreateSession,
                          "/v1/sessions/{session_id}/fork": ForkSession})

    async def _generate(
        request: Request,
        tenant: str,
        body: ChatCompletionRequest | CompletionRequest,
        prefix: str,
    ) -> Response:
        front = ChatFront(rt, tenant, body)
        gen = await admit(rt, request, tenant, body.model, _num_sequences(body),
                          f"{prefix}-{uuid.uuid4().hex[:24]}", front)
        tok, turn = front.tok, front.turn
        fmt: ChatFormat | CompletionFormat
        if isinstance(body, ChatCompletionRequest):
            fmt = ChatFormat(gen, config.model_name, tok, body.include_usage)
        else:
            fmt = CompletionFormat(gen, config.model_name, tok, body.include_usage, body.echo)
        if body.stream:
            events = stream_events(gen, fmt, body.include_usage)
            if turn and isinstance(fmt, ChatFormat):  # a session turn is always a chat
                events = turn.commit_before_done(events, gen, fmt)
            return SSEResponse(events, on_close=gen.close)
        try:
            response = await _collect(gen, fmt, request.is_disconnected)
        except BaseException:
            if turn:
                await turn.release()
            raise
        if turn and isinstance(fmt, ChatFormat):
            await turn.commit(gen, fmt)  # the turn is acknowledged only once its history is stored
        return response

    return app


class ChatFront:
    """Chat and text completions' side of admission (gateway/admission.py): a session turn's
    history (gateway/sessions/turns.py) and the room its commit will store."""

    tok: GatewayTokenizer  # set by `prepare`: the plan's, which reads the output too

    def __init__(self, rt: Runtime, tenant: str,
                 body: ChatCompletionRequest | CompletionRequest):
        self.rt, self.tenant, self.body = rt, tenant, body
        self.turn: SessionTurn | None = None

    async def prepare(self, tok: GatewayTokenizer, facts: EngineFacts,
                      adapter: str | None) -> Plan:
        self.tok = tok
        self.turn = await resolve_session(self.body, self.tenant, self.rt.sessions)
        return await asyncio.to_thread(_plan, self.body, self.turn, tok, facts, adapter)

    def grammar_param(self, param: str | None) -> str | None:
        return param or "response_format"

    async def reserve(self, plan: Plan) -> str | None:
        if self.turn is None:
            return None
        await self.turn.reservation(self.rt.ledger, plan.jobs[0].params.max_tokens).take(
            self.rt.storage_quota(self.tenant))
        return self.turn.session.id

    async def release(self) -> None:
        if self.turn:
            await self.turn.release()


def _plan(
    body: ChatCompletionRequest | CompletionRequest,
    turn: SessionTurn | None,
    tok: GatewayTokenizer,
    facts: EngineFacts,
    adapter: str | None,
) -> Plan:
    """The request's plan; in a worker thread (gateway/openai/params.py checks the bounds)."""
    if isinstance(body, CompletionRequest):
        return plan_completion(body, tok, facts, adapter)
    return plan_chat(chat_input(body, turn.conversation() if turn else None), tok, facts, adapter)


def _num_sequences(body: ChatCompletionRequest | CompletionRequest) -> int:
    return body.n * (len(body.prompts) if isinstance(body, CompletionRequest) else 1)


async def _collect(
    gen: Generation,
    fmt: ChatFormat | CompletionFormat,
    disconnected: Callable[[], Awaitable[bool]],
) -> Response:
    try:
        async for _ in gen.outputs(disconnected):
            pass
    finally:
        gen.close()
    failed = [c for c in gen.ordered if c.finish_reason == "error"]
    if failed:
        raise generation_failed(failed[0].error, failed[0].error_code)
    return JSONResponse(fmt.body())


def _model_card(config: ServeConfig, created: int) -> dict[str, object]:
    return {
        "id": config.model_name,
        "object": "model",
        "created": created,
        "owned_by": "switchboard",
    }
