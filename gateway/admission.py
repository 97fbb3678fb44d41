"""Admission: a validated request's one way to the engine, shared by chat and text completions
(gateway/app.py) and the Responses API (gateway/responses/routes.py).

model (adapter) -> ready -> seats (the engine's queue bound) -> the tenant's limits -> the
front end's history and plan, in a worker thread -> grammar compile -> the front end's room in
the storage ledger -> the `Generation`, submitted. Admission comes before anything slow
(planning, a grammar compile): overload is a 429 at once, and a tenant over its limits costs no
planning. A refusal after the tenant is admitted (a plan, a grammar, a quota, a store down),
or a client gone meanwhile, gives back the tenant's slot and whatever the front end took.

A front end (`Front`) is what differs: the history its request continues (a session, a
response chain) and its plan; the parameter a grammar no backend compiles is named by; the room
its commit will store, and the session the generation pins in the prefix cache.
"""

from __future__ import annotations

from typing import Protocol

from fastapi import Request

from gateway.access.connections import connection_drop
from gateway.adapters.routes import ensure_adapter
from gateway.errors import bad_request
from gateway.openai.generation import Generation
from gateway.openai.params import EngineFacts, Plan, resolve_adapter
from gateway.openai.tokenizer import GatewayTokenizer
from gateway.runtime import Runtime
from grammar.spec import GrammarError


class Front(Protocol):
    """One front end's side of admission: `prepare`, then `reserve`. `release` may follow
    either, or a `prepare` cut short, and gives back only what was taken."""

    async def prepare(self, tok: GatewayTokenizer, facts: EngineFacts,
                      adapter: str | None) -> Plan:
        """The history the request continues, then its plan (in a worker thread)."""
        ...

    def grammar_param(self, param: str | None) -> str | None:
        """The parameter a grammar error names, as this front end spells it (`param`: the
        one in the chat request's terms, None when the error names none)."""
        ...

    async def reserve(self, plan: Plan) -> str | None:
        """Take the room the commit will store (a 403 over quota, a 503 with the store full
        or down); the session the generation pins (None: none)."""
        ...

    async def release(self) -> None:
        """Give back what `prepare` and `reserve` took: the request never generates."""
        ...


async def admit(rt: Runtime, request: Request, tenant: str, model: str, num_seqs: int,
                request_id: str, front: Front) -> Generation:
    """`front`'s request for `model`, of `num_seqs` sequences, admitted, planned, compiled and
    submitted as `request_id`. A refusal is the error of the step that refused it; once the
    tenant is admitted, its slot and what `front` took are given back first."""
    await ensure_adapter(rt, tenant, model)
    adapter = resolve_adapter(model, rt.config.model_name, tenant, rt.engine.adapters)
    tok, facts = rt.require_ready()
    with rt.seats.reserve(num_seqs):
        ticket = await rt.limiter.admit(tenant)
        try:
            plan = await front.prepare(tok, facts, adapter)
            if plan.constraint is not None:  # a schema no backend compiles is a 400 now
                try:
                    await rt.compile_grammar(plan.constraint)
                except GrammarError as e:
                    raise bad_request(e.message, front.grammar_param(e.param)) from None
            pinned = await front.reserve(plan)  # refused before generation
            gen = Generation(rt.engine, request_id, plan.jobs, tenant, ticket, rt.metrics,
                             pinned, rt.config.max_stream_buffer_bytes,
                             connection_drop(request.scope))
            gen.submit()
        except BaseException:  # also a client gone while planning or compiling
            ticket.release()
            await front.release()
            raise
    return gen
