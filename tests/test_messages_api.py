"""Anthropic's Messages API end to end: the real `anthropic` SDK against `switchboard serve` on
the embedded SmolLM2 (the session's `gateway_server`).

Plain and streamed messages (the event sequence, and the SDK's stream helper assembling the
message the non-streamed call returns), stop sequences, a two-step tool loop with
`tool_result`, `tool_choice` any / named / auto (every tool input validates against its
`input_schema`, streamed or not), count_tokens, every error type in Anthropic's shape, and
tenant isolation of adapters. Thinking blocks: tests/test_reasoning_http.py.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from engine.sampling.params import InvalidRequestError
from gateway.errors import APIError, anthropic_error
from gateway.messages.prompt import to_input
from gateway.messages.schemas import MessagesRequest
from gateway.openai.params import ChatInput, EngineFacts, plan_chat
from gateway.openai.schemas import REASONING_EFFORT
from gateway.openai.tokenizer import GatewayTokenizer
from tests.conftest import GatewayServer
from tests.lora_files import adapter

ROOT = Path(__file__).resolve().parents[1]
ALPHA, BETA, GAMMA = "sk-test-alpha", "sk-test-beta", "sk-test-gamma"
WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 32},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
ADD = {
    "name": "add",
    "description": "Add two integers.",
    "input_schema": {"type": "object",
                     "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                     "required": ["a", "b"], "additionalProperties": False},
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HI = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture(scope="module")
def server(gateway_server: GatewayServer) -> GatewayServer:
    return gateway_server


def client(server: GatewayServer, key: str = ALPHA) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=300)


SAMPLING = ("temperature", "top_p", "top_k", "ignore_eos")  # the SDK's create() has none


def create(c: anthropic.Anthropic, **kw: Any) -> Any:
    """`messages.create`, the sampling fields sent as the body's own (older clients do)."""
    extra = {k: kw.pop(k) for k in SAMPLING if k in kw}
    return c.messages.create(**kw, extra_body=extra)


def streamed(c: anthropic.Anthropic, **kw: Any) -> Any:
    """The message the SDK's stream helper assembles."""
    extra = {k: kw.pop(k) for k in SAMPLING if k in kw}
    with c.messages.stream(**kw, extra_body=extra) as s:
        return s.get_final_message()


def post(server: GatewayServer, body: object, key: str | None = ALPHA,
         path: str = "/v1/messages", **kw: Any) -> httpx.Response:
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=300, **kw)


def blocks(message: Any) -> list[dict[str, Any]]:
    """A message's content as plain dicts, tool ids left out (each call names its own)."""
    return [{k: v for k, v in b.model_dump().items() if k != "id"} for b in message.content]


def events(r: httpx.Response) -> list[dict[str, Any]]:
    """A raw stream's events, each checked to name its own type."""
    out, name = [], None
    for line in r.text.splitlines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            data = json.loads(line.removeprefix("data: "))
            assert data["type"] == name
            out.append(data)
    return out


def test_plain_message(server: GatewayServer) -> None:
    m = create(client(server), model=server.model, max_tokens=12, messages=HI,
               temperature=0, ignore_eos=True)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model == server.model
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 12
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens > 10

    free = create(client(server), model=server.model, max_tokens=200, messages=HI,
                  temperature=0, system="You are terse.")
    assert free.stop_reason == "end_turn"  # SmolLM2 ends its sentence well before 200


def test_stream_is_the_same_message(server: GatewayServer) -> None:
    kw = {"model": server.model, "max_tokens": 16, "messages": HI, "temperature": 0}
    whole = create(client(server), **kw)
    assembled = streamed(client(server), **kw)
    assert blocks(assembled) == blocks(whole)
    assert (assembled.stop_reason, assembled.stop_sequence) == (whole.stop_reason,
                                                               whole.stop_sequence)
    assert assembled.usage.output_tokens == whole.usage.output_tokens
    assert (assembled.usage.input_tokens + assembled.usage.cache_read_input_tokens
            == whole.usage.input_tokens + whole.usage.cache_read_input_tokens)
    assert assembled.usage.cache_read_input_tokens > 0  # the same prompt, just served

    r = post(server, {**kw, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    seq = events(r)
    kinds = [e["type"] for e in seq]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert seq[0]["message"]["content"] == [] and seq[0]["message"]["stop_reason"] is None
    text = "".join(e["delta"]["text"] for e in seq if e["type"] == "content_block_delta")
    assert text == whole.content[0].text
    assert seq[-2]["delta"]["stop_reason"] == whole.stop_reason
    assert seq[-2]["usage"]["output_tokens"] == whole.usage.output_tokens


def test_stop_sequences(server: GatewayServer) -> None:
    kw = {"model": server.model, "max_tokens": 24, "messages": HI, "temperature": 0}
    text = create(client(server), **kw).content[0].text
    word = text.split()[3]
    m = create(client(server), **kw, stop_sequences=["@@", word])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", word)
    assert m.content[0].text == text[:text.index(word)]
    s = streamed(client(server), **kw, stop_sequences=[word])
    assert (s.stop_reason, s.stop_sequence) == ("stop_sequence", word)
    assert s.content[0].text == m.content[0].text


def _calls(message: Any, allowed: set[str]) -> list[Any]:
    calls = [b for b in message.content if b.type == "tool_use"]
    for call in calls:
        assert call.name in allowed and call.id.startswith("toolu_")
        jsonschema.validate(call.input, SCHEMAS[call.name])
    return calls


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "add"},
                                    {"type": "auto"}], ids=["any", "named", "auto"])
def test_tool_inputs_validate(server: GatewayServer, choice: dict[str, Any],
                              stream: bool) -> None:
    kw = {"model": server.model, "max_tokens": 96, "messages": ASK, "tools": TOOLS,
          "tool_choice": choice, "temperature": 0}
    if stream:
        m = streamed(client(server), **kw)
        assert blocks(m) == blocks(create(client(server), **kw))
    else:
        m = create(client(server), **kw)
    allowed = {choice["name"]} if choice["type"] == "tool" else set(SCHEMAS)
    calls = _calls(m, allowed)
    if choice["type"] != "auto":
        assert calls and m.stop_reason == "tool_use"
        assert [b.type for b in m.content] == ["tool_use"] * len(calls)  # forced: no text
    elif calls:
        assert m.stop_reason == "tool_use"


def test_one_call_when_parallel_use_is_disabled(server: GatewayServer) -> None:
    m = create(
        client(server), model=server.model, max_tokens=200, messages=ASK, tools=TOOLS,
        temperature=0, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert len(_calls(m, set(SCHEMAS))) == 1


def test_tool_loop_with_tool_result(server: GatewayServer) -> None:
    c = client(server)
    kw = {"model": server.model, "max_tokens": 96, "tools": TOOLS, "temperature": 0}
    first = create(c, **kw, messages=ASK, tool_choice={"type": "tool",
                                                               "name": "get_weather"})
    (call,) = _calls(first, {"get_weather"})
    history = [*ASK, {"role": "assistant", "content": first.content},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": call.id,
                    "content": [{"type": "text", "text": "18 degrees, sunny"}]},
                   {"type": "text", "text": "Answer in one sentence."}]}]
    second = create(c, **kw, messages=history, tool_choice={"type": "none"})
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in second.content] == ["text"] and second.content[0].text

    failed = [*history[:2], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call.id, "content": "city not found",
         "is_error": True}]}]
    third = create(c, **kw, messages=failed)  # tool_choice auto
    _calls(third, set(SCHEMAS))
    # The history really reaches the prompt: it costs more tokens than the question alone.
    n = c.messages.count_tokens(model=server.model, messages=failed, tools=TOOLS).input_tokens
    alone = c.messages.count_tokens(model=server.model, messages=ASK, tools=TOOLS).input_tokens
    assert n > alone + 10


def test_count_tokens_is_the_prompt(server: GatewayServer) -> None:
    c = client(server, GAMMA)  # gamma's token budget: count_tokens spends none of it
    n = c.messages.count_tokens(model=server.model, messages=HI, system="Be brief.")
    assert n.input_tokens > 0
    m = client(server).messages.create(model=server.model, max_tokens=1, messages=HI,
                                       system="Be brief.")
    assert n.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens
    for _ in range(3):
        c.messages.count_tokens(model=server.model, messages=HI)


# -- errors, in Anthropic's shape ---------------------------------------------------------


def _error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]["message"]


def test_invalid_requests(server: GatewayServer) -> None:
    ok = {"model": server.model, "max_tokens": 4, "messages": HI}
    assert "max_tokens" in _error(post(server, {**ok, "max_tokens": None}), 400,
                                  "invalid_request_error")
    no_max = {k: v for k, v in ok.items() if k != "max_tokens"}
    assert "max_tokens" in _error(post(server, no_max), 400, "invalid_request_error")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AAAA"}}
    _error(post(server, {**ok, "messages": [{"role": "user", "content": [image]}]}), 400,
           "invalid_request_error")
    result_from_assistant = [*HI, {"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}]
    assert "messages[1].content[0]" in _error(
        post(server, {**ok, "messages": result_from_assistant}), 400, "invalid_request_error")
    unanswered = [*HI, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]
    assert "messages[1]" in _error(post(server, {**ok, "messages": unanswered}), 400,
                                   "invalid_request_error")
    bad_schema = {**WEATHER, "input_schema": {"type": "object", "properties": 3}}
    assert "tools[0].input_schema" in _error(
        post(server, {**ok, "tools": [bad_schema]}), 400, "invalid_request_error")
    _error(post(server, {**ok, "tools": [{"type": "web_search_20250305", "name": "web_search",
                                          "input_schema": {}}]}), 400, "invalid_request_error")
    _error(post(server, {**ok, "tool_choice": {"type": "tool", "name": "nope"},
                         "tools": TOOLS}), 400, "invalid_request_error")
    _error(post(server, {**ok, "thinking": {"type": "enabled", "budget_tokens": 8}}), 400,
           "invalid_request_error")  # the budget must be below max_tokens
    _error(post(server, {**ok, "temperature": 1.5}), 400, "invalid_request_error")
    _error(httpx.post(server.url + "/v1/messages", content=b"{not json", timeout=30,
                      headers={"x-api-key": ALPHA}), 400, "invalid_request_error")
    # The SDK reads these as its own error types.
    with pytest.raises(anthropic.BadRequestError) as e:
        client(server).messages.create(model=server.model, max_tokens=4, messages=[])
    assert e.value.body["error"]["type"] == "invalid_request_error"


def test_auth_errors_and_headers(server: GatewayServer) -> None:
    ok = {"model": server.model, "max_tokens": 2, "messages": HI}
    _error(post(server, ok, key=None), 401, "authentication_error")
    _error(post(server, ok, key="sk-wrong"), 401, "authentication_error")
    bearer = httpx.post(server.url + "/v1/messages", json=ok, timeout=300,
                        headers={"Authorization": f"Bearer {ALPHA}"})
    assert bearer.status_code == 200 and bearer.json()["type"] == "message"
    with pytest.raises(anthropic.AuthenticationError):
        client(server, "sk-wrong").messages.create(**ok)
    _error(post(server, ok, path="/v1/messages/count_tokens", key="sk-wrong"), 401,
           "authentication_error")


def test_not_found_and_too_large(server: GatewayServer) -> None:
    ok = {"model": server.model, "max_tokens": 2, "messages": HI}
    assert "never-uploaded" in _error(post(server, {**ok, "model": "never-uploaded"}), 404,
                                      "not_found_error")
    with pytest.raises(anthropic.NotFoundError):
        client(server).messages.count_tokens(model="never-uploaded", messages=HI)
    huge = {**ok, "messages": [{"role": "user", "content": "x" * (5 * 2**20)}]}
    _error(post(server, huge), 413, "request_too_large")


def test_rate_limits(server: GatewayServer) -> None:
    gamma = client(server, GAMMA)  # 40 tokens a minute
    with pytest.raises(anthropic.RateLimitError) as e:
        for _ in range(20):
            gamma.messages.create(model=server.model, max_tokens=8, messages=HI)
    assert e.value.body["error"]["type"] == "rate_limit_error"
    assert int(e.value.response.headers["retry-after"]) >= 1


def test_full_queue_is_overloaded(server: GatewayServer) -> None:
    body = {"model": server.model, "max_tokens": 1, "messages": HI}

    async def main() -> list[httpx.Response]:
        headers = {"x-api-key": ALPHA}
        async with httpx.AsyncClient(headers=headers, timeout=300) as http:
            return await asyncio.gather(*[http.post(server.url + "/v1/messages", json=body)
                                          for _ in range(40)])

    responses = asyncio.run(main())
    refused = [r for r in responses if r.status_code != 200]
    assert refused and len(responses) - len(refused) >= 16
    for r in refused:
        _error(r, 529, "overloaded_error")
        assert int(r.headers["Retry-After"]) >= 1


# -- tenants ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def alpha_adapter(server: GatewayServer) -> Iterator[str]:
    files = [("files", f) for f in adapter()]
    r = httpx.post(server.url + "/v1/adapters", data={"name": "alpha-messages"}, files=files,
                   headers={"Authorization": f"Bearer {ALPHA}"}, timeout=120)
    assert r.status_code in (200, 201), r.text
    yield "alpha-messages"
    httpx.delete(server.url + "/v1/adapters/alpha-messages",
                 headers={"Authorization": f"Bearer {ALPHA}"}, timeout=120)


def test_adapters_are_the_tenants_own(server: GatewayServer, alpha_adapter: str) -> None:
    model = f"{server.model}:{alpha_adapter}"
    m = client(server).messages.create(model=model, max_tokens=4, messages=HI)
    assert m.model == model and m.usage.output_tokens >= 1
    ok = {"max_tokens": 4, "messages": HI}
    theirs = _error(post(server, {**ok, "model": model}, key=BETA), 404, "not_found_error")
    unknown = _error(post(server, {**ok, "model": f"{server.model}:never-uploaded"}, key=BETA),
                     404, "not_found_error")
    assert theirs.replace(alpha_adapter, "X") == unknown.replace("never-uploaded", "X")


def test_output_format_is_followed(server: GatewayServer) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    kw = {"model": server.model, "max_tokens": 64, "messages": ASK, "temperature": 0,
          "output_config": {"format": {"type": "json_schema", "schema": schema}}}
    m = create(client(server), **kw)
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), schema)
    assert blocks(streamed(client(server), **kw)) == blocks(m)
    bad = {**kw, "output_config": {"format": {"type": "json_schema",
                                              "schema": {"type": "object", "properties": 1}}}}
    assert "output_config.format" in _error(post(server, bad), 400, "invalid_request_error")


# -- the translation, without a server ----------------------------------------------------


def test_a_conversation_as_chat_messages() -> None:
    body = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "call it", "signature": "x"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "Oslo"}},
                {"type": "tool_use", "id": "toolu_2", "name": "w", "input": {"city": "Rome"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "cold"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "no such city"}]},
                {"type": "text", "text": "So?"}]}],
        "tools": [{"name": "w", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 32}, "stop_sequences": ["END"]})
    inp = to_input(body, body.max_tokens)
    roles = [m["role"] for m in inp.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool", "user"]
    assert [inp.spelling.message(i) for i in range(6)] == [
        "system", "messages[0]", "messages[1]", "messages[2].content[0]",
        "messages[2].content[1]", "messages[2]"]
    assistant = inp.messages[2]
    assert assistant["content"] == "Checking." and assistant["reasoning_content"] == "call it"
    calls = assistant["tool_calls"]
    assert isinstance(calls, list) and [json.loads(c["function"]["arguments"]) for c in calls] \
        == [{"city": "Oslo"}, {"city": "Rome"}]
    assert [m["content"] for m in inp.messages[3:]] == ["cold", "Error: no such city", "So?"]
    assert inp.tools is not None and inp.tools.mode == "required"
    assert inp.tools.parallel is False and [t.name for t in inp.tools.tools] == ["w"]
    assert inp.sampling.max_reasoning_tokens == 32 and inp.sampling.stop == ("END",)
    assert inp.template_kwargs == {"enable_thinking": True}


def test_effort_and_thinking_map_to_the_reasoning_budget() -> None:
    def chat(**fields: Any) -> ChatInput:
        body = {"model": "m", "max_tokens": 8000, "messages": HI, **fields}
        return to_input(MessagesRequest.model_validate(body), 8000)

    assert chat().template_kwargs == {"enable_thinking": False}  # not asked to think
    adaptive = chat(thinking={"type": "adaptive"}, output_config={"effort": "low"})
    assert adaptive.template_kwargs == {"enable_thinking": True}
    assert adaptive.sampling.max_reasoning_tokens == REASONING_EFFORT["low"]
    assert chat(thinking={"type": "adaptive"}, output_config={"effort": "max"}
                ).sampling.max_reasoning_tokens is None
    budget = chat(thinking={"type": "enabled", "budget_tokens": 2000},
                  output_config={"effort": "low"})
    assert budget.sampling.max_reasoning_tokens == 2000


class _Words:
    """A tokenizer of one token per word, and no chat template of its own."""

    def __len__(self) -> int:
        return 1000

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, **kwargs):
        return " ".join(str(m["content"]) for m in messages)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(w) for w in text.split()]


def test_errors_name_the_messages_parameters() -> None:
    def refused(**fields: Any) -> str | None:
        body = MessagesRequest.model_validate({"model": "m", "max_tokens": 8,
                                               "messages": HI, **fields})

        def validate(ids, params) -> None:
            if params.max_reasoning_tokens is not None and params.max_reasoning_tokens > 100:
                raise InvalidRequestError("too many", "max_reasoning_tokens")
        with pytest.raises(APIError) as e:
            plan_chat(to_input(body, 8), GatewayTokenizer(_Words()),
                      EngineFacts(1000, validate), None)
        assert e.value.status == 400
        return e.value.param

    result = [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]
    assert refused(messages=[*HI, {"role": "assistant", "content": "ok"},
                             {"role": "user", "content": result}]
                   ) == "messages[2].content[0].tool_use_id"
    assert refused(tools=[{**WEATHER, "input_schema": {"type": "nope"}}]
                   ) == "tools[0].input_schema"
    assert refused(tools=[WEATHER, WEATHER]) == "tools[1].name"
    assert refused(tools=[WEATHER], tool_choice={"type": "any"}, output_config={
        "format": {"type": "json_schema", "schema": {"type": "object"}}}
                   ) == "output_config.format"
    assert refused(thinking={"type": "enabled", "budget_tokens": 101},
                   max_tokens=200) == "thinking.budget_tokens"
    assert refused(tool_choice={"type": "tool"}) == "tool_choice.name"
    for status, code, kind, shown in [(400, None, "invalid_request_error", 400),
                                      (401, "invalid_api_key", "authentication_error", 401),
                                      (403, None, "permission_error", 403),
                                      (404, None, "not_found_error", 404),
                                      (413, None, "request_too_large", 413),
                                      (429, "rate_limit_exceeded", "rate_limit_error", 429),
                                      (429, "queue_full", "overloaded_error", 529),
                                      (503, "engine_failed", "overloaded_error", 529),
                                      (500, "engine_error", "api_error", 500)]:
        got, body = anthropic_error(APIError(status, "why", param="p", code=code))
        assert (got, body) == (shown, {"type": "error", "error": {"type": kind,
                                                                   "message": "p: why"}})


def test_examples_agent_messages_runs_against_the_server(server: GatewayServer) -> None:
    out = subprocess.run(
        [sys.executable, "examples/agent_messages.py", "--base-url", server.url,
         "--api-key", server.api_key, "--max-steps", "2", "--max-tokens", "64",
         "What is 12 * 7?"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "calculator(" in out.stderr or "clock(" in out.stderr  # at least one tool ran


def test_a_prefill_is_continued(server: GatewayServer) -> None:
    """An assistant turn last is continued, as Anthropic's API does: greedy, the reply to a
    prefill of the first words of the free reply is the rest of that reply."""
    kw = {"model": server.model, "max_tokens": 24, "temperature": 0}
    free = create(client(server), **kw, messages=HI).content[0].text
    words = free.split(" ")
    head = " ".join(words[:3])
    m = create(client(server), **kw, messages=[*HI, {"role": "assistant", "content": head}])
    rest = m.content[0].text
    assert rest and free.startswith(head + rest[:20]), (free, head, rest)
    # The chat API's own name for it (vLLM's), refused where it cannot apply.
    chat = httpx.post(server.base_url + "/chat/completions", timeout=300,
                      headers={"Authorization": f"Bearer {ALPHA}"},
                      json={**kw, "messages": HI, "continue_final_message": True})
    assert chat.status_code == 400 and "assistant message last" in chat.text
