"""The Responses API's request body and its items, translated to and from chat messages.

A Responses `input` is a list of items: `message` (text parts), `function_call` and
`function_call_output`. Sessions store chat messages, so items become messages at the edge
and messages become items again for `input_items` and conversation listings:

    message (user / system / developer)   -> {"role", "content"}
    message (assistant) + function_calls  -> one {"role": "assistant", "content", "tool_calls"}
    function_call_output                  -> {"role": "tool", "content", "tool_call_id"}

Each stored message keeps its item ids (`id` on the message, `item_id` on each call), so an
item lists with the id it was given. `responses_input` states a request (its history
prepended) as the `ChatInput` that gateway/openai/params.py plans for every front end: the tools,
`text.format` and the sampling fields read here, so that errors name the Responses fields.
"""

from __future__ import annotations

import uuid
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from gateway.access.bounds import check_history, check_schema_fields
from gateway.errors import bad_request, clip
from gateway.openai.params import ChatInput, Sampling, template_kwargs
from gateway.openai.schemas import OPEN, reasoning_budget
from gateway.openai.tools import Spelling
from gateway.sessions.store import Message
from grammar.spec import GrammarError, parse_text_format
from grammar.tools import parse_tools

Item = dict[str, object]
RESPONSE_ID_HEADER = "x-switchboard-response-id"  # the router records the replica it names


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


TEXT: dict[str, object] = {"type": "text"}  # the default `text.format`
_JSON_KINDS = {str: "a string", list: "an array", bool: "a boolean", int: "a number",
               float: "a number", type(None): "null"}


class TextOptions(BaseModel):
    """`text`: the output's `format`, an object `{"type": "text" | "json_object" |
    "json_schema", ...}` (read by grammar/spec.py's `parse_text_format`)."""

    model_config = OPEN

    format: dict[str, object] = Field(default_factory=lambda: dict(TEXT))

    @field_validator("format", mode="before")
    @classmethod
    def _an_object(cls, v: object) -> object:
        if not isinstance(v, dict):
            got = _JSON_KINDS.get(type(v), type(v).__name__)
            raise ValueError(f'must be an object such as {{"type": "json_object"}}, not {got}')
        return v


class ReasoningOptions(BaseModel):
    """`reasoning`: `effort` bounds a reasoning model's thinking (the chat API's
    `reasoning_effort`); `summary` is accepted and ignored (the reasoning comes whole)."""

    model_config = OPEN

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None


class ResponsesRequest(BaseModel):
    """`POST /v1/responses`. Unknown fields are kept and ignored, as for chat completions."""

    model_config = OPEN

    model: str
    # At most MAX_MESSAGES items: counted as the body is read (gateway/access/bounds.py).
    input: str | list[Item] = Field(default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, object] | None = None
    store: bool = True
    tools: list[dict[str, object]] | None = None
    tool_choice: str | dict[str, object] | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    # Switchboard's extensions, as chat completions take them (reasoning models).
    max_reasoning_tokens: int | None = Field(None, ge=1)
    chat_template_kwargs: dict[str, object] | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    metadata: dict[str, str] | None = None
    user: str | None = None
    stream: bool = False

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        check_metadata(v)
        return v

    @property
    def conversation_id(self) -> str | None:
        c = self.conversation
        if isinstance(c, dict):
            cid = c.get("id")
            if not isinstance(cid, str):
                raise bad_request("conversation must be an id or {\"id\": ...}", "conversation")
            return cid
        return c

    @property
    def text_format(self) -> dict[str, object]:
        return self.text.format if self.text is not None else dict(TEXT)


def check_metadata(v: dict[str, str] | None) -> None:
    """OpenAI's bounds: 16 pairs, keys up to 64 characters, values up to 512."""
    if v is None:
        return
    if len(v) > 16:
        raise ValueError("at most 16 metadata pairs")
    if any(len(k) > 64 or len(val) > 512 for k, val in v.items()):
        raise ValueError("metadata keys are at most 64 characters, values at most 512")


# -- items -> messages ------------------------------------------------------------------


def input_messages(
    value: str | list[Item], param: str = "input", origins: list[int] | None = None
) -> list[Message]:
    """The items as chat messages, each with its item ids (new ones where the client gave
    none). A 400 naming the item for a type or content part that is not supported. With
    `origins`, the index of the item each message came from is appended to it."""
    if isinstance(value, str):
        if origins is not None:
            origins.append(0)
        return [{"role": "user", "content": value, "id": new_id("msg")}]
    out: list[Message] = []
    for i, item in enumerate(value):
        if origins is not None:  # the messages the item before made
            origins += [i - 1] * (len(out) - len(origins))
        p = f"{param}[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        item_id = item.get("id")
        if item_id is not None and not isinstance(item_id, str):
            raise bad_request(f"'{p}.id' must be a string", f"{p}.id")
        if kind == "message":
            out.append(_message(item, p, item_id))
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", p), "type": "function",
                    "function": {"name": _string(item, "name", p),
                                 "arguments": _string(item, "arguments", p)},
                    "item_id": item_id or new_id("fc")}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last["tool_calls"] = [*_calls(last), call]
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call],
                            "id": new_id("msg")})
        elif kind == "reasoning":
            continue  # an earlier turn's reasoning, sent back: the history keeps answers only
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _parts(output, f"{p}.output",
                                                                 ("input_text", "output_text"))
            out.append({"role": "tool", "content": text,
                        "tool_call_id": _string(item, "call_id", p),
                        "id": item_id or new_id("fco")})
        else:
            raise bad_request(f"Input items of type {clip(repr(kind))} are not supported; use "
                              "'message', 'function_call' or 'function_call_output'.", f"{p}.type",
                              code="unsupported_item_type")
    if origins is not None:
        origins += [len(value) - 1] * (len(out) - len(origins))
    return out


def _message(item: Item, p: str, item_id: object) -> Message:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise bad_request(f"'{p}.role' must be one of 'user', 'system', 'developer', "
                          "'assistant'", f"{p}.role")
    content = item.get("content")
    allowed = ("output_text", "input_text", "refusal") if role == "assistant" else ("input_text",)
    text = content if isinstance(content, str) else _parts(content, f"{p}.content", allowed)
    return {"role": role, "content": text, "id": item_id or new_id("msg")}


def _parts(content: object, p: str, allowed: tuple[str, ...]) -> str:
    if not isinstance(content, list):
        raise bad_request(f"'{p}' must be a string or a list of content parts", p)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed:
            raise bad_request(f"Content parts of type {clip(repr(kind))} are not supported here; "
                              f"use {' or '.join(repr(a) for a in allowed)}.", f"{p}[{j}].type",
                              code="unsupported_content_type")
        field = "refusal" if kind == "refusal" else "text"
        text = part.get(field) if isinstance(part, dict) else None
        if not isinstance(text, str):
            raise bad_request(f"'{p}[{j}].{field}' must be a string", f"{p}[{j}].{field}")
        texts.append(text)
    return "".join(texts)


def _string(item: Item, key: str, p: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"Missing or invalid '{p}.{key}': expected a string.", f"{p}.{key}")
    return value


def _calls(m: Message) -> list[dict[str, object]]:
    calls = m.get("tool_calls")
    return [c for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []


# -- messages -> items ------------------------------------------------------------------


def message_items(messages: list[Message]) -> list[Item]:
    """Stored messages as Responses items (what `input_items` and conversations list)."""
    items: list[Item] = []
    for m in messages:
        role, text, mid = m.get("role"), str(m.get("content") or ""), str(m.get("id") or "")
        if role == "tool":
            items.append({"id": mid, "type": "function_call_output",
                          "call_id": m.get("tool_call_id"), "output": text,
                          "status": "completed"})
            continue
        if role != "assistant":
            items.append({"id": mid, "type": "message", "role": role, "status": "completed",
                          "content": [{"type": "input_text", "text": text}]})
            continue
        if text:
            items.append(output_message(mid, text, "completed"))
        for c in _calls(m):
            fn = c.get("function")
            fn = fn if isinstance(fn, dict) else {}
            items.append(function_call(str(c.get("item_id") or ""), str(c.get("id")),
                                       str(fn.get("name")), str(fn.get("arguments")),
                                       "completed"))
    return items


def output_message(item_id: str, text: str, status: str) -> Item:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [output_text(text)]}


def output_text(text: str) -> Item:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(item_id: str, text: str, status: str) -> Item:
    """A reasoning model's thinking (engine/core/reasoning.py) as a Responses `reasoning` item."""
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def function_call(item_id: str, call_id: str, name: str, arguments: str, status: str) -> Item:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def reply_message(output: list[Item]) -> Message:
    """The assistant message a response's output items are, for the session's history."""
    text = ""
    for item in output:
        parts = item.get("content") if item["type"] == "message" else None
        for part in parts if isinstance(parts, list) else []:
            text += str(part.get("text", ""))
    msg_ids = [item["id"] for item in output if item["type"] == "message"]
    message: Message = {"role": "assistant", "content": text,
                        "id": msg_ids[0] if msg_ids else new_id("msg")}
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]},
              "item_id": item["id"]} for item in output if item["type"] == "function_call"]
    if calls:
        message["tool_calls"] = calls
    return message


# -- the chat request this response is planned as -------------------------------------------


def responses_input(body: ResponsesRequest, history: list[Message], new: list[Message],
                    origins: list[int]) -> ChatInput:
    """The planner's input for `body`'s reply: the conversation is `instructions` (a system
    message), the chain's `history`, then this request's `new` messages (`input_messages`',
    with the `origins` it gave). Tools, `text.format` and the sampling fields are read here,
    so every error names the Responses parameter."""
    head: list[Message] = ([{"role": "system", "content": body.instructions}]
                           if body.instructions else [])
    messages = [*head, *history, *new]
    if not messages:
        raise bad_request("Missing required parameter: 'input'.", "input")
    check_history(len(messages), "input")  # `input` was counted as it was read
    tools, fmt = body.tools or [], body.text_format
    schemas = [(f"tools[{i}].parameters", t.get("parameters")) for i, t in enumerate(tools)]
    check_schema_fields({"tools": body.tools, "text.format": fmt},
                        [*schemas, ("text.format.schema", fmt.get("schema"))])
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(f"Tools of type {clip(repr(tool.get('type')))} are not supported; "
                              "only 'function' tools are.", f"tools[{i}].type")
    effort = body.reasoning.effort if body.reasoning else None
    try:
        choice = parse_tools(body.tools, _chat_tool_choice(body.tool_choice),
                             body.parallel_tool_calls, flat=True)
        output_format = parse_text_format(fmt)
    except GrammarError as e:
        raise bad_request(e.message, e.param or "text.format") from None
    sampling = Sampling(max_tokens=body.max_output_tokens, temperature=body.temperature,
                        top_p=body.top_p,
                        max_reasoning_tokens=reasoning_budget(body.max_reasoning_tokens, effort))
    return ChatInput(messages, sampling, choice, output_format, "text.format",
                     template_kwargs(body.chat_template_kwargs, effort),
                     spelling=_spelling(len(head) + len(history), origins))


def _spelling(offset: int, origins: list[int]) -> Spelling:
    """Message i of the conversation is input item `origins[i - offset]`; the ones before
    (instructions, history) are `input` as a whole."""
    def message(i: int) -> str:
        k = i - offset
        return f"input[{origins[k]}]" if 0 <= k < len(origins) else "input"
    return Spelling(prompt="input", message=message, call_id="call_id",
                    renames={"max_tokens": "max_output_tokens"})


def _chat_tool_choice(choice: str | dict[str, object] | None) -> str | dict[str, object] | None:
    """`tool_choice` as chat completions spell it (`parse_tools` reads that)."""
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("tool_choice must be 'none', 'auto', 'required' or "
                      "{\"type\": \"function\", \"name\": ...}", "tool_choice")
