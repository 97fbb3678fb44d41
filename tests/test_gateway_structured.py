"""response_format and vLLM's structured_outputs through the HTTP API with the openai SDK."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import jsonschema
import openai
import pytest
from openai import OpenAI

if TYPE_CHECKING:
    from tests.conftest import GatewayServer

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Give me a person as JSON."}]


@pytest.fixture(scope="module")
def client(gateway_server: GatewayServer) -> OpenAI:
    return OpenAI(
        base_url=gateway_server.base_url, api_key=gateway_server.api_key, max_retries=0, timeout=300
    )


def test_json_schema_response_validates(client: OpenAI, gateway_server: GatewayServer) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    waits = gateway_server.metrics().get("switchboard_grammar_wait_seconds_count", 0)
    r = client.chat.completions.create(
        model=gateway_server.model, messages=ASK, response_format=fmt, max_tokens=60, seed=7
    )
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length")
    if choice.finish_reason == "stop":
        jsonschema.validate(json.loads(choice.message.content), PERSON)

    # Streamed at temperature 0 equals the non-streamed answer.
    kw = dict(model=gateway_server.model, messages=ASK, response_format=fmt, max_tokens=60)
    plain = client.chat.completions.create(temperature=0, **kw).choices[0].message.content
    parts = client.chat.completions.create(temperature=0, stream=True, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == plain
    # Each of the three requests waited for its grammar (the first for its compile).
    assert gateway_server.metrics()["switchboard_grammar_wait_seconds_count"] == waits + 3


def test_vllm_structured_outputs_choice(client: OpenAI, gateway_server: GatewayServer) -> None:
    r = client.completions.create(
        model=gateway_server.model,
        prompt="Is the sky blue? Answer:",
        max_tokens=5,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "fmt, needle",
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}, "schema"),
        ({"type": "regex"}, "regex"),
        ({"type": "grammar", "grammar": "root ::= ("}, "grammar"),
        ({"type": "bogus"}, "bogus"),
        # Compile, but no output satisfies them: a 400 naming why, not a 500 mid-generation.
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}}, "satisfy"),
        ({"type": "regex", "regex": r"[^\x00-\x{10FFFF}]"}, "satisfy"),
        ({"type": "grammar", "grammar": "root ::= a\na ::= b\nb ::= a"}, "satisfy"),
    ],
)
def test_bad_specs_are_400(client: OpenAI, gateway_server: GatewayServer, fmt, needle) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=gateway_server.model, messages=ASK, max_tokens=5, response_format=fmt
        )
    err = e.value.body
    assert err["type"] == "invalid_request_error"
    assert needle in err["message"].lower() or needle in (err.get("param") or "")
    # The server is fine afterwards.
    ok = client.chat.completions.create(model=gateway_server.model, messages=ASK, max_tokens=2)
    assert ok.choices[0].finish_reason == "length"


def _strict(text: str) -> object:
    """json.loads that refuses NaN and Infinity (JSON has neither)."""

    def refuse(constant: str) -> object:
        raise ValueError(f"{constant} in a response body")

    return json.loads(text, parse_constant=refuse)


def test_logprobs_of_masked_tokens_are_finite(gateway_server: GatewayServer) -> None:
    """Top logprobs under a constraint include tokens its mask banned (-inf): they are reported
    as -9999.0, as vLLM does, so bodies and stream events stay JSON (a 500 before)."""
    import httpx

    headers = {"Authorization": f"Bearer {gateway_server.api_key}"}
    only = {"structured_outputs": {"choice": ["yes", "no"]}, "max_tokens": 3, "temperature": 0,
            "model": gateway_server.model}
    bodies = {
        "/completions": {**only, "prompt": "Is the sky blue? Answer:", "logprobs": 5},
        "/chat/completions": {**only, "messages": [{"role": "user", "content": "Sky blue?"}],
                              "logprobs": True, "top_logprobs": 5},
    }
    for path, body in bodies.items():
        r = httpx.post(gateway_server.base_url + path, json=body, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        tops = _top_logprobs(_strict(r.text)["choices"][0]["logprobs"])  # type: ignore[index]
        assert -9999.0 in tops and all(-9999.0 <= v <= 0 for v in tops)
        with httpx.stream("POST", gateway_server.base_url + path, json={**body, "stream": True},
                          headers=headers, timeout=120) as s:
            events = [_strict(line[6:]) for line in s.iter_lines()
                      if line.startswith("data: {")]
        streamed = [v for e in events for c in e["choices"] if c.get("logprobs")  # type: ignore[index]
                    for v in _top_logprobs(c["logprobs"])]
        assert sorted(streamed) == pytest.approx(sorted(tops), abs=1e-3)


def _top_logprobs(lps: dict) -> list[float]:
    if "tokens" in lps:  # a completion's
        return [v for d in lps["top_logprobs"] for v in d.values()]
    return [t["logprob"] for e in lps["content"] for t in e["top_logprobs"]]
