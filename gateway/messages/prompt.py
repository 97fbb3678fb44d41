"""A Messages request as the planner's input (gateway/openai/params.py's `ChatInput`).

The planner then does what it does for every front end: the prompt's bounds, the constraint,
the chat template, the tokens and `SamplingParams`. Anthropic's turns map onto chat messages
one block kind at a time:

    system (string or text blocks)      -> a system message
    user text blocks                    -> a user message
    user tool_result blocks             -> one tool message each (`is_error`: "Error: " first)
    a system turn (text)                -> a system message, where it is
    assistant text / tool_use blocks    -> an assistant message with its tool calls
    assistant thinking blocks           -> its `reasoning_content` (a reasoning template shows it)
    an assistant turn last (a prefill)  -> `continue_final`: the reply continues it

and `tools` / `tool_choice` / `thinking` / `output_config` / `stop_sequences` are read here,
so every error names the Messages parameter.
"""

from __future__ import annotations

import json
from dataclasses import replace

from gateway.access.bounds import check_history, check_schema_fields
from gateway.errors import bad_request
from gateway.messages.schemas import (
    CountTokensRequest,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from gateway.openai.params import ChatInput, Sampling, template_kwargs
from gateway.openai.schemas import reasoning_budget
from gateway.openai.tools import Spelling
from grammar.spec import ConstraintSpec, GrammarError, parse_json_schema
from grammar.tools import ToolChoice, parse_tools

CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def to_input(body: CountTokensRequest, max_tokens: int = 1) -> ChatInput:
    """The planner's input for `body`'s reply. `max_tokens`: a count_tokens body has none."""
    messages, where = _conversation(body)
    last = messages[-1]
    prefill = last["role"] == "assistant" and bool(last["content"]) and not last.get("tool_calls")
    tools, output = _tools_and_format(body)
    thinking = body.thinking is not None and body.thinking.on
    # Anthropic's models think only when asked: so do templates that can be told (Qwen3's).
    kwargs = template_kwargs({"enable_thinking": thinking, **(body.chat_template_kwargs or {})},
                             None)
    spelling = Spelling(message=lambda i: where[i] if i < len(where) else "messages",
                        call_id="tool_use_id",
                        renames={"max_reasoning_tokens": "thinking.budget_tokens",
                                 "stop": "stop_sequences"})
    return ChatInput(messages, _sampling(body, max_tokens, thinking), tools, output,
                     "output_config.format", kwargs, prefill, spelling)


def _conversation(body: CountTokensRequest) -> tuple[list[dict[str, object]], list[str]]:
    """(the chat messages, the Messages parameter each came from)."""
    messages: list[dict[str, object]] = []
    where: list[str] = []
    if body.system_text():
        messages.append({"role": "system", "content": body.system_text()})
        where.append("system")
    for i, m in enumerate(body.messages):
        turn = _assistant(m.content, i) if m.role == "assistant" else _user(m.content, i, m.role)
        messages += [msg for msg, _ in turn]
        where += [w for _, w in turn]
    check_history(len(messages))  # tool results made more messages than were counted
    return messages, where


def _sampling(body: CountTokensRequest, max_tokens: int, thinking: bool) -> Sampling:
    """The reply's sampling: `thinking.budget_tokens` when thinking is on, else the budget of
    `output_config.effort` ("max": unbounded)."""
    budget = body.thinking.budget_tokens if body.thinking is not None and thinking else None
    config = body.output_config
    effort = config.effort if config is not None and config.effort != "max" else None
    sampling = Sampling(max_tokens=max_tokens,
                        max_reasoning_tokens=budget or reasoning_budget(None, effort),
                        seed=body.seed, ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
                        min_p=body.min_p, repetition_penalty=body.repetition_penalty,
                        speculative=body.speculative)
    if not isinstance(body, MessagesRequest):  # count_tokens: the prompt only
        return sampling
    return replace(sampling, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                   stop=tuple(body.stop_sequences or ()))


def _tools_and_format(body: CountTokensRequest) -> tuple[ToolChoice | None,
                                                          ConstraintSpec | None]:
    """`tools` / `tool_choice` and `output_config.format`, their sizes checked first; errors
    name the Messages fields (a tool's schema is its `input_schema`)."""
    fmt = body.output_config.format if body.output_config is not None else None
    schema = fmt.schema_ if fmt is not None else None
    tools = [{"type": "function", "name": t.name, "input_schema": t.input_schema,
              **({"description": t.description} if t.description is not None else {})}
             for t in body.tools or []]
    schemas = [(f"tools[{i}].input_schema", t["input_schema"]) for i, t in enumerate(tools)]
    check_schema_fields({"tools": tools or None, "output_config.format": schema},
                        [*schemas, ("output_config.format.schema", schema)])
    choice, parallel = _tool_choice(body)
    try:
        return (parse_tools(tools or None, choice, parallel, flat=True, schema_key="input_schema"),
                None if fmt is None else parse_json_schema(schema, "output_config.format.schema",
                                                           "output"))
    except GrammarError as e:
        raise bad_request(e.message, e.param or "tools") from None


def _tool_choice(body: CountTokensRequest) -> tuple[object, bool | None]:
    """(`tool_choice` as chat completions spell it, parallel tool calls)."""
    choice = body.tool_choice
    if choice is None:
        return None, None
    parallel = (None if choice.disable_parallel_tool_use is None
                else not choice.disable_parallel_tool_use)
    if choice.type != "tool":
        return CHOICES[choice.type], parallel
    if choice.name is None:
        raise bad_request("tool_choice of type 'tool' needs 'name'", "tool_choice.name")
    return {"type": "function", "function": {"name": choice.name}}, parallel


Turn = list[tuple[dict[str, object], str]]  # (chat message, the Messages parameter it is)


def _user(content: object, i: int, role: str) -> Turn:
    """A user turn's messages (a system one's: text only)."""
    p = f"messages[{i}]"
    if isinstance(content, str):
        return [({"role": role, "content": content}, p)]
    assert isinstance(content, list)
    out: Turn = []
    text: list[str] = []
    for j, block in enumerate(content):
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolResultBlock) and role == "user":
            if text:
                out.append(({"role": "user", "content": "".join(text)}, p))
                text = []
            result = block.text()
            out.append(({"role": "tool", "tool_call_id": block.tool_use_id,
                         "content": f"Error: {result}" if block.is_error else result},
                        f"{p}.content[{j}]"))
        elif not isinstance(block, ThinkingBlock):  # thinking a client echoed: nothing to say
            raise bad_request(f"a {role} message may not hold a '{block.type}' block",
                              f"messages[{i}].content[{j}].type")
    if text or not out:
        out.append(({"role": role, "content": "".join(text)}, p))
    return out


def _assistant(content: object, i: int) -> Turn:
    if isinstance(content, str):
        return [({"role": "assistant", "content": content}, f"messages[{i}]")]
    assert isinstance(content, list)
    text, thoughts, calls = [], [], []
    for j, block in enumerate(content):
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thoughts.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, ToolResultBlock):
            raise bad_request("an assistant message may not hold a 'tool_result' block",
                              f"messages[{i}].content[{j}].type")
    msg: dict[str, object] = {"role": "assistant", "content": "".join(text)}
    if calls:
        msg["tool_calls"] = calls
    if thoughts:
        msg["reasoning_content"] = "".join(thoughts)
    return [(msg, f"messages[{i}]")]


