"""Tenant isolation matrix on the shared `gateway_server`: tenant B (beta) cannot list, read,
use, fork or delete tenant A's (alpha's) adapters and sessions, and gets the very 404 it gets
for objects that never existed (never a 403, which would confirm they exist); B's identical
prompt never hits A's prefix cache; a missing or wrong key is a 401 on every authenticated
route of the OpenAPI document, before anything about the object is looked up."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
from openai import OpenAI

from tests.conftest import GatewayServer
from tests.lora_files import adapter

A, B = "sk-test-alpha", "sk-test-beta"
ADAPTER = "alpha-private"
UNKNOWN_ADAPTER, UNKNOWN_SESSION = "never-uploaded", "sess_" + "0" * 32
OPEN_ROUTES = {("GET", "/health"), ("GET", "/ready")}  # /metrics takes an admin key


def http(server: GatewayServer, method: str, path: str, key: str | None = A,
         **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, server.url + path, headers=headers, timeout=120, **kw)


def client(server: GatewayServer, key: str) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def alpha_objects(gateway_server: GatewayServer) -> Iterator[tuple[str, str]]:
    """Alpha's adapter and session (deleted afterwards)."""
    files = [("files", f) for f in adapter()]
    r = http(gateway_server, "POST", "/v1/adapters", data={"name": ADAPTER}, files=files)
    assert r.status_code == 200, r.text
    r = http(gateway_server, "POST", "/v1/sessions", json={
        "model": gateway_server.model, "messages": [{"role": "system", "content": "Be brief."}]})
    assert r.status_code == 200, r.text
    session = r.json()["id"]
    yield ADAPTER, session
    http(gateway_server, "DELETE", f"/v1/adapters/{ADAPTER}")
    http(gateway_server, "DELETE", f"/v1/sessions/{session}")


def assert_same_404(server: GatewayServer, method: str, path: str, mine: str, unknown: str,
                    body: Callable[[str], dict] | None = None) -> None:
    """B's answer about A's object `mine` equals its answer about `unknown`, names swapped.
    `path` and `body` name the object through `{}` and a function of it."""
    theirs, never = (http(server, method, path.format(x), B, json=body(x) if body else None)
                     for x in (mine, unknown))
    assert theirs.status_code == never.status_code == 404, (path, theirs.text)
    assert theirs.text.replace(mine, unknown) == never.text


def test_adapters_of_another_tenant_are_404(gateway_server: GatewayServer,
                                            alpha_objects: tuple[str, str]) -> None:
    name, _ = alpha_objects
    base = gateway_server.model
    for listing in ("/v1/adapters", "/v1/models"):
        data = http(gateway_server, "GET", listing, B).json()["data"]
        assert name not in [a["id"] for a in data]
    assert_same_404(gateway_server, "GET", "/v1/adapters/{}", name, UNKNOWN_ADAPTER)
    assert_same_404(gateway_server, "GET", "/v1/models/{}", name, UNKNOWN_ADAPTER)
    assert_same_404(gateway_server, "DELETE", "/v1/adapters/{}", name, UNKNOWN_ADAPTER)
    assert_same_404(gateway_server, "DELETE", "/v1/adapters/{}", f"{base}:{name}",
                    f"{base}:{UNKNOWN_ADAPTER}")
    for model in (name, f"{base}:{name}"):
        for path, body in [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                      "max_tokens": 1}),
            ("/v1/completions", {"prompt": "x", "max_tokens": 1}),
            ("/v1/sessions", {}),
        ]:
            assert_same_404(gateway_server, "POST", path, model,
                            model.replace(name, UNKNOWN_ADAPTER),
                            lambda m, body=body: {"model": m, **body})
    # Still alpha's, and still served to alpha.
    assert http(gateway_server, "GET", f"/v1/adapters/{name}").status_code == 200
    reply = client(gateway_server, A).chat.completions.create(
        model=name, messages=[{"role": "user", "content": "x"}], max_tokens=1)
    assert reply.choices[0].finish_reason == "length"


def test_sessions_of_another_tenant_are_404(gateway_server: GatewayServer,
                                            alpha_objects: tuple[str, str]) -> None:
    _, session = alpha_objects
    before = http(gateway_server, "GET", f"/v1/sessions/{session}").json()
    for method, path, body in [
        ("GET", "/v1/sessions/{}", None),
        ("POST", "/v1/sessions/{}/fork", lambda _: {"message_index": 0}),
        ("DELETE", "/v1/sessions/{}", None),
    ]:
        assert_same_404(gateway_server, method, path, session, UNKNOWN_SESSION, body)
    turn = {"model": gateway_server.model, "max_tokens": 1,
            "messages": [{"role": "user", "content": "What did alpha say?"}]}
    for sid in (session, UNKNOWN_SESSION):
        r = http(gateway_server, "POST", "/v1/chat/completions", B,
                 json={**turn, "session_id": sid})
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    with pytest.raises(openai.NotFoundError):  # the SDK path too
        client(gateway_server, B).chat.completions.create(
            **turn, extra_body={"session_id": session})
    assert http(gateway_server, "GET", f"/v1/sessions/{session}").json() == before


def test_prefix_cache_is_per_tenant_and_adapter(gateway_server: GatewayServer,
                                                alpha_objects: tuple[str, str]) -> None:
    """Identical prompts share KV only within one (tenant, adapter): B's repeat of A's prompt
    computes everything (no hit, so no timing difference to observe either)."""
    name, _ = alpha_objects
    words = " ".join(f"item{i}" for i in range(60))
    # A fresh first page (the template's own preamble would be cached from earlier requests).
    prompt = [{"role": "system", "content": f"{uuid.uuid4().hex} Sort what you get."},
              {"role": "user", "content": words}]

    def cached(key: str, model: str = gateway_server.model) -> int:
        r = client(gateway_server, key).chat.completions.create(
            model=model, messages=prompt, max_tokens=1, temperature=0)
        assert r.usage.prompt_tokens > 100
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached(A) == 0
    assert cached(A) > 64  # A's own repeat hits its cache...
    assert cached(B) == 0  # ...B's does not
    assert cached(A, name) == 0  # nor does A's through another adapter
    assert cached(B) > 64  # B's repeat hits B's own


def test_missing_or_wrong_key_is_401_everywhere(gateway_server: GatewayServer,
                                                 alpha_objects: tuple[str, str]) -> None:
    """Every route the document marks as authenticated refuses a missing, wrong or
    malformed key, even for an object that exists; the others are exactly the probes."""
    name, session = alpha_objects
    doc = httpx.get(gateway_server.url + "/openapi.json").json()
    params = {"name": name, "session_id": session, "model": name, "response_id": "resp_1",
              "cid": "conv_1", "item_id": "msg_1"}
    open_routes = set()
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            if "authorization" not in [p["name"] for p in op.get("parameters", [])]:
                open_routes.add((method.upper(), path))
                continue
            url = gateway_server.url + path.format(**params)
            for headers in [{}, {"Authorization": "Bearer sk-wrong"},
                            {"Authorization": A}, {"Authorization": f"Basic {A}"},
                            {"x-api-key": "sk-wrong"}]:
                r = httpx.request(method, url, headers=headers, json={}, timeout=30)
                assert r.status_code == 401, (method, path, headers, r.text)
                if path.startswith("/v1/messages"):  # Anthropic's shape
                    assert r.json()["error"]["type"] == "authentication_error"
                else:
                    assert r.json()["error"]["code"] == "invalid_api_key"
                assert r.headers["WWW-Authenticate"] == "Bearer"
    assert open_routes == OPEN_ROUTES
