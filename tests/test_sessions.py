"""Sessions end to end: both stores (a real `redis-server` on a free port), then the HTTP API
with the real openai SDK against `switchboard serve --redis-url`, across a server restart."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from conftest import API_KEYS, ROOT, SERVE_FLAGS, THREADS, _wait_for_banner
from openai import OpenAI

from gateway import redis_store
from gateway.access.bounds import MAX_MESSAGES
from gateway.errors import APIError
from gateway.openai.schemas import ChatCompletionRequest
from gateway.redis_store import StoreUnavailable
from gateway.sessions.store import MemoryStore, RedisStore, Session
from gateway.sessions.turns import resolve_session

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = {"role": "system", "content": "You are a terse agent. You call tools and report "
          "their results in one short sentence."}
T0 = {"temperature": 0, "max_tokens": 12}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen]:
    """A real redis-server on a free port (`make test` installs Debian's when missing)."""
    exe = shutil.which("redis-server")
    assert exe, "redis-server is not installed: run `make test` (it installs it)"
    port = _free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path_factory.mktemp("redis"))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    proc.url = f"redis://127.0.0.1:{port}/0"  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            assert time.monotonic() < deadline and proc.poll() is None, "redis did not start"
            time.sleep(0.05)
    yield proc
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def redis_url(redis_server: subprocess.Popen) -> str:
    return redis_server.url  # type: ignore[attr-defined]


# -- the stores -------------------------------------------------------------------------


@pytest.fixture(params=["memory", "redis"])
def make_store(request: pytest.FixtureRequest):
    """Builds the store inside the test's event loop (the Redis client binds to it)."""
    if request.param == "memory":
        return MemoryStore
    url = request.getfixturevalue("redis_url")
    return lambda: RedisStore(redis_store.connect(url), prefix=f"test:{time.monotonic()}:")


def test_store_roundtrip_tenants_and_ttl(make_store) -> None:
    async def main() -> None:
        store = make_store()
        s = Session("alpha", MODEL, [SYSTEM], tools=[{"type": "function"}])
        await store.create(s)
        await store.append(s, [{"role": "user", "content": "hi"}])
        got = await store.get("alpha", s.id)
        assert got is not None and got.messages == [SYSTEM, {"role": "user", "content": "hi"}]
        assert got.tools == [{"type": "function"}] and got.model == MODEL
        assert await store.get("beta", s.id) is None  # another tenant's: as if absent
        assert not await store.delete("beta", s.id)
        assert await store.delete("alpha", s.id)
        assert await store.get("alpha", s.id) is None
        short = Session("alpha", MODEL, [SYSTEM], ttl_seconds=1)
        await store.create(short)
        assert await store.get("alpha", short.id) is not None
        await asyncio.sleep(1.1)
        assert await store.get("alpha", short.id) is None
        await store.close()

    asyncio.run(main())


def test_redis_unreachable_raises_store_unavailable() -> None:
    async def main() -> None:
        s = RedisStore(redis_store.connect(f"redis://127.0.0.1:{_free_port()}/0"))
        with pytest.raises(StoreUnavailable):
            await s.get("alpha", "sess_x")
        await s.close()

    asyncio.run(main())


def test_resolve_session_refuses_what_a_turn_cannot_be() -> None:
    async def main() -> None:
        store = MemoryStore()
        s = Session("alpha", "m1", [SYSTEM])
        await store.create(s)

        def chat(**extra) -> ChatCompletionRequest:
            body = {"model": "m1", "messages": [{"role": "user", "content": "x"}], **extra}
            return ChatCompletionRequest.model_validate_json(json.dumps(body))

        assert await resolve_session(chat(), "alpha", store) is None
        turn = await resolve_session(chat(session_id=s.id), "alpha", store)
        assert turn is not None and [m["role"] for m in turn.conversation()] == [
            "system", "user"]
        for body, tenant, status, param in [
            (chat(session_id=s.id, model="m2"), "alpha", 400, "model"),
            (chat(session_id=s.id, n=2), "alpha", 400, "n"),
            (chat(session_id=s.id), "beta", 404, "session_id"),
            (chat(session_id="sess_unknown"), "alpha", 404, "session_id"),
        ]:
            with pytest.raises(APIError) as e:
                await resolve_session(body, tenant, store)
            assert (e.value.status, e.value.param) == (status, param)

    asyncio.run(main())


def test_a_turn_counts_the_stored_history_with_its_messages() -> None:
    """A request's own messages are counted as its body is read; a turn's prompt is the
    stored history too, under the same bound."""
    async def main() -> None:
        store = MemoryStore()
        full = Session("alpha", "m1", [SYSTEM] * (MAX_MESSAGES - 1))
        await store.create(full)
        body = ChatCompletionRequest.model_validate_json(json.dumps({
            "model": "m1", "messages": [{"role": "user", "content": "x"}],
            "session_id": full.id}))
        turn = await resolve_session(body, "alpha", store)
        assert turn is not None and len(turn.conversation()) == MAX_MESSAGES
        await store.append(full, [{"role": "user", "content": "y"}])
        turn = await resolve_session(body, "alpha", store)
        assert turn is not None
        with pytest.raises(APIError) as e:
            turn.conversation()
        assert (e.value.status, e.value.param, e.value.code) == (
            400, "messages", "array_above_max_length")

    asyncio.run(main())


# -- HTTP -------------------------------------------------------------------------------


class Server:
    """`switchboard serve --redis-url` in a subprocess; `restart()` keeps the Redis data."""

    def __init__(self, tmp: Path, redis_url: str):
        self.tmp, self.redis_url = tmp, redis_url
        self.keys = tmp / "keys.json"
        self.keys.write_text(json.dumps(API_KEYS))
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> None:
        log = self.tmp / f"serve-{time.monotonic()}.log"
        cmd = [sys.executable, "-m", "gateway.main", "serve", "--port", "0", "--api-keys",
               str(self.keys), "--redis-url", self.redis_url, *SERVE_FLAGS]
        with log.open("w") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", **THREADS})
        self.url = _wait_for_banner(self.proc, log, timeout=300)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def restart(self) -> None:
        self.stop()
        self.start()

    def client(self, key: str = "sk-test-alpha") -> OpenAI:
        return OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=300)

    def http(self, method: str, path: str, key: str = "sk-test-alpha", **kw) -> httpx.Response:
        return httpx.request(method, self.url + path, timeout=300,
                             headers={"Authorization": f"Bearer {key}"}, **kw)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("sessions"), redis_url)
    srv.start()
    yield srv
    srv.stop()


def _new_session(server: Server, key: str = "sk-test-alpha", **extra) -> str:
    r = server.http("POST", "/v1/sessions", key, json={"model": MODEL, "messages": [SYSTEM],
                                                       **extra})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def _turn(client: OpenAI, sid: str, content: str):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                          "content": content}],
                                          extra_body={"session_id": sid}, **T0)


def _cold(server: Server, history: list[dict]) -> str:
    """The same history, sessionless, by a tenant whose cache holds none of it."""
    r = server.client("sk-test-beta").chat.completions.create(model=MODEL, messages=history, **T0)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    return r.choices[0].message.content


def test_turns_hit_the_cache_and_equal_a_cold_run(server: Server) -> None:
    client = server.client()
    sid = _new_session(server, ttl_seconds=600)
    r1 = _turn(client, sid, "Call the weather tool for Paris.")
    r2 = _turn(client, sid, "Now Berlin; compare both.")
    assert r2.usage.prompt_tokens_details.cached_tokens > 0
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens - 16
    history = server.http("GET", f"/v1/sessions/{sid}").json()["messages"]
    assert [m["role"] for m in history] == ["system", "user", "assistant", "user", "assistant"]
    assert history[2]["content"] == r1.choices[0].message.content
    assert _cold(server, history[:4]) == r2.choices[0].message.content

    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "And Rome?"}], stream=True,
        stream_options={"include_usage": True}, extra_body={"session_id": sid}, **T0)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    history = server.http("GET", f"/v1/sessions/{sid}").json()["messages"]
    assert len(history) == 7 and history[-1] == {"role": "assistant", "content": text}

    metrics = server.http("GET", "/metrics", "sk-test-ops").text  # an admin key
    hits = next(float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("switchboard_prefix_cache_hit_tokens_total"))
    assert hits > 0 and "switchboard_session_pinned_pages" in metrics


def test_bad_session_input(server: Server) -> None:
    sid = _new_session(server)
    for key, path in [("sk-test-beta", f"/v1/sessions/{sid}"), ("sk-test-alpha",
                                                               "/v1/sessions/sess_nope")]:
        r = server.http("GET", path, key)
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    with pytest.raises(openai.NotFoundError):
        _turn(server.client("sk-test-beta"), sid, "hi")  # tenant B never sees A's session
    with pytest.raises(openai.BadRequestError):
        server.client().chat.completions.create(model=MODEL, n=2, messages=[
            {"role": "user", "content": "x"}], extra_body={"session_id": sid})

    r = server.http("POST", f"/v1/sessions/{sid}/fork", json={"message_index": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "message_index"
    fork = server.http("POST", f"/v1/sessions/{sid}/fork", json={"message_index": 0}).json()
    assert fork["id"] != sid and fork["messages"] == []
    assert server.http("DELETE", f"/v1/sessions/{sid}").json()["deleted"] is True
    assert server.http("GET", f"/v1/sessions/{sid}").status_code == 404
    assert server.http("DELETE", f"/v1/sessions/{sid}").status_code == 404


def test_history_survives_a_restart_and_the_next_turn_equals_cold(server: Server) -> None:
    sid = _new_session(server)
    _turn(server.client(), sid, "List two tools you could call.")
    fork = server.http("POST", f"/v1/sessions/{sid}/fork").json()
    before = server.http("GET", f"/v1/sessions/{sid}").json()["messages"]
    server.restart()
    assert server.http("GET", f"/v1/sessions/{sid}").json()["messages"] == before
    assert server.http("GET", f"/v1/sessions/{fork['id']}").json()["messages"] == before
    r = _turn(server.client(), sid, "Pick the first one.")
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # a fresh engine: re-prefilled
    cold = _cold(server, [*before, {"role": "user", "content": "Pick the first one."}])
    assert r.choices[0].message.content == cold
    # The fork shares the parent's prefix, so its first turn hits the parent's cached KV.
    rf = _turn(server.client(), fork["id"], "Pick the second one.")
    assert rf.usage.prompt_tokens_details.cached_tokens > 0


def test_example_agent_session_runs(server: Server) -> None:
    out = subprocess.run(
        [sys.executable, "examples/agent_session.py", "--max-tokens", "6"], cwd=ROOT,
        capture_output=True, text=True, timeout=300, check=True,
        env={**os.environ, "OPENAI_BASE_URL": server.url + "/v1",
             "OPENAI_API_KEY": "sk-test-alpha"})
    assert "The session holds 7 messages." in out.stdout


def test_redis_down_fails_session_calls_only(server: Server, redis_server) -> None:
    sid = _new_session(server)
    redis_server.terminate()  # the last test of the module: nothing needs Redis after it
    redis_server.wait(10)
    r = server.http("GET", f"/v1/sessions/{sid}")
    assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"
    with pytest.raises(openai.InternalServerError):
        _turn(server.client(), sid, "hi")
    ok = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], **T0)
    assert ok.choices[0].message.content
