"""Issue "Hardening, round two", items 9a-9d: sampling parameters within bounds, each refusal a
400 in OpenAI's error shape naming the parameter, on chat completions, completions and the
Responses API wherever the field exists: `stop_token_ids` (at most 1,024, each in the model's
vocabulary), finite sampling floats (NaN and Infinity are never numbers), `text.format` an
object; and error bodies bounded whatever the input (the first problems and a count of the
rest, nothing of the input echoed whole). The helpers first (fast), then over real HTTP against
the shared `gateway_server` and with the openai SDK where it can send the value."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import openai
import pytest
from pydantic import ValidationError

from engine.sampling.params import InvalidRequestError, SamplingParams
from gateway.access.bounds import MAX_MESSAGES, MAX_STOP_TOKEN_IDS, check_counts
from gateway.errors import MAX_MESSAGE_CHARS, MAX_PROBLEMS, APIError, bad_request, from_pydantic
from gateway.openai.schemas import ChatCompletionRequest
from gateway.responses.items import ResponsesRequest
from tests.conftest import GatewayServer

INF, NAN = math.inf, math.nan
HI = [{"role": "user", "content": "hi"}]
MAX_ERROR_BYTES = 8 * 1024


def refusal(schema: type, body: dict) -> APIError:
    with pytest.raises(ValidationError) as e:
        schema.model_validate_json(json.dumps(body))  # json.dumps writes NaN and Infinity
    return from_pydantic(e.value)


# -- the helpers ----------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty",
                                   "frequency_penalty", "repetition_penalty"])
@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_schema_and_sampling_params_refuse_non_finite(field: str, value: float) -> None:
    err = refusal(ChatCompletionRequest, {"model": "m", "messages": HI, field: value})
    assert (err.status, err.param) == (400, field), err.message
    with pytest.raises(InvalidRequestError) as e:  # the offline API's own check
        SamplingParams(**{field: value})
    assert e.value.param == field


def test_repetition_penalty_is_positive_and_finite() -> None:
    assert SamplingParams(repetition_penalty=1e6).repetition_penalty == 1e6  # vLLM: any > 0
    for bad in (0.0, -1.0):
        with pytest.raises(InvalidRequestError, match="repetition_penalty"):
            SamplingParams(repetition_penalty=bad)
    assert refusal(ChatCompletionRequest, {"model": "m", "messages": HI,
                                           "logit_bias": {"5": NAN}}).param == "logit_bias.5"


def test_stop_token_ids_are_counted_before_validation() -> None:
    check_counts({"stop_token_ids": [0] * MAX_STOP_TOKEN_IDS})
    with pytest.raises(APIError) as e:
        check_counts({"stop_token_ids": [0] * (MAX_STOP_TOKEN_IDS + 1)})
    assert (e.value.param, e.value.code) == ("stop_token_ids", "array_above_max_length")


def test_responses_input_is_counted_before_validation() -> None:
    check_counts({"input": [{}] * MAX_MESSAGES})
    check_counts({"input": "x" * (MAX_MESSAGES + 1)})  # a string: one message
    with pytest.raises(APIError) as e:
        check_counts({"input": [{}] * (MAX_MESSAGES + 1)})
    assert (e.value.param, e.value.code) == ("input", "array_above_max_length")


def test_text_format_must_be_an_object() -> None:
    for fmt in ("json_object", 5, ["json_object"]):
        err = refusal(ResponsesRequest, {"model": "m", "text": {"format": fmt}})
        assert err.param == "text.format" and "object" in err.message, err.message
    body = ResponsesRequest.model_validate({"model": "m", "text": {"format": {
        "type": "json_object"}}})
    assert body.text_format == {"type": "json_object"}
    assert ResponsesRequest.model_validate({"model": "m"}).text_format == {"type": "text"}


def test_many_problems_list_the_first_and_count_the_rest() -> None:
    bias = {str(i): "x" for i in range(1000)}
    err = refusal(ChatCompletionRequest, {"model": "m", "messages": HI, "logit_bias": bias})
    assert err.param == "logit_bias.0"
    assert err.message.startswith("The request has 1000 invalid values")
    assert err.message.count("Input should be a valid number") == MAX_PROBLEMS
    assert f"and {1000 - MAX_PROBLEMS} more." in err.message
    # A union's members report one value once: the member the client meant.
    content = {"model": "m", "messages": [{"role": "user", "content": [{"type": "image"}]}]}
    err = refusal(ChatCompletionRequest, content)
    assert err.param == "messages[0].content[0]" and "not supported" in err.message
    assert not err.message.startswith("The request has")


def test_no_error_echoes_the_input_whole() -> None:
    key = "k" * 100_000
    err = refusal(ChatCompletionRequest, {"model": "m", "messages": HI, "logit_bias": {key: "x"}})
    assert len(err.message) < 300 and len(err.param or "") < 100
    kind = "t" * 100_000
    err = refusal(ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "user", "content": [{"type": kind}]}]})
    assert len(err.message) < 300
    assert len(bad_request("x" * 10**6, "p" * 10**6).body().__str__()) < MAX_MESSAGE_CHARS + 600


# -- over HTTP ------------------------------------------------------------------------------


def post(server: GatewayServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, content=json.dumps(body).encode(), timeout=120,
                      headers={"Authorization": f"Bearer {server.api_key}",
                               "Content-Type": "application/json"})


def error(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text[:500]
    e = r.json()["error"]
    assert e["type"] == "invalid_request_error" and {"message", "param", "code"} <= e.keys()
    return e


def chat(server: GatewayServer, **extra: object) -> dict:
    return {"model": server.model, "messages": HI, "max_tokens": 1, **extra}


def completion(server: GatewayServer, **extra: object) -> dict:
    return {"model": server.model, "prompt": "hi", "max_tokens": 1, **extra}


BAD = [  # (field, value): each refused on chat and text completions, naming `field`
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [10**20]),
    ("stop_token_ids", [0] * 200_000),
    ("stop_token_ids", [3, "3"]),
    ("repetition_penalty", INF),
    ("repetition_penalty", NAN),
    ("repetition_penalty", 0),
    ("temperature", NAN),
    ("top_p", INF),
    ("min_p", NAN),
    ("presence_penalty", -INF),
    ("frequency_penalty", NAN),
    ("top_k", 10**20),
    ("min_tokens", 10**20),
    ("max_tokens", 10**20),
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_bad_sampling_values_are_400s_naming_them(gateway_server: GatewayServer,
                                                  path: str) -> None:
    make = chat if path == "/v1/chat/completions" else completion
    for field, value in BAD:
        e = error(post(gateway_server, path, make(gateway_server, **{field: value})))
        assert e["param"] in (field, f"{field}[1]"), (field, e)
        assert len(e["message"]) < 500, e
    assert post(gateway_server, path, make(gateway_server)).status_code == 200


def test_responses_sampling_and_text_format(gateway_server: GatewayServer) -> None:
    base = {"model": gateway_server.model, "input": "hi", "max_output_tokens": 1,
            "store": False}
    for field, value in [("temperature", NAN), ("top_p", INF), ("temperature", INF),
                         ("max_output_tokens", 10**20)]:
        e = error(post(gateway_server, "/v1/responses", {**base, field: value}))
        assert e["param"] == field, (field, e)
    for fmt in ("json_object", "json_schema", 1):
        e = error(post(gateway_server, "/v1/responses", {**base, "text": {"format": fmt}}))
        assert e["param"] == "text.format" and "object" in e["message"], e
    ok = post(gateway_server, "/v1/responses", {**base, "text": {"format": {"type": "text"}}})
    assert ok.status_code == 200 and ok.json()["status"] in ("completed", "incomplete")


def test_stop_token_ids_at_the_vocabulary_edge(gateway_server: GatewayServer,
                                               smollm2_dir: Path) -> None:
    vocab = json.loads((smollm2_dir / "config.json").read_text())["vocab_size"]
    for path, make in [("/v1/chat/completions", chat), ("/v1/completions", completion)]:
        ok = post(gateway_server, path, make(gateway_server, stop_token_ids=[0, vocab - 1]))
        assert ok.status_code == 200, ok.text[:500]
        e = error(post(gateway_server, path, make(gateway_server, stop_token_ids=[vocab])))
        assert e["param"] == "stop_token_ids" and str(vocab) in e["message"], e
    top = [vocab - 1] * MAX_STOP_TOKEN_IDS  # the count at its bound is fine too
    assert post(gateway_server, "/v1/completions",
                completion(gateway_server, stop_token_ids=top)).status_code == 200


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x",
                                            "tool_calls": [1] * 100_000}]}),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {str(i): "x" for i in range(100_000)}}),
    ("/v1/responses", {"input": "hi", "metadata": {str(i): 1 for i in range(100_000)}}),
], ids=["chat", "completions", "responses"])
def test_an_error_body_for_100k_bad_entries_is_small(gateway_server: GatewayServer, path: str,
                                                     body: dict) -> None:
    r = post(gateway_server, path, {"model": gateway_server.model, **body})
    e = error(r)
    assert len(r.content) < MAX_ERROR_BYTES, len(r.content)
    assert "100000 invalid values" in e["message"] and "99990 more" in e["message"], e
    assert e["message"].count("Invalid value for") == MAX_PROBLEMS
    assert post(gateway_server, "/v1/chat/completions", chat(gateway_server)).status_code == 200


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": HI, "logit_bias": {"x" * 100_000: 1}},
     "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "t" * 100_000}]}]}, "messages[0].content[0]"),
    ("/v1/responses", {"input": [{"type": "t" * 100_000}]}, "input[0].type"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "t" * 100_000}}},
     "text.format.type"),
], ids=["logit_bias_key", "content_type", "item_type", "format_type"])
def test_no_error_echoes_a_huge_value(gateway_server: GatewayServer, path: str, body: dict,
                                      param: str) -> None:
    r = post(gateway_server, path, {"model": gateway_server.model, "max_tokens": 1, **body})
    e = error(r)
    assert e["param"] == param and len(r.content) < 1000, r.text[:1000]


def test_the_sdk_gets_the_same_400s(gateway_server: GatewayServer) -> None:
    client = openai.OpenAI(base_url=gateway_server.base_url, api_key=gateway_server.api_key,
                           max_retries=0)
    for extra, param in [({"stop_token_ids": [-1]}, "stop_token_ids"),
                         ({"stop_token_ids": [10**20]}, "stop_token_ids"),
                         ({"repetition_penalty": -1}, "repetition_penalty")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=gateway_server.model, messages=HI,
                                           max_tokens=1, extra_body=extra)
        assert e.value.param == param, e.value.body
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=gateway_server.model, prompt="hi", max_tokens=1,
                                      extra_body=extra)
        assert e.value.param == param, e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=gateway_server.model, input="hi", max_output_tokens=1,
                                text={"format": "json_object"})  # a string: the SDK sends it
    assert e.value.param == "text.format"
    reply = client.chat.completions.create(model=gateway_server.model, messages=HI, max_tokens=1)
    assert reply.choices[0].finish_reason in ("length", "stop")
