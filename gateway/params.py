"""OpenAI request -> engine jobs: prompt token ids and one `SamplingParams` per choice.

The extension points for later issues live here, each one function the request passes
through: `resolve_adapter` (adapters as `model`), `resolve_constraint` (`response_format`,
`tools`: structured output) and `resolve_session` (`session_id`, in gateway/sessions.py). They
accept the plain cases and refuse what is not built yet with a clear 400, never silently.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.sampling_params import InvalidRequestError, SamplingParams
from gateway.bounds import chat_chars, check_counts, check_prompt_chars, check_schemas
from gateway.errors import bad_request, model_not_found
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.tokenizer import GatewayTokenizer
from gateway.tools import render_messages, resolve_tools, tools_constraint
from grammar.spec import ConstraintSpec, GrammarError, parse_constraint
from grammar.tool_parser import HERMES, CallFormat
from grammar.tools import ToolChoice


@dataclass(frozen=True)
class Job:
    """One engine request: choice `index` of the response."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class EngineFacts:
    """What the planner needs from the engine and the config."""

    max_model_len: int
    validate: Callable[[list[int], SamplingParams], None]  # raises InvalidRequestError
    default_max_tokens: int | None = None


# -- extension points -------------------------------------------------------------------


def resolve_adapter(requested: str, served: str, tenant: str, adapters: Any = None) -> str | None:
    """The adapter `model` names (None: the base model). `model` is the base model's name, an
    adapter's name or `base:adapter`. Adapters belong to their tenant: another tenant's adapter
    is as unknown (404) as one never uploaded. `adapters` is the engine's adapter manager."""
    if requested == served:
        return None
    name = requested.removeprefix(served + ":")
    if adapters is not None and adapters.get(tenant, name) is not None:
        return name
    raise model_not_found(requested)


def resolve_constraint(
    body: ChatCompletionRequest | CompletionRequest,
    fmt: CallFormat = HERMES,
    tools: ToolChoice | None = None,
) -> ConstraintSpec | None:
    """The structured-output constraint of the request (None: free text): the tool-call format
    `fmt` when tools are on (gateway/tools.py; `tools`: already resolved), else
    `response_format` / `structured_outputs`. A malformed one is a 400 naming the problem."""
    if isinstance(body, ChatCompletionRequest):
        spec = tools_constraint(body, fmt, tools)
        if spec is not None:
            return spec
    try:
        return parse_constraint(body.response_format, body.structured_outputs)
    except GrammarError as e:
        raise bad_request(e.message, e.param or "response_format") from None


# -- planning ---------------------------------------------------------------------------


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's messages as plain dicts (what a session stores): role, text content, and
    the tool fields when present."""
    out = []
    for m in body.messages:
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": m.text()}
        if m.tool_calls:
            msg["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def plan_chat(
    body: ChatCompletionRequest, tok: GatewayTokenizer, facts: EngineFacts, adapter: str | None
) -> list[Job]:
    """The jobs of a chat request (its whole history for a session turn). Work here grows
    with the request (schemas, template, tokens): the gateway calls it off the event loop,
    and it checks the request's bounds (gateway/bounds.py) before that work."""
    check_counts(body)
    check_schemas(body)
    check_prompt_chars(chat_chars(body), facts.max_model_len, "messages")
    fmt = tok.call_format
    tools = resolve_tools(body)  # once: checking the tools' schemas is the slow part
    constraint = resolve_constraint(body, fmt or HERMES, tools)
    messages, rendered_tools = render_messages(body, native=fmt is not None, choice=tools)
    try:
        prompt = tok.chat_prompt(messages, rendered_tools)
    except InvalidRequestError as e:
        raise bad_request(e.message, e.param) from None
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return _jobs([prompt], body, logprobs, tok, facts, adapter, prompt_param="messages",
                 constraint=constraint)


def plan_completion(
    body: CompletionRequest, tok: GatewayTokenizer, facts: EngineFacts, adapter: str | None
) -> list[Job]:
    """The jobs of a text completion; like `plan_chat`, for a worker thread."""
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if body.best_of not in (None, 1, body.n):
        raise bad_request("best_of other than n is not supported", "best_of")
    if body.echo and body.logprobs is not None:
        raise bad_request("echo together with logprobs is not supported", "echo")
    check_schemas(body)
    for p in body.prompts:
        if isinstance(p, str):
            check_prompt_chars(len(p), facts.max_model_len, "prompt")
    constraint = resolve_constraint(body)
    prompts = [tok.encode(p) if isinstance(p, str) else list(p) for p in body.prompts]
    return _jobs(prompts, body, body.logprobs, tok, facts, adapter, prompt_param="prompt",
                 constraint=constraint)


def _jobs(
    prompts: list[list[int]],
    body: ChatCompletionRequest | CompletionRequest,
    logprobs: int | None,
    tok: GatewayTokenizer,
    facts: EngineFacts,
    adapter: str | None,
    prompt_param: str,
    constraint: ConstraintSpec | None = None,
) -> list[Job]:
    bias = _logit_bias(body.logit_bias, tok.vocab_size)
    jobs = []
    for p, ids in enumerate(prompts):
        for j in range(body.n):
            try:
                params = _params(body, len(ids), logprobs, bias, facts, adapter, j, constraint)
                facts.validate(ids, params)
            except InvalidRequestError as e:
                param = prompt_param if e.param == "prompt" else e.param
                raise bad_request(e.message, param) from None
            jobs.append(Job(p * body.n + j, p, ids, params))
    return jobs


def _params(
    body: ChatCompletionRequest | CompletionRequest,
    prompt_len: int,
    logprobs: int | None,
    bias: dict[int, float],
    facts: EngineFacts,
    adapter: str | None,
    choice: int,
    constraint: ConstraintSpec | None = None,
) -> SamplingParams:
    max_tokens = body.output_limit
    if max_tokens is None:  # what is left of the context, capped by the config
        max_tokens = max(1, facts.max_model_len - prompt_len)
        if facts.default_max_tokens is not None:
            max_tokens = min(max_tokens, facts.default_max_tokens)
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=-1 if body.top_k in (None, 0) else body.top_k,
        min_p=body.min_p or 0.0,
        # n > 1 with a seed: distinct but reproducible choices.
        seed=None if body.seed is None else body.seed + choice,
        stop=body.stop_list,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty or 1.0,
        logit_bias=bias,
        response_format=body.response_format,
        structured_outputs=body.structured_outputs,
        constraint=constraint,  # parsed once per request, not once per choice
        adapter=adapter,
    )


def _logit_bias(raw: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (raw or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        if not 0 <= token < vocab_size:
            raise bad_request(f"logit_bias token id {token} is out of range", "logit_bias")
        out[token] = value
    return out
