"""Issue 16, the gateway's part: a big request is planned off the event loop and within bounds
(/health stays live; over a bound, a 400 naming it), tenant limits come before planning,
/metrics needs an admin key, JSON and session errors say what is wrong without echoing a
megabyte back, a tool reply without text has `content: null`, an unknown route names itself
and the routes there are. Mostly against the shared `gateway_server` (tests/conftest.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from test_sessions import redis_server, redis_url  # noqa: F401 - module-scoped fixtures

from gateway.access.auth import Authenticator, SharedKeys
from gateway.access.bounds import MAX_MESSAGES, MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH, MAX_TOOLS
from gateway.access.limits import Seats
from gateway.app import create_app
from gateway.cli import add_serve_parser, config_from_args
from gateway.config import ConfigError, ServeConfig, build_config
from gateway.errors import APIError
from gateway.openai.params import EngineFacts, plan_completion
from gateway.openai.schemas import CompletionRequest
from gateway.openai.tokenizer import GatewayTokenizer
from tests.conftest import GatewayServer

ALPHA, BETA, OPS = "sk-test-alpha", "sk-test-beta", "sk-test-ops"  # ops: an admin key
HI = [{"role": "user", "content": "hi"}]
HEALTH_S = 1.0  # the slowest /health answer allowed while a big request is planned


def nested(depth: int) -> dict:
    """An object schema `depth` objects deep (2 * depth + 1 levels of JSON)."""
    schema: dict = {"type": "string"}
    for i in range(depth):
        schema = {"type": "object", "properties": {f"k{i}": schema}, "required": [f"k{i}"]}
    return schema


def tools(n: int, depth: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{i}", "description": "d",
                                              "parameters": nested(depth)}} for i in range(n)]


def chat(server: GatewayServer, **extra) -> dict:
    return {"model": server.model, "messages": HI, "max_tokens": 1, **extra}


def post(server: GatewayServer, body: dict | bytes, key: str = ALPHA,
         path: str = "/v1/chat/completions") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, timeout=120,
                      headers={"Authorization": f"Bearer {key}",
                               "Content-Type": "application/json"})


def health_while(server: GatewayServer, body: dict) -> tuple[httpx.Response, float, int]:
    """(the response to `body`, the slowest /health answer while it ran, how many answered)."""
    async def main() -> tuple[httpx.Response, float, int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            big = asyncio.create_task(c.post(
                "/v1/chat/completions", content=json.dumps(body).encode(),
                headers={"Authorization": f"Bearer {ALPHA}", "Content-Type": "application/json"}))
            await asyncio.sleep(0.05)  # sent
            slowest, probes = 0.0, 0
            while not big.done():
                t0 = time.monotonic()
                assert (await c.get("/health")).status_code == 200
                slowest, probes = max(slowest, time.monotonic() - t0), probes + 1
                await asyncio.sleep(0.02)
            return await big, slowest, probes

    return asyncio.run(main())


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text[:500]
    return r.json()["error"]


# -- item 4: planning off the event loop, within bounds, after admission -----------------------


def test_health_stays_live_while_big_tools_are_planned(gateway_server: GatewayServer) -> None:
    """100 tools nested 10 deep (72 KB: within every bound) cost about a second of schema checks
    and template work, in a worker thread; before, it ran on the loop, 3 times over."""
    body = chat(gateway_server, tools=tools(100, 10))
    assert len(json.dumps(body["tools"])) < MAX_SCHEMA_BYTES
    r, slowest, probes = health_while(gateway_server, body)
    assert error(r, 400)["param"] == "messages"  # then too long for the 2,560-token context
    assert probes >= 1 and slowest < HEALTH_S, (probes, slowest)


def test_health_stays_live_under_100k_messages(gateway_server: GatewayServer) -> None:
    body = chat(gateway_server, messages=HI * 100_000)  # 3.4 MB
    r, slowest, _ = health_while(gateway_server, body)
    assert slowest < HEALTH_S and r.elapsed.total_seconds() < 5, slowest
    e = error(r, 400)
    assert e["param"] == "messages" and e["code"] == "array_above_max_length"
    assert str(MAX_MESSAGES) in e["message"]


@pytest.mark.parametrize("case", ["tools", "messages", "tools_bytes", "depth", "schema",
                                  "prompt", "completion"])
def test_over_a_bound_is_a_400_naming_it(gateway_server: GatewayServer, case: str) -> None:
    s = gateway_server
    prop = {"type": "integer"}
    big_schema = {"type": "object", "properties": {f"p{i}": prop for i in range(20_000)}}
    cases = {  # body, path, param, code, what the message names
        "tools": (chat(s, tools=tools(MAX_TOOLS + 1, 1)), "tools", "array_above_max_length",
                  str(MAX_TOOLS)),
        "messages": (chat(s, messages=HI * (MAX_MESSAGES + 1)), "messages",
                     "array_above_max_length", str(MAX_MESSAGES)),
        "tools_bytes": (chat(s, tools=tools(100, 30)), "tools", "schema_too_large",
                        str(MAX_SCHEMA_BYTES)),
        "depth": (chat(s, tools=tools(1, MAX_SCHEMA_DEPTH)), "tools[0].function.parameters",
                  "schema_too_large", str(MAX_SCHEMA_DEPTH)),
        "schema": (chat(s, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": big_schema}}), "response_format", "schema_too_large",
                   str(MAX_SCHEMA_BYTES)),
        "prompt": (chat(s, messages=[{"role": "user", "content": "word " * 650_000}]),
                   "messages", "context_length_exceeded", "2560 tokens"),
        "completion": ({"model": s.model, "prompt": "word " * 650_000, "max_tokens": 1},
                       "prompt", "context_length_exceeded", "2560 tokens"),
    }
    body, param, code, names = cases[case]
    path = "/v1/completions" if case == "completion" else "/v1/chat/completions"
    r = post(s, body, path=path)
    e = error(r, 400)
    assert (e["param"], e["code"]) == (param, code) and names in e["message"], e
    assert r.elapsed.total_seconds() < 5  # refused before the slow work


def test_tenant_limits_come_before_planning(gateway_server: GatewayServer) -> None:
    """beta runs one request at a time: while one streams, another is a 429 at once, however
    big (before, it was planned first: a 400 after seconds of work). A refused plan releases
    the tenant's slot."""
    s = gateway_server
    huge = chat(s, messages=[{"role": "user", "content": "word " * 650_000}])
    stream = {**chat(s, max_tokens=400, ignore_eos=True), "stream": True}
    with httpx.Client(timeout=120) as http, http.stream(
            "POST", s.url + "/v1/chat/completions", json=stream,
            headers={"Authorization": f"Bearer {BETA}"}) as held:
        lines = held.iter_lines()
        while not next(lines).startswith("data:"):
            pass
        assert error(post(s, huge, BETA), 429)["code"] == "concurrency_limit_exceeded"
    deadline = time.monotonic() + 30
    while (r := post(s, huge, BETA)).status_code == 429:  # the stream's slot is freed
        assert time.monotonic() < deadline, r.text
        time.sleep(0.1)
    assert error(r, 400)["code"] == "context_length_exceeded"
    assert error(post(s, chat(s, tools=[{"type": "nope"}]), BETA), 400)["param"] == "tools[0].type"
    assert error(post(s, chat(s, max_tokens=2600), BETA), 400)["param"] == "max_tokens"
    assert post(s, chat(s), BETA).status_code == 200  # no slot leaked by the three refusals


def test_seats_count_requests_being_planned() -> None:
    """Between its capacity check and its submission a request is planned off the loop:
    requests admitted meanwhile see its sequences as taken."""
    seats = Seats(lambda: 1, max_num_seqs=2, max_queue=1)
    with seats.reserve(2):
        with pytest.raises(APIError) as e, seats.reserve(1):
            pass
        assert e.value.code == "queue_full"
    with seats.reserve(2):
        assert seats.planning == 2
    assert seats.planning == 0


# -- item 6: /metrics, JSON errors, echoed ids, max_tokens ------------------------------------


def test_metrics_need_an_admin_key(gateway_server: GatewayServer) -> None:
    url = gateway_server.url + "/metrics"
    assert error(httpx.get(url), 401)["code"] == "invalid_api_key"
    assert error(httpx.get(url, headers={"Authorization": "Bearer sk-wrong"}), 401)
    e = error(httpx.get(url, headers={"Authorization": f"Bearer {ALPHA}"}), 403)
    assert e["code"] == "permission_denied" and "admin" in e["message"]
    r = httpx.get(url, headers={"Authorization": f"Bearer {OPS}"})
    assert r.status_code == 200 and "switchboard_requests_total" in r.text


def test_public_metrics_flag_and_admin_keys_file(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-a": "alpha", "sk-ops": {"tenant": "alpha", "admin": True},
                                "sk-b": {"tenant": "beta", "tokens_per_minute": 9}}))
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    cfg = config_from_args(parser.parse_args(["serve", "--api-keys", str(keys)]))
    assert cfg.admin_keys == {"sk-ops"} and not cfg.public_metrics
    assert "alpha" not in cfg.tenants  # an admin key alone sets no limits
    cfg = config_from_args(parser.parse_args(["serve", "--api-keys", str(keys),
                                              "--public-metrics"]))
    assert cfg.public_metrics
    keys.write_text(json.dumps({"sk-ops": {"tenant": "ops", "admin": "yes"}}))
    with pytest.raises(ConfigError, match="admin"):
        build_config(api_keys=str(keys))

    async def scrape(config: ServeConfig, key: str | None) -> int:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        transport = httpx.ASGITransport(app=create_app(config))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            return (await c.get("/metrics", headers=headers)).status_code

    locked = ServeConfig(api_keys={"sk-a": "a", "sk-ops": "ops"}, admin_keys={"sk-ops"})
    assert asyncio.run(scrape(locked, None)) == 401
    assert asyncio.run(scrape(locked, "sk-a")) == 403
    assert asyncio.run(scrape(locked, "sk-ops")) == 200
    assert asyncio.run(scrape(locked.model_copy(update={"public_metrics": True}), None)) == 200
    assert asyncio.run(scrape(ServeConfig(), None)) == 200  # no keys: open, as before


def test_admin_keys_are_shared_through_redis(redis_url: str) -> None:  # noqa: F811
    import redis.asyncio as aioredis

    keys = {"sk-a": "alpha", "sk-ops": "ops"}

    async def main() -> Authenticator:
        r = aioredis.Redis.from_url(redis_url, decode_responses=True)
        await SharedKeys(r, Authenticator(keys), None).publish(keys, {}, {"sk-ops"})
        reader = Authenticator(None, waiting=True)  # a replica without --api-keys
        with pytest.raises(APIError) as e:
            reader.require_admin("Bearer sk-ops")
        assert e.value.status == 503
        await SharedKeys(r, reader, None).refresh()
        await r.aclose()
        return reader

    reader = asyncio.run(main())
    reader.require_admin("Bearer sk-ops")
    for header, status in [("Bearer sk-a", 403), (None, 401), ("Bearer sk-x", 401)]:
        with pytest.raises(APIError) as e:
            reader.require_admin(header)
        assert e.value.status == status


@pytest.mark.parametrize("raw, code, needle", [
    (b'{"model": "m", "x": ' + b"[" * 300 + b"]" * 300 + b"}", "json_too_deep", "200 levels"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\\udc00"}]}', "invalid_json",
     "surrogate"),
    (b'{"model": "m",', "invalid_json", "EOF while parsing"),
])
def test_json_errors_say_what_is_wrong(gateway_server: GatewayServer, raw: bytes, code: str,
                                       needle: str) -> None:
    e = error(post(gateway_server, raw), 400)
    assert e["code"] == code and needle in e["message"], e


def test_a_huge_session_id_is_not_echoed(gateway_server: GatewayServer) -> None:
    sid = "s" * 1_000_000
    e = error(post(gateway_server, chat(gateway_server, session_id=sid)), 404)
    assert e["code"] == "session_not_found" and len(e["message"]) < 200
    assert "s" * 64 + "…" in e["message"]


def test_max_tokens_defaults_to_4096_within_the_context() -> None:
    assert build_config().default_max_tokens == ServeConfig().default_max_tokens == 4096

    class Vocab:
        def __len__(self) -> int:
            return 1000

    def plan(max_model_len: int, prompt_len: int) -> int:
        body = CompletionRequest(model="m", prompt=[1] * prompt_len)
        facts = EngineFacts(max_model_len, lambda ids, p: None, ServeConfig().default_max_tokens)
        jobs = plan_completion(body, GatewayTokenizer(Vocab()), facts, None).jobs
        return jobs[0].params.max_tokens

    assert plan(32768, 10) == 4096
    assert plan(2560, 10) == 2550  # what is left of the context


# -- item 7: what clients ran into --------------------------------------------------------------


def test_a_tool_reply_without_text_has_null_content(gateway_server: GatewayServer) -> None:
    """Eight tokens under tool_choice "required" are the start of a call: no text, no
    complete call, `finish_reason: "length"`, and `content` null (it was "")."""
    client = OpenAI(base_url=gateway_server.base_url, api_key=ALPHA, max_retries=0, timeout=120)
    add = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
    kwargs = dict(model=gateway_server.model, tools=[add], tool_choice="required", max_tokens=8,
                  messages=[{"role": "user", "content": "Add 2 and 3."}], temperature=0)
    reply = client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content is None
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert all(c.choices[0].delta.content is None for c in chunks if c.choices)


def test_unknown_routes_and_methods_name_the_route(gateway_server: GatewayServer) -> None:
    url = gateway_server.url
    e = error(httpx.post(url + "/v1/embeddings", json={}), 404)
    assert e["code"] == "unknown_route" and "POST /v1/embeddings" in e["message"]
    assert "POST /v1/chat/completions" in e["message"] and "model" not in e["code"]
    e = error(httpx.post(url + "/chat/completions", json={}), 404)  # base URL without /v1
    assert "Did you mean /v1/chat/completions?" in e["message"]
    r = httpx.get(url + "/v1/chat/completions")
    e = error(r, 405)
    assert e["code"] == "method_not_allowed" and "use POST" in e["message"]
    assert r.headers["Allow"] == "POST"
