"""Faults against the real server (the session's `gateway_server`, issue 9): overload is a 429
in milliseconds, also for a request whose grammar was never compiled; one request's failure
(an uploaded adapter damaged on disk, a grammar no backend compiles) fails it alone, in
OpenAI's error shape. (Aborted streams, Redis outage, SIGTERM: tests/test_faults_server.py.)"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import regex
from conftest import GatewayServer, busy_pages

from tests.tiny_models import save_peft_adapter

pytest.importorskip("peft")

# Our own system prompt: other tests on this shared server expect the chat template's default
# one to be absent from tenant alpha's prefix cache at first.
SYSTEM = {"role": "system", "content": "You are the faults test."}
CHAT = [SYSTEM, {"role": "user", "content": "Tell me a long story."}]


def _headers(server: GatewayServer, key: str | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key or server.api_key}"}


def _wait_idle(server: GatewayServer, timeout: float = 30) -> dict[str, float]:
    """Nothing running, queued or holding KV pages."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if busy_pages(m) <= 0 and (m["switchboard_running_batch_size"],
                                   m["switchboard_queue_depth"]) == (0, 0):
            return m
        assert time.monotonic() < deadline, f"requests stuck: {m}"
        time.sleep(0.05)


def _long(server: GatewayServer, i: int) -> tuple[str, dict]:
    """A streamed request that would run for minutes if nobody aborted it."""
    common = {"model": server.model, "max_tokens": 300, "ignore_eos": True, "stream": True}
    if i % 4:
        return "/completions", {**common, "prompt": "Once upon a time"}
    return "/chat/completions", {**common, "messages": [SYSTEM, {"role": "user",
                                                                 "content": "Go on."}]}


def test_overload_is_a_429_within_milliseconds(gateway_server: GatewayServer) -> None:
    srv = gateway_server
    _wait_idle(srv)

    async def refused(http: httpx.AsyncClient, body: dict, key: str, code: str) -> float:
        t = time.perf_counter()
        r = await http.post(srv.base_url + "/chat/completions", json=body,
                            headers=_headers(srv, key))
        took = time.perf_counter() - t
        assert r.status_code == 429 and r.json()["error"]["code"] == code, r.text
        assert int(r.headers["Retry-After"]) >= 1
        return took

    def start(http: httpx.AsyncClient, i: int, key: str) -> asyncio.Task:
        path, body = _long(srv, i)
        req = http.build_request("POST", srv.base_url + path, json=body,
                                 headers=_headers(srv, key))
        return asyncio.create_task(http.send(req, stream=True))

    async def until(done: Callable[[dict[str, float]], bool]) -> None:
        """Until a metrics snapshot satisfies `done`."""
        deadline = time.monotonic() + 60
        while not done(srv.metrics()):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)

    async def main() -> dict[str, list[float]]:
        plain = {"model": srv.model, "messages": CHAT, "max_tokens": 4}
        fresh = {"type": "object", "properties": {uuid.uuid4().hex: {"type": "integer"}}}
        json_mode = {**plain, "response_format": {  # a grammar never compiled: no time on it
            "type": "json_schema", "json_schema": {"name": "x", "schema": fresh}}}
        took: dict[str, list[float]] = {"tenant": [], "queue": [], "queue_json": []}
        async with httpx.AsyncClient(timeout=60) as http:
            fill = [start(http, 0, "sk-test-beta")]  # beta may run one request at a time
            await until(lambda m: m["switchboard_running_batch_size"] >= 1)
            for _ in range(10):
                took["tenant"].append(await refused(http, plain, "sk-test-beta",
                                                    "concurrency_limit_exceeded"))
            fill += [start(http, i, srv.api_key) for i in range(1, 20)]  # 8 run, 12 wait
            # All 20 submitted (the running batch is published after a step, so the queue depth
            # alone can run ahead of the submissions).
            await until(lambda m: m["switchboard_running_batch_size"]
                        + m["switchboard_queue_depth"] >= 20)
            for _ in range(10):
                took["queue"].append(await refused(http, plain, srv.api_key, "queue_full"))
                took["queue_json"].append(await refused(http, json_mode, srv.api_key,
                                                        "queue_full"))
            for r in await asyncio.gather(*fill):
                assert r.status_code == 200
                await r.aclose()
        return took

    took = asyncio.run(main())
    _wait_idle(srv)
    everything = [t for ts in took.values() for t in ts]
    print({k: f"median {statistics.median(v) * 1e3:.1f} ms, max {max(v) * 1e3:.1f} ms"
           for k, v in took.items()})
    assert statistics.median(everything) < 0.05 and max(everything) < 0.5


def _damaged_adapter(srv: GatewayServer, folder: Path) -> str:
    """Upload `folder`, push it out of the server's host cache with copies of itself (its
    --max-cpu-loras is 16), then truncate its weights in the store, as a failing disk would:
    a request for it reads the folder again and fails in the engine. (Weights whose products
    overflow, the NaN logits this test used, are refused at upload now.)"""
    files = [("files", (p.name, p.read_bytes())) for p in sorted(folder.iterdir())]

    def upload(name: str) -> None:
        r = httpx.post(srv.base_url + "/adapters", data={"name": name}, files=files,
                       headers=_headers(srv), timeout=120)
        assert r.status_code == 200, r.text

    def tier(name: str) -> str:
        return httpx.get(srv.base_url + f"/adapters/{name}", headers=_headers(srv),
                         timeout=30).json()["tier"]

    name, fillers = f"broken-{uuid.uuid4().hex[:8]}", []
    upload(name)
    try:
        while tier(name) != "disk":
            assert len(fillers) < 40
            fillers.append(f"filler-{uuid.uuid4().hex[:8]}")
            upload(fillers[-1])
    finally:
        for filler in fillers:
            httpx.delete(srv.base_url + f"/adapters/{filler}", headers=_headers(srv))
    weights = srv.adapter_dir / "alpha" / name / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    return name


def test_a_failing_request_fails_alone(gateway_server: GatewayServer, smollm2_dir: Path,
                                       tmp_path: Path) -> None:
    srv = gateway_server
    name = _damaged_adapter(srv, save_peft_adapter(smollm2_dir, tmp_path / "broken", seed=2))
    letters = {"type": "object", "properties": {"word": {
        "type": "string", "maxLength": 10, "pattern": r"^\p{L}+$"}},  # ECMA-262 syntax
        "required": ["word"], "additionalProperties": False}
    healthy = [{"model": srv.model, "messages": [SYSTEM, {"role": "user", "content": c}],
                "max_tokens": 8, "temperature": 0} for c in ("Hi!", "What is 2+2?", "Bye.")]
    healthy.append({"model": srv.model, "max_tokens": 30, "temperature": 0, "messages": [
        SYSTEM, {"role": "user", "content": "Name one animal."}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "animal", "schema": letters}}})
    broken = {"model": name, "messages": CHAT, "max_tokens": 8}
    bad_grammar = {"model": srv.model, "messages": CHAT, "max_tokens": 8,
                   "response_format": {"type": "grammar", "grammar": "root ::= ("}}

    async def post(http: httpx.AsyncClient, body: dict) -> httpx.Response:
        return await http.post(srv.base_url + "/chat/completions", json=body)

    async def main():
        async with httpx.AsyncClient(headers=_headers(srv), timeout=120) as http:
            alone = [await post(http, b) for b in healthy]
            mixed = await asyncio.gather(post(http, broken),
                                         post(http, {**broken, "stream": True}),
                                         post(http, bad_grammar), *[post(http, b)
                                                                    for b in healthy])
            return alone, mixed

    try:
        alone, (plain, streamed, grammar, *together) = asyncio.run(main())
    finally:
        httpx.delete(srv.base_url + f"/adapters/{name}", headers=_headers(srv))
    for a, b in zip(alone, together, strict=True):
        assert a.status_code == b.status_code == 200
        assert a.json()["choices"][0]["message"] == b.json()["choices"][0]["message"]
    word = json.loads(alone[-1].json()["choices"][0]["message"]["content"])["word"]
    assert regex.fullmatch(r"\p{L}+", word)
    err = plain.json()["error"]
    assert plain.status_code == 500 and err["type"] == "server_error"
    assert "can no longer be loaded" in err["message"] and name in err["message"]
    events = [json.loads(line[5:]) for line in streamed.text.splitlines()
              if line.startswith("data:") and line != "data: [DONE]"]
    assert streamed.status_code == 200
    assert "can no longer be loaded" in events[-1]["error"]["message"]
    assert grammar.status_code == 400
    assert grammar.json()["error"]["param"] == "response_format.grammar"
    _wait_idle(srv)


def test_a_failing_message_is_an_api_error(gateway_server: GatewayServer, smollm2_dir: Path,
                                           tmp_path: Path) -> None:
    """The Messages API's side of the same failure: a 500 `api_error` in Anthropic's shape,
    and in a stream an `error` event (no message_stop)."""
    srv = gateway_server
    name = _damaged_adapter(srv, save_peft_adapter(smollm2_dir, tmp_path / "broken", seed=3))
    body = {"model": name, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    headers = {"x-api-key": srv.api_key}
    try:
        plain = httpx.post(srv.url + "/v1/messages", json=body, headers=headers, timeout=120)
        streamed = httpx.post(srv.url + "/v1/messages", json={**body, "stream": True},
                              headers=headers, timeout=120)
    finally:
        httpx.delete(srv.base_url + f"/adapters/{name}", headers=_headers(srv))
    assert plain.status_code == 500
    assert plain.json()["type"] == "error" and plain.json()["error"]["type"] == "api_error"
    assert "can no longer be loaded" in plain.json()["error"]["message"]
    events = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: ")]
    assert streamed.status_code == 200 and events[0]["type"] == "message_start"
    assert events[-1]["type"] == "error" and events[-1]["error"]["type"] == "api_error"
    assert "message_stop" not in [e["type"] for e in events]
    _wait_idle(srv)
