"""Every operation of the server's own OpenAPI document, fuzzed with schemathesis (valid and
invalid inputs): never a 5xx (nor a server error inside an SSE stream), never a hang, and
every refusal in OpenAI's error JSON (Anthropic's on the Messages API). Against the shared
`gateway_server`."""

from __future__ import annotations

import json
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.generation.modes import GenerationMode

from gateway.app import create_app
from gateway.config import build_config
from tests.conftest import GatewayServer

EXAMPLES = 50  # per operation, half of them invalid on purpose
MAX_TOKENS = 2  # generation is real (SmolLM2 on CPU): keep every request a few steps long
MAX_N = 2
TIMEOUT_S = 60  # a request that takes longer counts as a hang
KEY = "sk-test-beta"  # one request at a time (sequential here); alpha's prefix cache stays cold

# The operations, read at collection time from the app's document (no server needed).
OPERATIONS = [(method.upper(), path)
              for path, ops in create_app(build_config()).openapi()["paths"].items()
              for method in ops]


@pytest.fixture(scope="module")
def openapi(gateway_server: GatewayServer) -> Any:
    """The document the running server serves."""
    return schemathesis.openapi.from_url(gateway_server.url + "/openapi.json")


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[" ".join(o) for o in OPERATIONS])
def test_no_server_errors_no_hangs(openapi: Any, gateway_server: GatewayServer, method: str,
                                   path: str) -> None:
    operation = openapi[path][method]
    auth = {"authorization": f"Bearer {KEY}"}
    cases = st.one_of(*(operation.as_strategy(mode, headers=auth) for mode in GenerationMode))

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def check(case: Any) -> None:
        _cap_generation(case.body, gateway_server.model)
        response = case.call(base_url=gateway_server.url, timeout=TIMEOUT_S)
        status = response.status_code
        assert status < 500, f"{status} for {case.method} {case.formatted_path}: {response.text}"
        anthropic = path.startswith("/v1/messages")
        if status >= 400:
            body = response.json()
            error = body["error"]
            assert isinstance(error["message"], str) and error["message"]
            if anthropic:  # Anthropic's shape
                assert body["type"] == "error" and error["type"].endswith("_error")
            else:
                assert {"type", "param", "code"} <= error.keys()
        if response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
            for line in response.text.splitlines():
                if line.startswith("data: {"):
                    chunk = json.loads(line.removeprefix("data: "))
                    kind = chunk.get("error", {}).get("type")
                    assert kind not in ("server_error", "api_error", "overloaded_error"), chunk

    check()


def _cap_generation(body: object, model: str) -> None:
    """Steer generated bodies past the checks the document cannot express (the served model
    as `model`, text-only content, content on every non-assistant message) and bound the work
    they ask for. Fields of other types stay as generated, so invalid values still reach the
    validators."""
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = model
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else []:
        if isinstance(message, dict) and message.get("role") != "assistant":
            content = message.get("content")
            if content is None or isinstance(content, list):
                message["content"] = "".join(
                    p["text"] for p in content or [] if isinstance(p, dict)
                    and isinstance(p.get("text"), str))
    generating = ("messages", "prompt", "input", "instructions", "previous_response_id",
                  "conversation")
    if not any(key in body for key in generating):
        return
    if "store" in body or "input" in body or "instructions" in body:
        body["store"] = False  # a stored response pins KV on the shared server between tests
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(key)
        if value is None or isinstance(value, int) and value > MAX_TOKENS:
            body[key] = MAX_TOKENS
    if isinstance(body.get("n"), int) and body["n"] > MAX_N:
        body["n"] = MAX_N
