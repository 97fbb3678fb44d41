"""A Messages request as the chat completion that generates its reply.

The chat planner (gateway/openai/params.py) then does what it does for every front end: the
bounds, the tools and their constraint, the chat template, the tokens and `SamplingParams`.
Anthropic's turns map onto chat messages one block kind at a time:

    system (string or text blocks)      -> a system message
    user text blocks                    -> a user message
    user tool_result blocks             -> one tool message each (`is_error`: "Error: " first)
    a system turn (text)                -> a system message, where it is
    assistant text / tool_use blocks    -> an assistant message with its tool calls
    assistant thinking blocks           -> its `reasoning_content` (a reasoning template shows it)
    an assistant turn last (a prefill)  -> `continue_final_message`: the reply continues it

and `tools` / `tool_choice` / `thinking` / `stop_sequences` onto their chat counterparts.
Errors the chat planner raises name chat parameters; `anthropic_param` spells them back.
"""

from __future__ import annotations

import json
import re

from pydantic import ValidationError

from gateway.access.bounds import check_history
from gateway.errors import APIError, bad_request, from_pydantic
from gateway.messages.schemas import (
    CountTokensRequest,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from gateway.openai.schemas import ChatCompletionRequest

# Switchboard's engine extensions a Messages request may carry too, as the chat API takes them.
PASSED_EXTRAS = ("seed", "ignore_eos", "min_tokens", "min_p", "repetition_penalty",
                 "speculative", "chat_template_kwargs")
CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def to_chat(body: CountTokensRequest, max_tokens: int = 1) -> tuple[ChatCompletionRequest,
                                                                   list[str]]:
    """(the chat completion generating `body`'s reply, where each of its messages came from:
    "system" or "messages[i]"). `max_tokens`: a count_tokens body has none. Errors name the
    Messages parameters."""
    messages: list[dict[str, object]] = []
    where: list[str] = []
    if body.system_text():
        messages.append({"role": "system", "content": body.system_text()})
        where.append("system")
    for i, m in enumerate(body.messages):
        if m.role == "assistant":
            turn = _assistant(m.content, i)
        else:
            turn = _user(m.content, i, m.role)
        messages += turn
        where += [f"messages[{i}]"] * len(turn)
    check_history(len(messages))  # tool results made more messages than were counted
    chat: dict[str, object] = {"model": body.model, "messages": messages, "max_tokens": max_tokens}
    last = messages[-1]
    if last["role"] == "assistant" and last["content"] and not last.get("tool_calls"):
        chat["continue_final_message"] = True  # a prefill: the reply continues it
    thinking = body.thinking is not None and body.thinking.on
    budget = body.thinking.budget_tokens if body.thinking is not None and thinking else None
    config = body.output_config
    if budget is not None:
        chat["max_reasoning_tokens"] = budget
    elif config is not None and config.effort not in (None, "max"):
        chat["reasoning_effort"] = config.effort
    if config is not None and config.format is not None:
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": config.format.schema_}}
    # Anthropic's models think only when asked: so do templates that can be told (Qwen3's).
    kwargs: dict[str, object] = {"enable_thinking": thinking}
    if isinstance(body, MessagesRequest):
        chat.update(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                    stop=body.stop_sequences,
                    user=body.metadata.user_id if body.metadata else None)
    extra = body.model_extra or {}
    for key in PASSED_EXTRAS:
        if key in extra:
            chat[key] = extra[key]
    given = chat.get("chat_template_kwargs")
    if isinstance(given, dict):
        kwargs.update(given)
    chat["chat_template_kwargs"] = kwargs
    if body.tools is not None:
        chat["tools"] = [{"type": "function", "function": {
            "name": t.name, "parameters": t.input_schema,
            **({"description": t.description} if t.description is not None else {})}}
            for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if choice.name is None:
                raise bad_request("tool_choice of type 'tool' needs 'name'", "tool_choice.name")
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            chat["tool_choice"] = CHOICES[choice.type]
        if choice.disable_parallel_tool_use is not None:
            chat["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    try:
        return ChatCompletionRequest.model_validate(chat), where
    except ValidationError as e:
        raise renamed(from_pydantic(e), where) from None


def _user(content: object, i: int, role: str) -> list[dict[str, object]]:
    """A user turn's messages (a system one's: text only)."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    assert isinstance(content, list)
    out: list[dict[str, object]] = []
    text: list[str] = []
    for j, block in enumerate(content):
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolResultBlock) and role == "user":
            if text:
                out.append({"role": "user", "content": "".join(text)})
                text = []
            result = block.text()
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": f"Error: {result}" if block.is_error else result})
        elif not isinstance(block, ThinkingBlock):  # thinking a client echoed: nothing to say
            raise bad_request(f"a {role} message may not hold a '{block.type}' block",
                              f"messages[{i}].content[{j}].type")
    if text or not out:
        out.append({"role": role, "content": "".join(text)})
    return out


def _assistant(content: object, i: int) -> list[dict[str, object]]:
    if isinstance(content, str):
        return [{"role": "assistant", "content": content}]
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
    return [msg]


# chat parameter -> Messages parameter (prefixes)
RENAMES = (("max_reasoning_tokens", "thinking.budget_tokens"),
           ("response_format.json_schema.schema", "output_config.format.schema"),
           ("response_format", "output_config.format"),
           ("max_completion_tokens", "max_tokens"), ("stop", "stop_sequences"),
           ("parallel_tool_calls", "tool_choice.disable_parallel_tool_use"))


def anthropic_param(param: str | None, where: list[str]) -> str | None:
    """A chat-completions parameter as the Messages request spells it (`where`: `to_chat`'s,
    the Messages parameter each chat message came from)."""
    if param is None:
        return None
    m = re.match(r"messages\[(\d+)\](.*)", param)
    if m is not None:
        i = int(m.group(1))
        return where[i] if i < len(where) else "messages"
    m = re.match(r"tools\[(\d+)\]\.function\.(\w+)(.*)", param)
    if m is not None:
        field = "input_schema" if m.group(2) == "parameters" else m.group(2)
        return f"tools[{m.group(1)}].{field}{m.group(3)}"
    for chat, ours in RENAMES:
        if param.startswith(chat):
            return ours + param[len(chat):]
    return param


def renamed(e: APIError, where: list[str]) -> APIError:
    """`e` naming the Messages parameter instead of the chat one, in its `param` and message."""
    param = anthropic_param(e.param, where)
    if e.param and param != e.param:
        e.message = e.message.replace(f"'{e.param}'", f"'{param}'")
        e.param = param
    return e
