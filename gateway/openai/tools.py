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

from gateway.errors import bad_request, clip
from gateway.openai.schemas import ChatCompletionRequest, ChatMessage
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


def render_messages(
    body: ChatCompletionRequest, choice: ToolChoice | None, native: bool
) -> tuple[list[dict[str, object]], list[dict[str, object]] | None]:
    """(messages, tools) for the chat template. `choice`: the body's tools (`resolve_tools`).
    `native`: the template renders tools and tool messages itself; else the fallback prompt
    above. Checks that every `tool` message answers a call of an earlier assistant message."""
    call_ids: set[str] = set()
    messages: list[dict[str, object]] = []
    for i, m in enumerate(body.messages):
        role = "system" if m.role == "developer" else m.role
        calls = _tool_calls(m, i) if role == "assistant" else []
        call_ids.update(c["id"] for c in calls)
        if role == "tool":
            if m.tool_call_id is None:
                raise bad_request("a 'tool' message needs 'tool_call_id'",
                                  f"messages[{i}].tool_call_id")
            if m.tool_call_id not in call_ids:
                raise bad_request(f"tool_call_id {clip(m.tool_call_id)!r} matches no tool call of "
                                  "an earlier assistant message", f"messages[{i}].tool_call_id")
        messages.append(_native(role, m.text(), calls, m.tool_call_id) if native
                        else _fallback(role, m.text(), calls, messages))
        reasoning = (m.model_extra or {}).get("reasoning_content")
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


def _tool_calls(m: ChatMessage, i: int) -> list[dict[str, str]]:
    """An assistant message's calls as {id, name, arguments}; a 400 when malformed."""
    out = []
    for j, c in enumerate(m.tool_calls or []):
        p = f"messages[{i}].tool_calls[{j}]"
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
    role: str, text: str, calls: list[dict[str, str]], call_id: str | None
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
