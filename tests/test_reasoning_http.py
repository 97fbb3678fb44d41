"""Reasoning models over HTTP: `switchboard serve` on the tiny random Qwen3 reasoner
(tests/tiny_models.py) and the real `openai` SDK.

`message.reasoning_content` / `delta.reasoning_content` carry the reasoning, `usage` counts it,
`chat_template_kwargs` reach the template, and every constraint (response_format, tools in
each mode, streamed or not, in a session) applies after the reasoning and validates.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from openai import OpenAI

from gateway.openai.schemas import REASONING_EFFORT
from tests.conftest import GatewayServer, serve
from tests.test_reasoning import ASK, SCHEMA, TOOLS
from tests.tiny_models import save_tiny_reasoner

SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
RF = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    tmp = tmp_path_factory.mktemp("reasoning-http")
    with serve(tmp, model=save_tiny_reasoner(tmp / "qwen3-reasoner")) as server:
        yield server


@pytest.fixture(scope="module")
def client(server: GatewayServer) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0, timeout=300)


def _chat(client: OpenAI, server: GatewayServer, budget: int | None = 6, **kw: Any):
    extra = {**kw.pop("extra_body", {})}
    if budget is not None:
        extra["max_reasoning_tokens"] = budget
    kw = {"model": server.model, "messages": ASK, "temperature": 0, "max_tokens": 120,
          "extra_body": extra, **kw}
    return client.chat.completions.create(**kw)


def _stream(client: OpenAI, server: GatewayServer, **kw: Any) -> dict[str, Any]:
    """A streamed reply, reassembled: reasoning, content, calls, finish and usage."""
    out: dict[str, Any] = {"reasoning": "", "content": "", "calls": {}, "finish": None,
                           "usage": None}
    for chunk in _chat(client, server, stream=True, stream_options={"include_usage": True},
                       **kw):
        if chunk.usage is not None:
            out["usage"] = chunk.usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        out["reasoning"] += (delta.model_extra or {}).get("reasoning_content") or ""
        if delta.content:
            assert not out["calls"] or kw.get("tool_choice") == "auto"
            out["content"] += delta.content
        for tc in delta.tool_calls or []:
            assert out["reasoning"], "a call's first delta comes after the reasoning"
            call = out["calls"].setdefault(tc.index, {"name": tc.function.name, "arguments": ""})
            call["arguments"] += tc.function.arguments or ""
        out["finish"] = chunk.choices[0].finish_reason or out["finish"]
    return out


def _reasoning_of(message: Any) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


def _valid_calls(calls: list[dict[str, str]], allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call["name"] in allowed
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_reasoning_is_apart_from_the_answer(client: OpenAI, server: GatewayServer) -> None:
    r = _chat(client, server, max_tokens=16, extra_body={"ignore_eos": True})
    message = r.choices[0].message
    assert _reasoning_of(message) and message.content
    assert "<think>" not in message.content and "</think>" not in message.content
    assert r.usage.completion_tokens_details.reasoning_tokens == 6
    assert r.usage.completion_tokens == 16

    s = _stream(client, server, max_tokens=16, extra_body={"ignore_eos": True})
    assert s["reasoning"] == _reasoning_of(message) and s["content"] == message.content
    assert s["usage"].completion_tokens_details.reasoning_tokens == 6


def test_enable_thinking_false_reaches_the_template(client: OpenAI, server: GatewayServer) -> None:
    r = _chat(client, server, budget=None, max_tokens=8,
              extra_body={"ignore_eos": True,
                          "chat_template_kwargs": {"enable_thinking": False}})
    assert _reasoning_of(r.choices[0].message) is None and r.choices[0].message.content
    assert r.usage.completion_tokens_details is None  # no reasoning: nothing to detail


def test_reserved_template_kwargs_are_refused(server: GatewayServer) -> None:
    r = httpx.post(f"{server.base_url}/chat/completions",
                   headers={"Authorization": f"Bearer {server.api_key}"},
                   json={"model": server.model, "messages": ASK,
                         "chat_template_kwargs": {"tokenize": True}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_json_schema_after_reasoning(client: OpenAI, server: GatewayServer) -> None:
    r = _chat(client, server, response_format=RF, extra_body={"logit_bias": {"2": 30}})
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and _reasoning_of(message)
    jsonschema.validate(json.loads(message.content), SCHEMA)
    s = _stream(client, server, response_format=RF, extra_body={"logit_bias": {"2": 30}})
    assert (s["reasoning"], s["content"]) == (_reasoning_of(message), message.content)


@pytest.mark.parametrize("tool_choice", ["required", "named", "auto"])
def test_tool_calls_after_reasoning(client: OpenAI, server: GatewayServer, tool_choice) -> None:
    # get_weather's arguments are bounded (add's integers may run on at temperature 0)
    choice: Any = ({"type": "function", "function": {"name": "get_weather"}}
                   if tool_choice == "named" else tool_choice)
    kw = {"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": False}
    r = _chat(client, server, **kw)
    c = r.choices[0]
    assert _reasoning_of(c.message)
    calls = [{"name": t.function.name, "arguments": t.function.arguments}
             for t in c.message.tool_calls or []]
    if tool_choice != "auto":
        assert c.finish_reason == "tool_calls" and c.message.content is None
        _valid_calls(calls, {"get_weather"} if tool_choice == "named" else set(SCHEMAS))
    s = _stream(client, server, **kw)
    assert s["reasoning"] == _reasoning_of(c.message) and s["finish"] == c.finish_reason
    assert [s["calls"][i] for i in sorted(s["calls"])] == calls
    assert (s["content"] or None) == c.message.content


def test_session_turns_reason_then_call(client: OpenAI, server: GatewayServer) -> None:
    headers = {"Authorization": f"Bearer {server.api_key}"}
    r = httpx.post(f"{server.base_url}/sessions", headers=headers, json={"model": server.model},
                   timeout=60)
    assert r.status_code == 200, r.text
    sid = r.json()["id"]
    first = _chat(client, server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                  extra_body={"session_id": sid}).choices[0]
    assert first.finish_reason == "tool_calls" and _reasoning_of(first.message)
    call = first.message.tool_calls[0]
    _valid_calls([{"name": call.function.name, "arguments": call.function.arguments}],
                 set(SCHEMAS))
    second = _chat(client, server, response_format=RF,
                   messages=[{"role": "tool", "tool_call_id": call.id, "content": "sunny"}],
                   extra_body={"session_id": sid, "logit_bias": {"2": 30}}).choices[0]
    assert second.finish_reason == "stop" and _reasoning_of(second.message)
    jsonschema.validate(json.loads(second.message.content), SCHEMA)
    history = httpx.get(f"{server.base_url}/sessions/{sid}", headers=headers,
                        timeout=60).json()["messages"]
    assert [m["role"] for m in history] == ["user", "assistant", "tool", "assistant"]
    assert history[1]["reasoning_content"] == _reasoning_of(first.message)


def test_responses_carry_a_reasoning_item(client: OpenAI, server: GatewayServer) -> None:
    """The Responses API: the reasoning is a `reasoning` item before the answer's message,
    streamed as reasoning_text events; sent back as input, it is accepted."""
    kw: dict[str, Any] = {"model": server.model, "input": "What is the weather in Paris?",
                          "max_output_tokens": 16, "temperature": 0,
                          "extra_body": {"max_reasoning_tokens": 6}}
    r = client.responses.create(**kw)
    kinds = [item.type for item in r.output]
    assert kinds[0] == "reasoning" and "message" in kinds, kinds
    reasoning = r.output[0].content[0].text
    assert reasoning and "</think>" not in r.output_text
    assert r.usage.output_tokens_details.reasoning_tokens == 6

    events = list(client.responses.create(**kw, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    done = [e for e in events if e.type == "response.reasoning_text.done"]
    assert deltas == reasoning and [e.text for e in done] == [reasoning]
    final = events[-1].response
    assert [i.type for i in final.output] == kinds and final.output_text == r.output_text

    again = client.responses.create(**{**kw, "input": [
        {"role": "user", "content": "What is the weather in Paris?"},
        *[item.model_dump(exclude_none=True) for item in r.output],
        {"role": "user", "content": "And in Rome?"}]})
    assert again.output[0].type == "reasoning"


# -- reasoning effort, and the Messages API's thinking blocks ------------------------------


def test_reasoning_effort_is_a_budget(client: OpenAI, server: GatewayServer) -> None:
    """`reasoning_effort` (chat) and `reasoning.effort` (Responses) bound the reasoning to the
    documented budget; "none" tells the template not to think."""
    budget = REASONING_EFFORT["minimal"]
    r = _chat(client, server, budget=None, max_tokens=budget + 8, reasoning_effort="minimal",
              extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens_details.reasoning_tokens == budget
    assert r.choices[0].message.content
    resp = client.responses.create(model=server.model, input="What is the weather in Paris?",
                                   max_output_tokens=budget + 8, temperature=0,
                                   reasoning={"effort": "minimal"},
                                   extra_body={"ignore_eos": True})
    assert resp.usage.output_tokens_details.reasoning_tokens == budget
    assert resp.reasoning.effort == "minimal"
    # Without a budget the tiny reasoner never ends its reasoning itself.
    runaway = _chat(client, server, budget=None, max_tokens=24, extra_body={"ignore_eos": True})
    assert runaway.usage.completion_tokens_details.reasoning_tokens == 24
    off = _chat(client, server, budget=None, max_tokens=8, reasoning_effort="none",
                extra_body={"ignore_eos": True})
    assert _reasoning_of(off.choices[0].message) is None and off.choices[0].message.content
    # An explicit max_reasoning_tokens is the budget, effort or not.
    both = _chat(client, server, budget=6, max_tokens=16, reasoning_effort="high",
                 extra_body={"ignore_eos": True})
    assert both.usage.completion_tokens_details.reasoning_tokens == 6


def _messages(server: GatewayServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=server.api_key, max_retries=0,
                               timeout=300)


def test_messages_thinking_blocks(server: GatewayServer) -> None:
    """`thinking` on the Messages API: a thinking block before the answer, within the budget;
    streamed as thinking_delta events the SDK assembles into the same message; none when
    thinking is not asked for."""
    c = _messages(server)
    kw: dict[str, Any] = {"model": server.model, "max_tokens": 16, "messages": ASK,
                          "thinking": {"type": "enabled", "budget_tokens": 6},
                          "extra_body": {"temperature": 0, "ignore_eos": True}}
    m = c.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking and "</think>" not in m.content[1].text
    assert m.usage.output_tokens == 16
    with c.messages.stream(**kw) as s:
        kinds = [e.delta.type for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in m.content]
    assert kinds[0] == "thinking_delta" and kinds[-1] == "text_delta"

    hidden = {**kw, "thinking": {"type": "enabled", "budget_tokens": 6, "display": "omitted"}}
    omitted = c.messages.create(**hidden)
    assert [b.type for b in omitted.content] == ["thinking", "text"]
    assert omitted.content[0].thinking == "" and omitted.content[1].text == m.content[1].text
    with c.messages.stream(**hidden) as s:
        assert not [e for e in s if e.type == "content_block_delta"
                    and e.delta.type == "thinking_delta"]
        assert s.get_final_message().content[0].thinking == ""

    off = c.messages.create(**{**kw, "thinking": {"type": "disabled"}})
    assert [b.type for b in off.content] == ["text"]
    absent = c.messages.create(**{k: v for k, v in kw.items() if k != "thinking"})
    assert [b.type for b in absent.content] == ["text"]


def test_messages_think_then_call(server: GatewayServer) -> None:
    """Tools after thinking: the call validates; the thinking and tool_use blocks sent back
    with a tool_result continue the conversation."""
    c = _messages(server)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
             for t in TOOLS]
    kw: dict[str, Any] = {"model": server.model, "max_tokens": 120, "tools": tools,
                          "thinking": {"type": "enabled", "budget_tokens": 6},
                          "extra_body": {"temperature": 0}}
    # get_weather's arguments are bounded (add's integers may run on at temperature 0)
    m = c.messages.create(**kw, messages=ASK, tool_choice={
        "type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    assert m.content[0].type == "thinking" and m.stop_reason == "tool_use"
    calls = [b for b in m.content if b.type == "tool_use"]
    _valid_calls([{"name": b.name, "arguments": json.dumps(b.input)} for b in calls],
                 set(SCHEMAS))
    history = [*ASK, {"role": "assistant", "content": m.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id,
                                             "content": "ok"} for b in calls]}]
    again = c.messages.create(**kw, messages=history, tool_choice={"type": "none"})
    assert again.content[0].type == "thinking" and again.content[-1].type == "text"


def test_messages_of_the_shape_claude_code_sends(server: GatewayServer) -> None:
    """A request shaped as Claude Code 2.1's (`?beta=true`, system text blocks with
    cache_control, a `system` turn between the messages, adaptive thinking with
    `output_config.effort`, `context_management`, a JSON `metadata.user_id`, streamed) is
    served: thinking, then the answer."""
    body = {
        "model": server.model, "max_tokens": 24, "stream": True, "temperature": 0,
        "ignore_eos": True,
        "system": [{"type": "text", "text": "x-billing-header: v=1;"},
                   {"type": "text", "text": "You are a coding agent.",
                    "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>date: today</system-reminder>"},
                {"type": "text", "text": "Say hi", "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "Agent types: general."}],
        "tools": [{"name": "Read", "description": "Read a file.", "input_schema": {
            "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
            "properties": {"file_path": {"type": "string"}}, "required": ["file_path"],
            "additionalProperties": False}}],
        "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "s"})},
        "thinking": {"type": "adaptive"}, "output_config": {"effort": "low"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    }
    r = httpx.post(server.url + "/v1/messages?beta=true", json=body, timeout=300,
                   headers={"x-api-key": server.api_key, "anthropic-version": "2023-06-01",
                            "anthropic-beta": "interleaved-thinking-2025-05-14"})
    assert r.status_code == 200, r.text
    kinds = [json.loads(line[6:])["type"] for line in r.text.splitlines()
             if line.startswith("data: ")]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    deltas = [json.loads(line[6:])["delta"]["type"] for line in r.text.splitlines()
              if line.startswith("data: ") and '"content_block_delta"' in line]
    assert deltas[0] == "thinking_delta"  # within the effort's budget: all 24 tokens think
