"""Forced tool calls cut by max_tokens inside the next call's opening marker, and the message
parts of a Responses stream: the real `openai` SDK against `switchboard serve` on the embedded
SmolLM2 (the session's `gateway_server`).

At temperature 0 the model, made to call the weather tool, writes one call, then `\\n` and the
next call's `<tool_call>` marker. The pinned `max_tokens` values cut inside that marker; each
test first checks, from the returned tokens (logprobs), that the cut still lands there, so a
changed model output fails instead of passing silently.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jsonschema
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletion

if TYPE_CHECKING:
    from tests.conftest import GatewayServer

PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 32},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
DESCRIPTION = "Get the current weather in a city."
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": DESCRIPTION,
                                            "parameters": PARAMETERS}}
WEATHER_RESPONSES = {"type": "function", "name": "get_weather", "description": DESCRIPTION,
                     "parameters": PARAMETERS}
QUESTION = "What is the weather in Paris?"
# max_tokens -> where the output ends: one whole call, "\n", and this much of the next marker.
CUTS = {43: "<tool", 45: "<tool_call"}
COLOR = {"type": "json_schema", "name": "color", "strict": True,
         "schema": {"type": "object", "properties": {
             "color": {"type": "string", "enum": ["red", "green", "blue"]}},
             "required": ["color"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(gateway_server: GatewayServer) -> GatewayServer:
    return gateway_server


@pytest.fixture(scope="module")
def client(server: GatewayServer) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0, timeout=300)


def _chat(client: OpenAI, server: GatewayServer, max_tokens: int, **kw: Any) -> Any:
    return client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": QUESTION}], tools=[WEATHER],
        tool_choice="required", temperature=0, max_tokens=max_tokens, **kw)


@pytest.fixture(scope="module")
def pinned(client: OpenAI, server: GatewayServer) -> Callable[[int], ChatCompletion]:
    """The non-streamed chat reply at a pinned cut, checked to end inside the next marker."""

    @functools.cache
    def reply(max_tokens: int) -> ChatCompletion:
        r = _chat(client, server, max_tokens, logprobs=True)
        raw = "".join(t.token for t in r.choices[0].logprobs.content)
        assert r.usage.completion_tokens == max_tokens, raw
        assert r.choices[0].finish_reason == "length", raw
        assert raw.startswith("<tool_call>\n") and raw.count("</tool_call>") == 1, raw
        assert raw.endswith("</tool_call>\n" + CUTS[max_tokens]), raw  # the cut is in the marker
        return r

    return reply


def _valid(name: str, arguments: str) -> None:
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), PARAMETERS)


@pytest.mark.parametrize("max_tokens", sorted(CUTS))
def test_chat_forced_call_cut_inside_the_next_marker_has_no_text(
    client: OpenAI, server: GatewayServer, pinned: Callable[[int], ChatCompletion],
    max_tokens: int,
) -> None:
    r = pinned(max_tokens)
    message = r.choices[0].message
    assert message.content is None
    [call] = message.tool_calls
    _valid(call.function.name, call.function.arguments)

    chunks = list(_chat(client, server, max_tokens, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert [d.content for d in deltas if d.content is not None] == []
    fragments = [t for d in deltas for t in d.tool_calls or []]
    assert {t.index for t in fragments} == {0}
    assert [t.function.name for t in fragments if t.function.name] == ["get_weather"]
    assert "".join(t.function.arguments or "" for t in fragments) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("max_tokens", sorted(CUTS))
def test_responses_forced_call_cut_inside_the_next_marker_has_no_message(
    client: OpenAI, server: GatewayServer, pinned: Callable[[int], ChatCompletion],
    max_tokens: int,
) -> None:
    chat = pinned(max_tokens)
    kw: dict[str, Any] = {"model": server.model, "input": QUESTION, "tools": [WEATHER_RESPONSES],
                          "tool_choice": "required", "temperature": 0,
                          "max_output_tokens": max_tokens, "store": False}
    r = client.responses.create(**kw)
    assert r.usage.input_tokens == chat.usage.prompt_tokens  # the same prompt as the pinned chat
    assert r.usage.output_tokens == max_tokens
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [call] = r.output
    assert call.type == "function_call"
    assert call.arguments == chat.choices[0].message.tool_calls[0].function.arguments
    _valid(call.name, call.arguments)

    events = list(client.responses.create(**kw, stream=True))
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["function_call"]
    assert not [e for e in events if e.type.startswith(("response.output_text",
                                                         "response.content_part"))]
    assert events[-1].type == "response.incomplete"
    [streamed] = events[-1].response.output
    assert streamed.type == "function_call" and streamed.arguments == call.arguments


def test_responses_stream_adds_a_message_with_no_parts_then_one_part(client: OpenAI,
                                                                     server: GatewayServer) -> None:
    """`output_item.added` carries `content: []` (as OpenAI's); the one part comes in
    `content_part.added`. The parts are accumulated as the SDK's running snapshot does (the
    added item's content, then each added part), which must end with exactly one."""
    with client.responses.stream(model=server.model, input="Pick a color.",
                                 text={"format": COLOR}, max_output_tokens=40,
                                 temperature=0, store=False) as stream:
        events = list(stream)
        final = stream.get_final_response()
    [added] = [e for e in events if e.type == "response.output_item.added"]
    assert added.item.type == "message" and added.item.content == []
    parts = list(added.item.content)
    for e in events:
        if e.type == "response.content_part.added":
            parts.append(e.part.model_copy())
        elif e.type == "response.output_text.delta":
            parts[e.content_index].text += e.delta
    assert len(parts) == 1 and parts[0].text == final.output_text
    [message] = final.output
    assert len(message.content) == 1 and message.content[0].text == final.output_text
    jsonschema.validate(json.loads(final.output_text), COLOR["schema"])
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [len(e.item.content) for e in done] == [1]  # the .done events keep their part
