"""Tool calling end to end: the real `openai` SDK (and langchain-openai, openai-agents) against
`switchboard serve` on the embedded SmolLM2 (the session's `gateway_server`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import httpx
import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

if TYPE_CHECKING:
    from tests.conftest import GatewayServer

ROOT = Path(__file__).resolve().parents[1]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 32},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(gateway_server: GatewayServer) -> GatewayServer:
    return gateway_server


@pytest.fixture(scope="module")
def client(server: GatewayServer) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0, timeout=300)


def _chat(client: OpenAI, server: GatewayServer, **kw: Any):
    # One call per turn unless a test asks for more: at temperature 0 a small model, allowed
    # parallel calls, tends to repeat its call until max_tokens.
    kw = {"model": server.model, "messages": ASK, "tools": TOOLS, "temperature": 0,
          "max_tokens": 64, "parallel_tool_calls": False, **kw}
    return client.chat.completions.create(**kw)


def _assert_valid(calls: Any, allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# -- tool_choice modes ----------------------------------------------------------------------


def test_required_returns_valid_calls(client: OpenAI, server: GatewayServer) -> None:
    choice = _chat(client, server, tool_choice="required").choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    _assert_valid(choice.message.tool_calls, {"get_weather", "add"})


def test_named_tool_is_called_exactly_once(client: OpenAI, server: GatewayServer) -> None:
    named = {"type": "function", "function": {"name": "add"}}
    choice = _chat(client, server, tool_choice=named).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1
    _assert_valid(choice.message.tool_calls, {"add"})


def test_tool_without_parameters_is_called_with_none(client: OpenAI, server: GatewayServer) -> None:
    """No `parameters` means no arguments: `{}`, not an open object the model fills forever."""
    now = {"type": "function", "function": {"name": "now", "description": "The current time"}}
    choice = _chat(client, server, tools=[now], tool_choice="required").choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = [(c.function.name, json.loads(c.function.arguments))
             for c in choice.message.tool_calls]
    assert calls == [("now", {})]


def test_parallel_calls_keep_only_complete_valid_ones(
    client: OpenAI, server: GatewayServer
) -> None:
    choice = _chat(client, server, tool_choice="required", parallel_tool_calls=True,
                   max_tokens=80).choices[0]
    # Several calls may follow one another; one cut by max_tokens is dropped, not returned.
    assert choice.finish_reason in ("tool_calls", "length")
    _assert_valid(choice.message.tool_calls, {"get_weather", "add"})


def test_auto_gives_text_or_valid_calls(client: OpenAI, server: GatewayServer) -> None:
    choice = _chat(client, server, tool_choice="auto", max_tokens=24).choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        _assert_valid(choice.message.tool_calls, {"get_weather", "add"})
    else:
        assert choice.finish_reason in ("stop", "length")
        assert isinstance(choice.message.content, str) and "<tool_call>" not in (
            choice.message.content)


def test_none_gives_plain_text(client: OpenAI, server: GatewayServer) -> None:
    choice = _chat(client, server, tool_choice="none", max_tokens=12).choices[0]
    assert choice.message.tool_calls is None
    assert isinstance(choice.message.content, str) and choice.message.content


def test_call_cut_by_max_tokens_is_not_returned(client: OpenAI, server: GatewayServer) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = _chat(client, server, tool_choice=named, max_tokens=4).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls is None


# -- streaming --------------------------------------------------------------------------


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_stream_reassembles_to_the_non_streamed_result(
    client: OpenAI, server: GatewayServer, tool_choice: str
) -> None:
    full = _chat(client, server, tool_choice=tool_choice).choices[0]
    content, calls, finish, first_delta = [], {}, None, None
    for chunk in _chat(client, server, tool_choice=tool_choice, stream=True):
        delta = chunk.choices[0].delta
        first_delta = first_delta or delta
        content.append(delta.content or "")
        for tc in delta.tool_calls or []:
            if tc.index not in calls:  # the first fragment of a call carries its id and name
                assert tc.id and tc.function.name and tc.type == "function"
                calls[tc.index] = {"name": tc.function.name, "arguments": ""}
            else:
                assert tc.id is None and tc.function.name is None
            calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert first_delta.role == "assistant"
    assert finish == full.finish_reason
    assert ("".join(content) or None) == (full.message.content or None)
    expected = [{"name": c.function.name, "arguments": c.function.arguments}
                for c in full.message.tool_calls or []]
    assert [calls[i] for i in sorted(calls)] == expected


# -- histories and agent loops ----------------------------------------------------------


def test_multi_step_agent_loop(client: OpenAI, server: GatewayServer) -> None:
    """call -> tool result -> next call or final answer, with the history carried along."""
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "What is 2 + 3? Then tell me the weather in Rome."}]
    steps = []
    for step in range(3):
        choice = client.chat.completions.create(
            model=server.model, messages=messages, tools=TOOLS, temperature=0, max_tokens=64,
            parallel_tool_calls=False, tool_choice="required" if step < 2 else "none",
        ).choices[0]
        steps.append(choice.finish_reason)
        if not choice.message.tool_calls:
            break
        _assert_valid(choice.message.tool_calls, {"get_weather", "add"})
        messages.append(choice.message.model_dump(exclude_none=True))
        for call in choice.message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": json.dumps({"result": 5})})
    assert steps[:2] == ["tool_calls", "tool_calls"]
    assert steps[2] in ("stop", "length")
    assert sum(m["role"] == "tool" for m in messages) >= 2


def test_examples_agent_tools_runs_against_the_server(server: GatewayServer) -> None:
    out = subprocess.run(
        [sys.executable, "examples/agent_tools.py", "--base-url", server.base_url,
         "--api-key", server.api_key, "--max-steps", "2", "--max-tokens", "64",
         "What is 12 * 7?"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "calculator(" in out.stderr or "clock(" in out.stderr  # at least one tool ran


def test_parse_with_a_pydantic_model(client: OpenAI, server: GatewayServer) -> None:
    class City(BaseModel):  # bounded fields: a small model finishes well within max_tokens
        name: str = Field(max_length=16)
        country: Literal["France", "Italy", "Spain"]

    reply = client.chat.completions.parse(
        model=server.model, messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City, temperature=0, max_tokens=64)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)


# -- bad input --------------------------------------------------------------------------


def _error(server: GatewayServer, **body: Any) -> tuple[int, dict[str, Any]]:
    body = {"model": server.model, "messages": ASK, "max_tokens": 8, **body}
    r = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {server.api_key}"})
    return r.status_code, r.json().get("error", {})


def _tool(name: str, parameters: Any = None) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name}
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"tools": [_tool("f", {"type": "object", "properties": {"x": {"type": "nope"}}})]},
         "tools[0].function.parameters", "invalid JSON schema"),
        ({"tools": [_tool("f", {"type": "object", "properties": {"x": {"$ref": "#/$defs/y"}}})]},
         "tools[0].function.parameters", "does not resolve"),
        ({"tools": [_tool("f"), _tool("f")]}, "tools[1].function.name", "duplicate"),
        ({"tools": [_tool("bad name!")]}, "tools[0].function.name", "must match"),
        ({"tools": [_tool("x" * 65)]}, "tools[0].function.name", "must match"),
        ({"tools": [_tool("f")], "tool_choice": {"type": "function", "function": {"name": "g"}}},
         "tool_choice", "'g'"),
        ({"tools": [_tool("f")], "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "1"}]},
         "messages[1].tool_call_id", "call_x"),
        ({"messages": [*ASK, {"role": "tool", "content": "1"}]},
         "messages[1].tool_call_id", "tool_call_id"),
    ],
)
def test_bad_tools_are_a_400_naming_the_problem(
    server: GatewayServer, body: dict[str, Any], param: str, words: str
) -> None:
    status, error = _error(server, **body)
    assert status == 400, error
    assert error["param"] == param
    assert words in error["message"]
    assert error["type"] == "invalid_request_error"


def test_tool_message_answering_a_known_call_is_accepted(server: GatewayServer) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    status, error = _error(server, messages=messages, tools=TOOLS, tool_choice="none")
    assert status == 200, error


def test_session_stores_tool_calls_and_accepts_their_results(
    client: OpenAI, server: GatewayServer
) -> None:
    """A tool-calling agent on a session: the reply is stored as the message the client got
    (its `tool_calls`), so the next turn's `tool` message answers a known call."""
    headers = {"Authorization": f"Bearer {server.api_key}"}
    r = httpx.post(f"{server.base_url}/sessions", headers=headers,
                   json={"model": server.model}, timeout=60)
    assert r.status_code == 200, r.text
    sid = r.json()["id"]
    first = _chat(client, server, tool_choice={"type": "function", "function": {"name": "add"}},
                  messages=[{"role": "user", "content": "What is 2 + 3?"}],
                  extra_body={"session_id": sid}).choices[0].message
    call = first.tool_calls[0]
    reply = _chat(client, server, tool_choice="none", max_tokens=8, extra_body={"session_id": sid},
                  messages=[{"role": "tool", "tool_call_id": call.id, "content": "5"}])
    assert reply.choices[0].finish_reason in ("stop", "length")
    history = httpx.get(f"{server.base_url}/sessions/{sid}", headers=headers,
                        timeout=60).json()["messages"]
    assert [m["role"] for m in history] == ["user", "assistant", "tool", "assistant"]
    stored = history[1]["tool_calls"][0]
    assert stored["id"] == call.id and stored["function"]["arguments"] == call.function.arguments


# -- agent frameworks -------------------------------------------------------------------


def test_langchain_bind_tools_round_trip(server: GatewayServer) -> None:
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    llm = ChatOpenAI(model=server.model, base_url=server.base_url, api_key=server.api_key,
                     temperature=0, max_tokens=64, max_retries=0)
    bound = llm.bind_tools([add], tool_choice="required", parallel_tool_calls=False)
    messages: list[Any] = [HumanMessage("What is 2 + 3?")]
    ai = bound.invoke(messages)
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "add"
    args = ai.tool_calls[0]["args"]
    assert isinstance(args["a"], int) and isinstance(args["b"], int)
    messages += [ai, ToolMessage(str(add.invoke(args)), tool_call_id=ai.tool_calls[0]["id"])]
    final = llm.bind_tools([add], tool_choice="none").invoke(messages)
    assert isinstance(final.content, str) and not final.tool_calls


def test_openai_agents_function_tool(server: GatewayServer) -> None:
    pytest.importorskip("agents")
    import asyncio

    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        RunConfig,
        Runner,
        function_tool,
    )
    from openai import AsyncOpenAI

    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        seen.append(city)
        return f"Sunny in {city}"

    client = AsyncOpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0)
    model = OpenAIChatCompletionsModel(model=server.model, openai_client=client)
    agent = Agent(name="weather", instructions="Answer with the tools.", tools=[get_weather],
                  model=model, model_settings=ModelSettings(
                      tool_choice="required", temperature=0, max_tokens=64,
                      parallel_tool_calls=False),
                  reset_tool_choice=True)
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4,
                                    run_config=RunConfig(tracing_disabled=True)))
    assert seen and all(isinstance(c, str) for c in seen)
    assert isinstance(result.final_output, str)
