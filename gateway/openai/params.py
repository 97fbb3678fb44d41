"""Requests -> `Plan`: a request parsed once, at the edge, into what the engine runs.

Every chat-shaped front end (chat completions and their session turns, the Responses API,
the Messages API) states its request as one `ChatInput`: plain chat messages, the tools and
the output format it parsed itself (so their errors name its own fields), the template's
variables and one `Sampling`, plus the `Spelling` that names its fields in the errors the
planner raises. `plan_chat` plans that; `chat_input` is the chat completions' front end.

Planning is one pass, in a worker thread since its work grows with the request: the bounds
(gateway/access/bounds.py: the schemas' sizes and the prompt's length; the counts were
checked as the body was read), the constraint (the tools' call format, or the output format),
the prompt (the chat template, with the tools for chat; or the completion prompts,
tokenized), then one `SamplingParams` per choice carrying that spec. The engine never sees the
raw request dicts. Before planning, the gateway maps `model` to an adapter (`resolve_adapter`)
and `session_id` to a session's history (gateway/sessions/turns.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from engine.protocols import AdapterRegistry
from engine.sampling.params import InvalidRequestError, SamplingParams
from gateway.access.bounds import check_prompt_chars, check_schemas
from gateway.errors import bad_request, clip, model_not_found
from gateway.openai.schemas import ChatCompletionRequest, CompletionRequest
from gateway.openai.tokenizer import GatewayTokenizer
from gateway.openai.tools import Spelling, render_messages, resolve_tools
from grammar.spec import ConstraintSpec, GrammarError, parse_constraint
from grammar.tool_parser import HERMES
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


@dataclass(frozen=True)
class Sampling:
    """How a request samples, as any front end states it; None: the engine's default.
    `plan_chat` and `plan_completion` make one `SamplingParams` of it per choice."""

    n: int = 1
    max_tokens: int | None = None  # None: what is left of the context, capped by the config
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    speculative: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: Mapping[str, float] = field(default_factory=dict)
    logprobs: int | None = None
    max_reasoning_tokens: int | None = None  # None: thinking unbounded


@dataclass(frozen=True)
class ChatInput:
    """A chat-shaped request, whichever front end it came through: what `plan_chat` plans.

    `messages` are plain chat messages (role system / user / assistant / tool, text content,
    `tool_calls`, `tool_call_id`, an assistant's `reasoning_content`). The front end parsed
    `tools` and `output_format` itself, so their errors name its own fields; `format_param`
    names the field that holds the output format, `spelling` the rest."""

    messages: list[dict[str, object]]
    sampling: Sampling
    tools: ToolChoice | None = None
    output_format: ConstraintSpec | None = None  # None: free text (or the tools' calls)
    format_param: str = "response_format"
    template_kwargs: Mapping[str, object] = field(default_factory=dict)
    continue_final: bool = False  # the reply continues the last (assistant) message
    spelling: Spelling = field(default_factory=Spelling)


def sampling(body: ChatCompletionRequest | CompletionRequest) -> Sampling:
    """The sampling fields of an OpenAI body."""
    if isinstance(body, ChatCompletionRequest):
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        budget = body.reasoning_budget
    else:
        logprobs, budget = body.logprobs, None
    return Sampling(
        n=body.n, max_tokens=body.output_limit, temperature=body.temperature, top_p=body.top_p,
        top_k=body.top_k, min_p=body.min_p, seed=body.seed, stop=tuple(body.stop_list),
        stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens, speculative=body.speculative,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, logit_bias=body.logit_bias or {},
        logprobs=logprobs, max_reasoning_tokens=budget)


def chat_messages(body: ChatCompletionRequest, reasoning: bool = False) -> list[dict[str, object]]:
    """The request's messages as plain dicts (what a session stores): role, text content, and
    the tool fields when present (`reasoning`: an assistant's `reasoning_content` too)."""
    out = []
    for m in body.messages:
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, object] = {"role": role, "content": m.text()}
        if m.tool_calls:
            msg["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        thought = (m.model_extra or {}).get("reasoning_content") if reasoning else None
        if role == "assistant" and isinstance(thought, str) and thought:
            msg["reasoning_content"] = thought
        out.append(msg)
    return out


def chat_input(
    body: ChatCompletionRequest, messages: list[dict[str, object]] | None = None
) -> ChatInput:
    """A chat completion request as the planner's input (`messages`: the whole conversation
    of a session turn, else the body's). Checks the schemas' sizes (gateway/access/bounds.py)
    before parsing the tools and the output format; a 400 naming the problem."""
    check_schemas(body)
    tools = resolve_tools(body)  # checking the tools' schemas is the slow part: once
    try:
        fmt = parse_constraint(body.response_format, body.structured_outputs)
    except GrammarError as e:
        raise bad_request(e.message, e.param or "response_format") from None
    return ChatInput(
        messages=chat_messages(body, reasoning=True) if messages is None else messages,
        sampling=sampling(body), tools=tools, output_format=fmt,
        format_param="structured_outputs" if body.response_format is None else "response_format",
        template_kwargs=template_kwargs(body.chat_template_kwargs, body.reasoning_effort),
        continue_final=body.continue_final_message)


def plan_chat(
    inp: ChatInput, tok: GatewayTokenizer, facts: EngineFacts, adapter: str | None
) -> Plan:
    """The plan of a chat-shaped request (its whole history for a session turn or a response
    chain). The prompt's size in characters is checked before the template and the tokens;
    the counts are the caller's (`check_counts` as the body is read, `check_history` for a
    history put before it)."""
    spelling = inp.spelling
    check_prompt_chars(_chars(inp), facts.max_model_len, spelling.prompt)
    fmt = tok.call_format
    constraint = tool_constraint(inp.tools, fmt or HERMES)
    if constraint is None:
        constraint = inp.output_format
    elif inp.output_format is not None:
        raise bad_request(f"{inp.format_param} cannot be combined with tools unless "
                          "tool_choice is 'none'", inp.format_param)
    messages, rendered_tools = render_messages(inp.messages, inp.tools, fmt is not None,
                                               spelling)
    try:
        prompt = tok.chat_prompt(messages, rendered_tools, dict(inp.template_kwargs),
                                 inp.continue_final)
    except InvalidRequestError as e:
        raise bad_request(e.message, spelling.param(e.param)) from None
    jobs = _jobs([prompt], inp.sampling, constraint, tok, facts, adapter, spelling, True)
    return Plan(jobs, constraint)


def _chars(inp: ChatInput) -> int:
    """The characters a chat prompt is made of: message texts and the tools' JSON."""
    tools = inp.tools.tools if inp.tools is not None else ()
    listing = len(json.dumps([t.openai() for t in tools], ensure_ascii=False)) if tools else 0
    return sum(len(str(m.get("content") or "")) for m in inp.messages) + listing


# apply_chat_template's own arguments: a request's template variables may not set them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def template_kwargs(kwargs: Mapping[str, object] | None, effort: str | None) -> dict[str, object]:
    """`chat_template_kwargs` (e.g. enable_thinking), checked: a 400 for one that would set
    what the gateway sets itself. A reasoning effort of "none" turns thinking off unless they
    say otherwise."""
    kwargs = kwargs or {}
    taken = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if taken:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(taken)}",
                          "chat_template_kwargs")
    if effort == "none":
        return {"enable_thinking": False, **kwargs}
    return dict(kwargs)


COMPLETION = Spelling(prompt="prompt")


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
    try:
        constraint = parse_constraint(body.response_format, body.structured_outputs)
    except GrammarError as e:
        raise bad_request(e.message, e.param or "response_format") from None
    prompts = [tok.encode(p) if isinstance(p, str) else list(p) for p in body.prompts]
    jobs = _jobs(prompts, sampling(body), constraint, tok, facts, adapter, COMPLETION, False)
    return Plan(jobs, constraint)


def _jobs(
    prompts: list[list[int]],
    s: Sampling,
    constraint: ConstraintSpec | None,
    tok: GatewayTokenizer,
    facts: EngineFacts,
    adapter: str | None,
    spelling: Spelling,
    chat: bool,
) -> list[Job]:
    """One job per prompt and choice, each validated by the engine; its refusal is a 400
    naming the field as the front end spells it. A chat reply from a reasoning model reasons
    first (`chat`); a raw completion is all answer."""
    bias = _logit_bias(s.logit_bias, tok.vocab_size)
    jobs = []
    for p, ids in enumerate(prompts):
        for j in range(s.n):
            try:
                params = _params(s, len(ids), bias, facts, adapter, j, constraint, chat)
                facts.validate(ids, params)
            except InvalidRequestError as e:
                raise bad_request(e.message, spelling.param(e.param)) from None
            jobs.append(Job(p * s.n + j, p, ids, params))
    return jobs


def _params(
    s: Sampling,
    prompt_len: int,
    bias: dict[int, float],
    facts: EngineFacts,
    adapter: str | None,
    choice: int,
    constraint: ConstraintSpec | None,
    chat: bool,
) -> SamplingParams:
    max_tokens = s.max_tokens
    if max_tokens is None:  # what is left of the context, capped by the config
        max_tokens = max(1, facts.max_model_len - prompt_len)
        if facts.default_max_tokens is not None:
            max_tokens = min(max_tokens, facts.default_max_tokens)
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=s.min_tokens,
        temperature=1.0 if s.temperature is None else s.temperature,
        top_p=1.0 if s.top_p is None else s.top_p,
        top_k=-1 if s.top_k in (None, 0) else s.top_k,
        min_p=s.min_p or 0.0,
        # n > 1 with a seed: distinct but reproducible choices.
        seed=None if s.seed is None else s.seed + choice,
        stop=list(s.stop),
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        speculative=s.speculative,
        logprobs=s.logprobs,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty or 1.0,
        logit_bias=bias,
        constraint=constraint,  # parsed once per request, shared by its choices
        adapter=adapter,
        reasoning=chat,
        max_reasoning_tokens=s.max_reasoning_tokens if chat else None,
    )


def _logit_bias(raw: Mapping[str, float], vocab_size: int) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in raw.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias key {clip(key)!r} is not a token id",
                              "logit_bias") from None
        if not 0 <= token < vocab_size:
            raise bad_request(f"logit_bias token id {token} is out of range", "logit_bias")
        out[token] = value
    return out
