"""Tool calling at the edge: validate `tools` / `tool_choice` / tool histories (400s naming the
problem) and render tool conversations for the chat template. The planner (gateway/openai/params.py)
resolves the tools once and hands the result to both the constraint and the prompt.

Templates that speak a call format the grammar knows (Hermes `<tool_call>`: Qwen2.5, Hermes 2/3,
SmolLM3; Llama 3.1's JSON calls) get the tools and structured tool messages natively, and the
grammar enforces that format. Any other template (SmolLM2, Llama 2, ...) gets the generic
fallback: the tool list and the call format in the system message, assistant calls written out
as `<tool_call>` blocks, tool results as user messages wrapped in `<tool_response>`. The
fallback uses the Hermes format.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from gateway.errors import bad_request, clip
from gateway.openai.schemas import ChatCompletionRequest
from grammar.spec import GrammarError
from grammar.tool_parser import render_call
from grammar.tools import ToolChoice, parse_tools

FALLBACK_SYSTEM = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def resolve_tools(body: ChatCompletionRequest) -> ToolChoice | None:
    """The request's validated tools (None: none offered); a 400 naming the problem."""
    try:
        return parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    except GrammarError as e:
        raise bad_request(e.message, e.param or "tools") from None


def _chat_message_param(i: int) -> str:
    return f"messages[{i}]"


@dataclass(frozen=True)
class Spelling:
    """How a front end names, in its errors, what the planner checks (gateway/openai/params.py):
    the field that holds the prompt, message i of the conversation, the key of a tool
    message's call id, and the engine's sampling fields it calls otherwise. Chat completions'
    by default."""

    prompt: str = "messages"
    message: Callable[[int], str] = _chat_message_param
    call_id: str = "tool_call_id"
    renames: Mapping[str, str] = field(default_factory=dict)

    def param(self, name: str | None) -> str:
        """A parameter the engine or the template named (None or "prompt": the prompt)."""
        if name in (None, "prompt", "messages"):
            return self.prompt
        return self.renames.get(name, name)


def render_messages(
    conversation: list[dict[str, object]], choice: ToolChoice | None, native: bool,
    spelling: Spelling = Spelling(),
) -> tuple[list[dict[str, object]], list[dict[str, object]] | None]:
    """(messages, tools) for the chat template, from plain chat messages (role, text content,
    the tool fields, an assistant's `reasoning_content`). `choice`: the request's tools.
    `native`: the template renders tools and tool messages itself; else the fallback prompt
    above. Checks that every `tool` message answers a call of an earlier assistant message."""
    call_ids: set[str] = set()
    messages: list[dict[str, object]] = []
    for i, m in enumerate(conversation):
        role = "system" if m["role"] == "developer" else str(m["role"])
        text = str(m.get("content") or "")
        calls = _tool_calls(m.get("tool_calls"), spelling.message(i)) if role == "assistant" else []
        call_ids.update(c["id"] for c in calls)
        call_id = m.get("tool_call_id")
        if role == "tool":
            where = f"{spelling.message(i)}.{spelling.call_id}"
            if not isinstance(call_id, str):
                raise bad_request(f"a 'tool' message needs '{spelling.call_id}'", where)
            if call_id not in call_ids:
                raise bad_request(f"{spelling.call_id} {clip(call_id)!r} matches no tool call of "
                                  "an earlier assistant message", where)
        messages.append(_native(role, text, calls, call_id) if native
                        else _fallback(role, text, calls, messages))
        reasoning = m.get("reasoning_content")
        if role == "assistant" and isinstance(reasoning, str) and reasoning:
            messages[-1]["reasoning_content"] = reasoning  # a reasoning template may show it
    messages = [{k: v for k, v in m.items() if k != "_tool"} for m in messages]
    tools = [t.openai() for t in choice.tools] if choice and choice.mode != "none" else None
    if tools is None or native:
        return messages, tools
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    prompt = FALLBACK_SYSTEM.format(tools=listing)
    if messages and messages[0]["role"] == "system":
        messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{prompt}"}
    else:
        messages.insert(0, {"role": "system", "content": prompt})
    return messages, None


def _tool_calls(calls: object, where: str) -> list[dict[str, str]]:
    """An assistant message's calls as {id, name, arguments}; a 400 when malformed (`where`:
    the message's parameter)."""
    out = []
    for j, c in enumerate(calls if isinstance(calls, list) else []):
        p = f"{where}.tool_calls[{j}]"
        call_id = c.get("id") if isinstance(c, dict) else None
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(call_id, str) or not isinstance(fn, dict):
            raise bad_request(f"{p} must have an 'id' string and a 'function' object", p)
        name, args = fn.get("name"), fn.get("arguments", "{}")
        if not isinstance(name, str) or not isinstance(args, str):
            raise bad_request(f"{p}.function needs 'name' and 'arguments' strings", p)
        out.append({"id": call_id, "name": name, "arguments": args})
    return out


def _native(
    role: str, text: str, calls: list[dict[str, str]], call_id: object
) -> dict[str, object]:
    msg: dict[str, object] = {"role": role, "content": text}
    if calls:
        msg["tool_calls"] = [
            {"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": _loads(c["arguments"])}}
            for c in calls
        ]
    if role == "tool":
        msg["tool_call_id"] = call_id
    return msg


def _fallback(
    role: str, text: str, calls: list[dict[str, str]], before: list[dict[str, object]]
) -> dict[str, object]:
    if calls:
        blocks = "\n".join(render_call(c["name"], c["arguments"]) for c in calls)
        return {"role": "assistant", "content": f"{text}\n{blocks}" if text else blocks}
    if role == "tool":
        block = f"<tool_response>\n{text}\n</tool_response>"
        prev = before[-1] if before else None
        if prev is not None and prev.get("_tool"):  # consecutive results: one user turn
            before.pop()
            block = f"{prev['content']}\n{block}"
        return {"role": "user", "content": block, "_tool": True}
    return {"role": role, "content": text}


def _loads(args: str) -> object:
    try:
        return json.loads(args)
    except json.JSONDecodeError:
        return args
