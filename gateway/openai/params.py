"""OpenAI request -> `Plan`: the request parsed once, at the edge, into what the engine runs.

Planning is one pass over the body, in a worker thread since its work grows with the request:
the bounds (gateway/access/bounds.py: the schemas' sizes and the prompt's length; the counts
were checked as the body was read), the constraint (`tools`, or `response_format` /
`structured_outputs`, parsed into one `ConstraintSpec`), the prompt (the chat template, with
the tools for chat; or the completion prompts, tokenized), then one `SamplingParams` per choice
carrying that spec. The engine never sees the raw OpenAI dicts. Before planning, the gateway
maps `model` to an adapter (`resolve_adapter`) and `session_id` to a session's history
(gateway/sessions/turns.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.protocols import AdapterRegistry
from engine.sampling.params import InvalidRequestError, SamplingParams
from gateway.access.bounds import chat_chars, check_prompt_chars, check_schemas
from gateway.errors import bad_request, clip, model_not_found
from gateway.openai.schemas import ChatCompletionRequest, CompletionRequest
from gateway.openai.tokenizer import GatewayTokenizer
from gateway.openai.tools import render_messages, resolve_tools
from grammar.spec import ConstraintSpec, GrammarError, parse_constraint
from grammar.tool_parser import HERMES, CallFormat
from grammar.tools import ToolChoice, tool_constraint


@dataclass(frozen=True)
class Job:
    """One engine request: choice `index` of the response."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Plan:
    """One request, planned: a job per choice, and the constraint their `SamplingParams` share
    (None: free text), which the gateway compiles before it submits the jobs."""

    jobs: list[Job]
    constraint: ConstraintSpec | None


@dataclass(frozen=True)
class EngineFacts:
    """What the planner needs from the engine and the config."""

    max_model_len: int
    validate: Callable[[list[int], SamplingParams], None]  # raises InvalidRequestError
    default_max_tokens: int | None = None


def resolve_adapter(
    requested: str, served: str, tenant: str, adapters: AdapterRegistry | None = None
) -> str | None:
    """The adapter `model` names (None: the base model). `model` is the base model's name, an
    adapter's name or `base:adapter`. Adapters belong to their tenant: another tenant's adapter
    is as unknown (404) as one never uploaded. `adapters`: the engine's (None: no LoRA)."""
    if requested == served:
        return None
    name = requested.removeprefix(served + ":")
    if adapters is not None and adapters.get(tenant, name) is not None:
        return name
    raise model_not_found(requested)


def resolve_constraint(
    body: ChatCompletionRequest | CompletionRequest,
    tools: ToolChoice | None = None,
    fmt: CallFormat = HERMES,
) -> ConstraintSpec | None:
    """The constraint the output follows (None: free text): the tool-call format `fmt` when
    `tools` (the chat body's, from `resolve_tools`) are called, else `response_format` /
    `structured_outputs`. A malformed one, or `response_format` beside active tools (the output
    is then the call format), is a 400 naming the problem."""
    try:
        spec = tool_constraint(tools, fmt)
        if spec is None:
            return parse_constraint(body.response_format, body.structured_outputs)
    except GrammarError as e:
        raise bad_request(e.message, e.param or "response_format") from None
    format_given = body.response_format or body.structured_outputs
    if format_given and (body.response_format or {}).get("type") != "text":
        raise bad_request("response_format cannot be combined with tools unless "
                          "tool_choice is 'none'", "response_format")
    return spec


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, object]]:
    """The request's messages as plain dicts (what a session stores): role, text content, and
    the tool fields when present."""
    out = []
    for m in body.messages:
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, object] = {"role": role, "content": m.text()}
        if m.tool_calls:
            msg["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def plan_chat(
    body: ChatCompletionRequest, tok: GatewayTokenizer, facts: EngineFacts, adapter: str | None
) -> Plan:
    """The plan of a chat request (its whole history for a session turn). It checks the
    sizes of the request's schemas and prompt (gateway/access/bounds.py) before the work that
    grows with them (schemas, template, tokens); the counts are the caller's (`check_counts`
    as the body is read, `check_history` for a history put before it)."""
    check_schemas(body)
    check_prompt_chars(chat_chars(body), facts.max_model_len, "messages")
    fmt = tok.call_format
    tools = resolve_tools(body)  # checking the tools' schemas is the slow part: once
    constraint = resolve_constraint(body, tools, fmt or HERMES)
    messages, rendered_tools = render_messages(body, tools, native=fmt is not None)
    try:
        prompt = tok.chat_prompt(messages, rendered_tools, template_kwargs(body),
                                 body.continue_final_message)
    except InvalidRequestError as e:
        raise bad_request(e.message, e.param) from None
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    jobs = _jobs([prompt], body, logprobs, constraint, tok, facts, adapter, "messages")
    return Plan(jobs, constraint)


# apply_chat_template's own arguments: a request's template variables may not set them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def template_kwargs(body: ChatCompletionRequest) -> dict[str, object]:
    """`chat_template_kwargs` (e.g. enable_thinking), checked: a 400 for one that would set
    what the gateway sets itself. `reasoning_effort` "none" turns thinking off unless they
    say otherwise."""
    kwargs = body.chat_template_kwargs or {}
    taken = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if taken:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(taken)}",
                          "chat_template_kwargs")
    if body.reasoning_effort == "none":
        return {"enable_thinking": False, **kwargs}
    return kwargs


def plan_completion(
    body: CompletionRequest, tok: GatewayTokenizer, facts: EngineFacts, adapter: str | None
) -> Plan:
    """The plan of a text completion: one job per prompt and choice."""
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
    jobs = _jobs(prompts, body, body.logprobs, constraint, tok, facts, adapter, "prompt")
    return Plan(jobs, constraint)


def _jobs(
    prompts: list[list[int]],
    body: ChatCompletionRequest | CompletionRequest,
    logprobs: int | None,
    constraint: ConstraintSpec | None,
    tok: GatewayTokenizer,
    facts: EngineFacts,
    adapter: str | None,
    prompt_param: str,
) -> list[Job]:
    """One job per prompt and choice, each validated by the engine; its refusal is a 400
    (`prompt_param`: the field that holds the prompt)."""
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
    constraint: ConstraintSpec | None,
) -> SamplingParams:
    chat = isinstance(body, ChatCompletionRequest)
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
        speculative=body.speculative,
        logprobs=logprobs,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty or 1.0,
        logit_bias=bias,
        constraint=constraint,  # parsed once per request, shared by its choices
        adapter=adapter,
        # A chat reply from a reasoning model reasons first; a raw completion is all answer.
        reasoning=chat,
        max_reasoning_tokens=(body.reasoning_budget
                              if isinstance(body, ChatCompletionRequest) else None),
    )


def _logit_bias(raw: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (raw or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias key {clip(key)!r} is not a token id",
                              "logit_bias") from None
        if not 0 <= token < vocab_size:
            raise bad_request(f"logit_bias token id {token} is out of range", "logit_bias")
        out[token] = value
    return out
