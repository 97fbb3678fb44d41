"""The Responses API and Conversations end to end: the real openai SDK and the OpenAI Agents SDK
against `switchboard serve --redis-url` (a real redis-server) on the embedded SmolLM2; the
bounded record stores (in-process and Redis) without a model. The last test restarts the
server and continues a chain from the stored history."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from conftest import API_KEYS, ROOT, SERVE_FLAGS, THREADS, _wait_for_banner
from openai import OpenAI
from test_sessions import redis_server, redis_url  # noqa: F401 - module-scoped fixtures

from gateway import redis_store
from gateway.access.bounds import MAX_MESSAGES, MAX_TOOLS
from gateway.access.quota import MemoryLedger
from gateway.errors import APIError
from gateway.responses.chain import Chain, Stores, commit
from gateway.responses.items import ResponsesRequest
from gateway.responses.routes import _plan
from gateway.responses.store import MemoryRecords, RedisRecords
from gateway.sessions.store import MemoryStore, RedisStore, Session

MODEL = "SmolLM2-135M-Instruct"
ALPHA, BETA = "sk-test-alpha", "sk-test-beta"
T0 = {"temperature": 0}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False}}
COLOR = {"type": "json_schema", "name": "color", "strict": True,
         "schema": {"type": "object", "properties": {
             "color": {"type": "string", "enum": ["red", "green", "blue"]}},
             "required": ["color"], "additionalProperties": False}}


class Server:
    """`switchboard serve --redis-url`, restartable (the history lives in Redis)."""

    def __init__(self, tmp: Path, redis: str):
        self.tmp, self.redis, self.proc, self.url = tmp, redis, None, ""
        (tmp / "keys.json").write_text(json.dumps(API_KEYS))

    def start(self) -> None:
        log = self.tmp / "serve.log"
        cmd = [sys.executable, "-m", "gateway.main", "serve", "--port", "0", "--api-keys",
               str(self.tmp / "keys.json"), "--redis-url", self.redis, "--adapter-dir",
               str(self.tmp / "adapters"), *SERVE_FLAGS]
        with log.open("w") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", **THREADS})
        self.url = _wait_for_banner(self.proc, log, timeout=300)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def client(self, key: str = ALPHA) -> OpenAI:
        return OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=300)

    def http(self, method: str, path: str, key: str = ALPHA, **kw) -> httpx.Response:
        return httpx.request(method, self.url + path, timeout=300,
                             headers={"Authorization": f"Bearer {key}"}, **kw)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Server]:  # noqa: F811
    s = Server(tmp_path_factory.mktemp("responses"), redis_url)
    s.start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> OpenAI:
    return server.client()


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


# -- create, retrieve, delete ---------------------------------------------------------------


def test_create_text_and_retrieve(server: Server, client: OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="Name one color.", max_output_tokens=4, **T0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert r.output_text and item.content[0].text == r.output_text
    assert r.usage.output_tokens == 4 and r.usage.input_tokens > 10
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens >= 0 and r.store is True
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    # Not stored: answered, but nothing to retrieve or continue.
    once = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False,
                                   **T0)
    assert once.store is False and once.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(once.id)


def test_json_schema_output_validates(client: OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="Pick a color.", text={"format": COLOR},
                                max_output_tokens=40, **T0)
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), COLOR["schema"])
    obj = client.responses.create(model=MODEL, input="Give a JSON object.", max_output_tokens=30,
                                  text={"format": {"type": "json_object"}}, **T0)
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)


def test_function_call_then_its_output_through_previous_response_id(client: OpenAI) -> None:
    first = client.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
        tool_choice="required", parallel_tool_calls=False, max_output_tokens=40, **T0)
    assert first.status == "completed"
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[WEATHER], max_output_tokens=12,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": "Sunny, 21 C."}], **T0)
    assert second.previous_response_id == first.id and second.output
    # The first turn (prompt, tools and call) was cached: only the new tokens were computed.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16
    [given] = client.responses.input_items.list(second.id).data
    assert given.type == "function_call_output" and given.call_id == call.call_id
    assert given.output == "Sunny, 21 C."
    # A named tool: exactly one call to it.
    named = client.responses.create(
        model=MODEL, input="Paris weather", tools=[WEATHER], max_output_tokens=40,
        tool_choice={"type": "function", "name": "get_weather"}, **T0)
    assert [o.type for o in named.output] == ["function_call"]


def test_stream_events_parse_and_match_the_stored_response(client: OpenAI) -> None:
    with client.responses.stream(model=MODEL, input="Pick a color.", text={"format": COLOR},
                                 max_output_tokens=40, **T0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == events[-4].text
    jsonschema.validate(json.loads(text), COLOR["schema"])
    assert client.responses.retrieve(final.id).output_text == text
    plain = client.responses.create(model=MODEL, input="Pick a color.", text={"format": COLOR},
                                    max_output_tokens=40, **T0)
    assert plain.output_text == text  # streamed and not streamed agree


def test_stream_function_call_events(client: OpenAI) -> None:
    with client.responses.stream(model=MODEL, input="Weather in Rome?", tools=[WEATHER],
                                 tool_choice="required", parallel_tool_calls=False,
                                 max_output_tokens=40, **T0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert "response.function_call_arguments.done" in types
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [call] = final.output
    assert call.type == "function_call" and call.arguments == args and call.name == "get_weather"
    assert types[-1] == "response.completed"
    assert client.responses.retrieve(final.id).output[0].call_id == call.call_id


def test_delete_and_input_items(server: Server, client: OpenAI) -> None:
    items = [{"role": "user", "content": f"Word {i}."} for i in range(3)]
    r = client.responses.create(model=MODEL, input=items, max_output_tokens=2, **T0)
    listed = client.responses.input_items.list(r.id, order="asc")
    assert [i.content[0].text for i in listed.data] == ["Word 0.", "Word 1.", "Word 2."]
    page = server.http("GET", f"/v1/responses/{r.id}/input_items?limit=2&order=asc").json()
    assert page["has_more"] and len(page["data"]) == 2
    rest = server.http("GET", f"/v1/responses/{r.id}/input_items?order=asc&after="
                              f"{page['last_id']}").json()
    assert [i["content"][0]["text"] for i in rest["data"]] == ["Word 2."]
    assert [i.id for i in client.responses.input_items.list(r.id).data] == \
        [i.id for i in listed.data][::-1]  # newest first by default
    client.responses.delete(r.id)
    for method, path in (("GET", ""), ("DELETE", ""), ("GET", "/input_items")):
        assert _error(server.http(method, f"/v1/responses/{r.id}{path}"), 404)["code"] == \
            "response_not_found"
    err = _error(server.http("POST", "/v1/responses", json={
        "model": MODEL, "input": "x", "previous_response_id": r.id}), 404)
    assert err["param"] == "previous_response_id"


def test_two_responses_from_one_parent_fork(client: OpenAI) -> None:
    parent = client.responses.create(model=MODEL, input="Count slowly from one.",
                                     max_output_tokens=8, **T0)
    a = client.responses.create(model=MODEL, previous_response_id=parent.id, input="Say A.",
                                max_output_tokens=4, **T0)
    b = client.responses.create(model=MODEL, previous_response_id=parent.id, input="Say B.",
                                max_output_tokens=4, **T0)
    # b continues the parent's history, not a's: the same prompt length, and the parent's KV.
    assert b.usage.input_tokens == a.usage.input_tokens
    assert b.usage.input_tokens_details.cached_tokens >= 16
    after_a = client.responses.create(model=MODEL, previous_response_id=a.id, input="Again.",
                                      max_output_tokens=2, **T0)
    after_b = client.responses.create(model=MODEL, previous_response_id=b.id, input="Again.",
                                      max_output_tokens=2, **T0)
    assert after_a.usage.input_tokens > a.usage.input_tokens
    assert after_b.usage.input_tokens > b.usage.input_tokens
    assert after_b.usage.input_tokens_details.cached_tokens >= 16


# -- conversations --------------------------------------------------------------------------


def test_conversations(server: Server, client: OpenAI) -> None:
    conv = client.conversations.create(items=[{"role": "user", "content": "My name is Ada."}],
                                       metadata={"topic": "names"})
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "names"}
    r = client.responses.create(model=MODEL, conversation=conv.id, input="What is my name?",
                                max_output_tokens=6, **T0)
    assert r.conversation.id == conv.id
    items = client.conversations.items.list(conv.id, order="asc").data
    assert [(i.type, i.role) for i in items] == [("message", "user")] * 2 + \
        [("message", "assistant")]
    assert items[0].content[0].text == "My name is Ada." and items[2].id == r.output[0].id
    added = client.conversations.items.create(conv.id, items=[{"role": "user", "content": "Hi"}])
    assert added.data[0].content[0].text == "Hi"
    assert client.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id).id == \
        added.data[0].id
    again = client.responses.create(model=MODEL, conversation={"id": conv.id}, input="Bye",
                                    max_output_tokens=2, **T0)
    assert again.usage.input_tokens > r.usage.total_tokens  # the whole conversation
    assert again.usage.input_tokens_details.cached_tokens > 0
    assert len(client.conversations.items.list(conv.id).data) == 6
    assert client.conversations.update(conv.id, metadata={"a": "b"}).metadata == {"a": "b"}
    assert client.conversations.retrieve(conv.id).metadata == {"a": "b"}
    assert client.conversations.delete(conv.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)
    err = _error(server.http("POST", "/v1/responses", json={
        "model": MODEL, "input": "x", "conversation": conv.id}), 404)
    assert err["param"] == "conversation"


# -- tenants and bad input ------------------------------------------------------------------


def test_another_tenants_responses_and_conversations_are_404(server: Server,
                                                            client: OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, **T0)
    conv = client.conversations.create()
    for method, path in (("GET", f"/v1/responses/{r.id}"), ("DELETE", f"/v1/responses/{r.id}"),
                         ("GET", f"/v1/responses/{r.id}/input_items"),
                         ("GET", f"/v1/conversations/{conv.id}"),
                         ("GET", f"/v1/conversations/{conv.id}/items"),
                         ("DELETE", f"/v1/conversations/{conv.id}")):
        assert server.http(method, path, key=BETA).status_code == 404, path
    for extra in ({"previous_response_id": r.id}, {"conversation": conv.id}):
        _error(server.http("POST", "/v1/responses", key=BETA,
                           json={"model": MODEL, "input": "x", **extra}), 404)
    assert client.responses.retrieve(r.id).id == r.id  # beta's DELETE did nothing
    assert client.conversations.retrieve(conv.id).id == conv.id


@pytest.mark.parametrize("body, status, param", [
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, 400, "input[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     400, "input[0].content[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400,
     "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, 400,
     "input[0].call_id"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []},
                {"role": "user", "content": "hi"},
                {"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, 400,
     "input[2].call_id"),
    ({"instructions": "Be brief.", "input": [
        {"role": "user", "content": "hi"},
        {"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, 400,
     "input[1].call_id"),  # the instructions' system message does not shift the index
    ({"input": 5}, 400, "input"),
    ({"input": "x", "max_reasoning_tokens": 0}, 400, "max_reasoning_tokens"),
    ({"input": "x", "chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs"),
    ({"input": "x", "tools": [WEATHER, WEATHER]}, 400, "tools[1].name"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     400, "tool_choice"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, 400, "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "c"}}}, 400,
     "text.format.schema"),
    ({"input": "x", "temperature": "hot"}, 400, "temperature"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, 400, "metadata"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"input": "x", "tools": [{**WEATHER, "parameters": {"type": "nope"}}]}, 400,
     "tools[0].parameters"),
    ({"input": "x", "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, 400, "text.format.type"),
    ({"input": "x", "text": {"format": {**COLOR, "schema": {"type": "nope"}}}}, 400,
     "text.format.schema"),
    ({"input": "x", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
    ({"input": "x", "previous_response_id": "resp_a", "conversation": "conv_b"}, 400,
     "conversation"),
    ({}, 400, "input"),
    ({"input": "x", "model": "no-such-model"}, 404, "model"),
])
def test_bad_input_is_a_4xx_naming_the_parameter(server: Server, body: dict, status: int,
                                                 param: str) -> None:
    err = _error(server.http("POST", "/v1/responses", json={"model": MODEL, **body}), status)
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"


def test_a_bad_item_after_a_chain_is_named_by_its_input_index(server: Server,
                                                             client: OpenAI) -> None:
    """The chain's stored messages come before this turn's: an error still names the item of
    this request's `input`."""
    first = client.responses.create(model=MODEL, input="Hello there.", max_output_tokens=4,
                                    **T0)
    body = {"model": MODEL, "previous_response_id": first.id,
            "input": [{"role": "user", "content": "And?"},
                      {"type": "function_call_output", "call_id": "call_x", "output": "1"}]}
    err = _error(server.http("POST", "/v1/responses", json=body), 400)
    assert err["param"] == "input[1].call_id", err


def test_too_many_input_items_or_tools_are_refused_as_the_body_is_read(server: Server) -> None:
    """`input` and `tools` are counted on the body's JSON, before it is validated."""
    hi = {"role": "user", "content": "hi"}
    for body, param, limit in [({"input": [hi] * (MAX_MESSAGES + 1)}, "input", MAX_MESSAGES),
                               ({"input": "x", "tools": [WEATHER] * (MAX_TOOLS + 1)}, "tools",
                                MAX_TOOLS)]:
        t0 = time.monotonic()
        err = _error(server.http("POST", "/v1/responses", json={"model": MODEL, **body}), 400)
        assert (err["param"], err["code"]) == (param, "array_above_max_length"), err
        assert str(limit) in err["message"] and time.monotonic() - t0 < 5


def test_a_chain_counts_its_history_with_the_input() -> None:
    """The chain's stored messages come before this turn's: together under the same bound as
    a request's own, the refusal naming `input`. (Refused before the tokenizer is needed.)"""
    history = Session("alpha", MODEL, [{"role": "user", "content": "a"}] * MAX_MESSAGES)
    body = ResponsesRequest.model_validate({"model": MODEL, "input": "x"})
    with pytest.raises(APIError) as e:
        _plan(body, Chain(history, MAX_MESSAGES, True), None, None, None)
    assert (e.value.status, e.value.param, e.value.code) == (400, "input",
                                                             "array_above_max_length")


# -- the OpenAI Agents SDK --------------------------------------------------------------


def test_agents_sdk_with_its_default_responses_model_and_a_function_tool(server: Server) -> None:
    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_responses import OpenAIResponsesModel

    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"It is sunny in {city}."

    model = OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key=ALPHA, max_retries=0, timeout=300))
    agent = Agent(name="weather", instructions="Answer weather questions with the tool.",
                  tools=[get_weather], model=model,
                  model_settings=ModelSettings(tool_choice="required", temperature=0,
                                               max_tokens=40, parallel_tool_calls=False))

    async def main() -> tuple:
        first = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        second = await Runner.run(agent, "And in Rome?", max_turns=4,
                                  previous_response_id=first.last_response_id)
        return first, second

    first, second = asyncio.run(main())
    assert cities == ["Paris", "Rome"]  # a call each run, then the tool's result answered
    assert isinstance(first.final_output, str) and first.final_output
    assert isinstance(second.final_output, str) and second.final_output
    assert [type(i).__name__ for i in first.new_items] == \
        ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]


# -- the bounded stores, without a model ------------------------------------------------


@pytest.fixture(params=["memory", "redis"])
def make_records(request: pytest.FixtureRequest):
    if request.param == "memory":
        return MemoryRecords
    url = request.getfixturevalue("redis_url")
    prefix = f"test:{time.monotonic()}:"
    return lambda ttl, bound: RedisRecords(redis_store.connect(url), prefix + "r:",
                                           prefix + "i:", ttl, bound)


def test_records_are_bounded_per_tenant_expire_and_isolate(make_records) -> None:
    async def main() -> None:
        records = make_records(60, 3)
        evicted = []
        for i in range(5):
            evicted += await records.put("alpha", f"r{i}", {"n": i})
        assert evicted == ["r0", "r1"]  # the oldest, beyond the bound
        assert [await records.get("alpha", f"r{i}") for i in range(5)] == \
            [None, None, {"n": 2}, {"n": 3}, {"n": 4}]
        assert await records.put("beta", "b0", {"n": 0}) == []  # bounds are per tenant
        assert await records.get("beta", "r4") is None and not await records.delete("beta", "r4")
        assert await records.put("alpha", "r2", {"n": 2}) == []  # renewed: now the newest
        assert await records.put("alpha", "r5", {"n": 5}) == ["r3"]
        assert await records.delete("alpha", "r4") and await records.get("alpha", "r4") is None
        short = make_records(1, 3)
        await short.put("alpha", "s", {})
        await asyncio.sleep(1.1)
        assert await short.get("alpha", "s") is None

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_append_at_appends_only_at_the_expected_length(kind: str,
                                                       request: pytest.FixtureRequest) -> None:
    async def main() -> None:
        store = MemoryStore() if kind == "memory" else RedisStore(
            redis_store.connect(request.getfixturevalue("redis_url")),
            prefix=f"test:{time.monotonic()}:")
        s = Session("alpha", MODEL, [{"role": "user", "content": "a"}], ttl_seconds=60)
        await store.create(s)
        assert await store.append_at(s, 1, [{"role": "assistant", "content": "b"}])
        assert not await store.append_at(s, 1, [{"role": "assistant", "content": "c"}])
        other = Session("beta", MODEL, id=s.id)
        assert not await store.append_at(other, 2, [{"role": "user", "content": "d"}])
        stored = await store.get("alpha", s.id)
        assert stored is not None and [m["content"] for m in stored.messages] == ["a", "b"]
        await store.close()

    asyncio.run(main())


def test_sessions_made_for_responses_are_bounded_and_released() -> None:
    async def main() -> None:
        released: list[str] = []
        sessions = MemoryStore()
        stores = Stores(MemoryRecords(60, 2), MemoryRecords(60, 2), MemoryRecords(60, 2),
                        sessions, released.append, 60, MemoryLedger())
        made = []
        for i in range(3):
            chain = Chain(Session("alpha", MODEL, ttl_seconds=60), 0, False)
            made.append((await commit(stores, chain, "alpha", [{"role": "user",
                                                               "content": str(i)}]))[0].session)
        assert released == [made[0].id] and await sessions.get("alpha", made[0].id) is None
        # Continuing the latest point appends; continuing an earlier one forks.
        top = Chain(made[1], 1, True)
        assert (await commit(stores, top, "alpha", [{"role": "user", "content": "x"}])
                )[0].session.id == made[1].id
        forked, grown = await commit(stores, Chain(made[1], 1, True), "alpha",
                                     [{"role": "user", "content": "y"}])
        assert grown == {f"s:{forked.session.id}": 2 * len('{"role": "user", "content": "1"}')}
        assert forked.session.id != made[1].id
        assert [m["content"] for m in forked.session.messages] == ["1", "y"]
        assert [m["content"] for m in (await sessions.get("alpha", made[1].id)).messages] == \
            ["1", "x"]

    asyncio.run(main())


# -- last: a restart --------------------------------------------------------------------


def test_a_chain_continues_after_a_restart_from_the_stored_history(server: Server) -> None:
    client = server.client()
    system = "You are a terse assistant."
    first = client.responses.create(model=MODEL, instructions=system, input="Name a fruit.",
                                    max_output_tokens=6, **T0)
    second = client.responses.create(model=MODEL, instructions=system, input="Another one.",
                                     previous_response_id=first.id, max_output_tokens=6, **T0)
    server.stop()
    server.start()
    client = server.client()
    third = client.responses.create(model=MODEL, instructions=system, input="A third.",
                                    previous_response_id=second.id, max_output_tokens=6, **T0)
    assert third.usage.input_tokens > second.usage.total_tokens
    assert third.usage.input_tokens_details.cached_tokens == 0  # re-prefilled: new process
    # The same conversation sent whole, unchained: the same prompt and the same reply.
    history = [{"role": "user", "content": "Name a fruit."},
               {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "Another one."},
               {"role": "assistant", "content": second.output_text},
               {"role": "user", "content": "A third."}]
    cold = client.responses.create(model=MODEL, instructions=system, input=history,
                                   max_output_tokens=6, store=False, **T0)
    assert cold.usage.input_tokens == third.usage.input_tokens
    assert cold.output_text == third.output_text
    assert client.responses.retrieve(first.id).output_text == first.output_text
