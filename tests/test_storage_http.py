"""Storage quotas, a full Redis and deletes, against one real `switchboard serve --redis-url`
(a real redis-server) on the embedded SmolLM2, through HTTP and the openai SDK:

- a tenant past `max_sessions` / `max_storage_bytes` gets a 403 `storage_quota_exceeded`
  naming the quota and nothing written, while other tenants go on; its bytes in Redis stay
  within its quota whatever it forks;
- `ttl_seconds` past the bound is a 400 and writes nothing; a session without one gets
  `--session-ttl`;
- Redis out of memory (`maxmemory`, `noeviction`): every write route answers 503
  `store_unavailable` with Retry-After (a turn before generation), a stream ends with an error
  event; other routes and tenants are unaffected once Redis has room again;
- deleting a response, a conversation or a session leaves none of its text in Redis.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from conftest import ROOT, SERVE_FLAGS, THREADS, _wait_for_banner
from openai import OpenAI
from test_sessions import redis_server, redis_url  # noqa: F401 - module-scoped fixtures

from gateway.redis_store import usage_keys

MODEL = "SmolLM2-135M-Instruct"
QUOTA_BYTES = 64 * 1024
KEYS = {"sk-small": {"tenant": "small", "max_sessions": 8, "max_storage_bytes": QUOTA_BYTES},
        "sk-other": "other", "sk-del": "del",
        "sk-conv": {"tenant": "conv", "max_storage_bytes": QUOTA_BYTES}}
SESSION_TTL = 600
T0 = {"temperature": 0, "max_tokens": 4}


class Server:
    def __init__(self, tmp: Path, url: str):
        self.tmp, self.redis_url = tmp, url
        (tmp / "keys.json").write_text(json.dumps(KEYS))
        log = tmp / "serve.log"
        cmd = [sys.executable, "-m", "gateway.main", "serve", "--port", "0", "--api-keys",
               str(tmp / "keys.json"), "--redis-url", url,
               "--session-ttl", str(SESSION_TTL), *SERVE_FLAGS]
        with log.open("w") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", **THREADS})
        self.url = _wait_for_banner(self.proc, log, timeout=300)

    def http(self, method: str, path: str, key: str, **kw) -> httpx.Response:
        return httpx.request(method, self.url + path, timeout=120,
                             headers={"Authorization": f"Bearer {key}"}, **kw)

    def client(self, key: str) -> OpenAI:
        return OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Server]:  # noqa: F811
    s = Server(tmp_path_factory.mktemp("storage"), redis_url)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def db(redis_url: str) -> Iterator[redis.Redis]:  # noqa: F811
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    yield r
    r.config_set("maxmemory", 0)
    r.close()


def _error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"], err
    return err


def _session(server: Server, key: str, text: str = "You are terse.", **extra) -> httpx.Response:
    return server.http("POST", "/v1/sessions", key, json={
        "model": MODEL, "messages": [{"role": "system", "content": text}], **extra})


def _session_bytes(db: redis.Redis, tenant: str) -> int:
    """What the tenant's sessions take in Redis: their messages, as stored."""
    total = 0
    for key in db.scan_iter("switchboard:session:*:messages", count=1000):
        meta = db.hgetall(key.removesuffix(":messages"))
        if meta.get("tenant") == tenant:
            total += sum(len(m) for m in db.lrange(key, 0, -1))
    return total


def test_quota_bounds_sessions_forks_and_bytes(server: Server, db: redis.Redis) -> None:
    big = "x" * 12_000
    small_sid = _session(server, "sk-small").json()["id"]
    r = _session(server, "sk-small", big)
    assert r.status_code == 200, r.text
    sid = r.json()["id"]
    # The attack: fork `{}` over and over. Each copy counts; the 403 comes before
    # any write past the quota.
    codes = [server.http("POST", f"/v1/sessions/{sid}/fork", "sk-small").status_code
             for _ in range(10)]
    assert codes.count(200) == 4 and set(codes[4:]) == {403}, codes
    err = _error(server.http("POST", f"/v1/sessions/{sid}/fork", "sk-small"), 403,
                 "storage_quota_exceeded")
    assert err["param"] == "max_storage_bytes" and str(QUOTA_BYTES) in err["message"]
    assert _session_bytes(db, "small") <= QUOTA_BYTES
    sessions, used = (int(v) for v in db.hmget(usage_keys("small")[2], "sessions", "bytes"))
    assert sessions == 6 and _session_bytes(db, "small") <= used <= QUOTA_BYTES
    # A turn whose reply may grow a history past the quota is refused before generation.
    turn = server.http("POST", "/v1/chat/completions", "sk-small", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
        "session_id": small_sid, "temperature": 0, "max_tokens": 1000})
    _error(turn, 403, "storage_quota_exceeded")
    history = server.http("GET", f"/v1/sessions/{small_sid}", "sk-small").json()["messages"]
    assert len(history) == 1
    # Another tenant is unaffected.
    other = _session(server, "sk-other")
    assert other.status_code == 200
    reply = server.client("sk-other").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}],
        extra_body={"session_id": other.json()["id"]}, **T0)
    assert reply.choices[0].message.content
    # Deleting frees the room; then the session count binds (6 sessions).
    forks = [k for k in db.scan_iter("switchboard:session:sess_*") if ":" not in k[20:]]
    for key in forks:
        keep = (f"switchboard:session:{sid}", f"switchboard:session:{small_sid}")
        if db.hget(key, "tenant") == "small" and key not in keep:
            sid_ = key.removeprefix("switchboard:session:")
            assert server.http("DELETE", f"/v1/sessions/{sid_}", "sk-small").status_code == 200
    assert int(db.hget(usage_keys("small")[2], "sessions")) == 2
    codes = [_session(server, "sk-small").status_code for _ in range(7)]
    assert codes == [200] * 6 + [403]
    err = _error(_session(server, "sk-small"), 403, "storage_quota_exceeded")
    assert err["param"] == "max_sessions"


def test_a_conversation_cannot_grow_past_the_quota(server: Server, db: redis.Redis) -> None:
    """The issue's second growth path: 20 items a call, call after call, into one
    conversation; and responses appending to it."""
    client = server.client("sk-conv")
    conv = client.conversations.create()
    items = [{"type": "message", "role": "user", "content": "y" * 1000}] * 20
    codes = [server.http("POST", f"/v1/conversations/{conv.id}/items", "sk-conv",
                         json={"items": items}).status_code for _ in range(5)]
    assert codes[:3] == [200] * 3 and codes[3:] == [403] * 2, codes
    listed = client.conversations.items.list(conv.id, limit=100)
    assert len(listed.data) == 60
    used = int(db.hget(usage_keys("conv")[2], "bytes"))
    assert used <= QUOTA_BYTES
    full = server.http("POST", "/v1/conversations", "sk-conv", json={"items": items})
    assert _error(full, 403, "storage_quota_exceeded")["param"] == "max_storage_bytes"
    client.conversations.delete(conv.id)
    assert db.hget(usage_keys("conv")[2], "bytes") == "0"
    # Room again: a conversation and a stored response in it.
    conv = client.conversations.create()
    r = client.responses.create(model=MODEL, input="Hi", conversation=conv.id,
                                max_output_tokens=4, temperature=0)
    assert r.status == "incomplete"
    assert len(client.conversations.items.list(conv.id).data) == 2


def test_ttl_bounds_and_default(server: Server, db: redis.Redis) -> None:
    before = len(list(db.scan_iter("switchboard:session:*")))
    err = _error(_session(server, "sk-other", ttl_seconds=2**62), 400, None)
    assert err["param"] == "ttl_seconds"
    assert len(list(db.scan_iter("switchboard:session:*"))) == before  # nothing written
    body = _session(server, "sk-other").json()
    assert body["ttl_seconds"] == SESSION_TTL
    assert 0 < db.ttl(f"switchboard:session:{body['id']}") <= SESSION_TTL


def test_full_redis_is_503_and_nothing_half_written(server: Server, db: redis.Redis) -> None:
    sid = _session(server, "sk-other").json()["id"]
    client = server.client("sk-other")
    db.config_set("maxmemory-policy", "noeviction")
    db.config_set("maxmemory", 1)  # every write is refused; reads are served
    try:
        for r in (
            _session(server, "sk-other"),
            server.http("POST", f"/v1/sessions/{sid}/fork", "sk-other"),
            server.http("POST", "/v1/chat/completions", "sk-other", json={
                "model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                "session_id": sid, **T0}),
            server.http("POST", "/v1/responses", "sk-other", json={
                "model": MODEL, "input": "Hi", "max_output_tokens": 4, "temperature": 0}),
            server.http("POST", "/v1/conversations", "sk-other", json={}),
        ):
            _error(r, 503, "store_unavailable")
            assert r.headers["retry-after"]
        # Streams are refused before they start as well.
        r = server.http("POST", "/v1/responses", "sk-other", json={
            "model": MODEL, "input": "Hi", "max_output_tokens": 4, "stream": True})
        _error(r, 503, "store_unavailable")
        # Requests that store nothing are served.
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], **T0)
        assert reply.choices[0].message.content
        got = server.http("GET", f"/v1/sessions/{sid}", "sk-other")
        assert got.status_code == 200, got.text
        assert len(got.json()["messages"]) == 1
    finally:
        db.config_set("maxmemory", 0)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}],
        extra_body={"session_id": sid}, **T0)
    assert len(server.http("GET", f"/v1/sessions/{sid}", "sk-other").json()["messages"]) == 3


def test_a_stream_that_cannot_store_ends_with_an_error_event(
    server: Server, db: redis.Redis
) -> None:
    """Redis fills while the response streams: the commit fails, and the stream says so."""
    client = server.client("sk-other")
    stream = client.responses.create(model=MODEL, input="Count to fifty.", stream=True,
                                     max_output_tokens=64, temperature=0)
    events: list[str] = []
    try:
        for e in stream:
            events.append(e.type)
            if e.type == "response.output_text.delta" and events.count(e.type) == 1:
                db.config_set("maxmemory-policy", "noeviction")
                db.config_set("maxmemory", 1)  # every write is refused; reads are served
    finally:
        db.config_set("maxmemory", 0)
    assert events[-1] == "error" and "response.completed" not in events, events


def _everything(db: redis.Redis) -> str:
    """Every value in Redis, as one string."""
    out = []
    for key in db.scan_iter(count=1000):
        kind = db.type(key)
        if kind == "string":
            out.append(db.get(key) or "")
        elif kind == "hash":
            out.append(json.dumps(db.hgetall(key)))
        elif kind == "list":
            out.extend(db.lrange(key, 0, -1))
        elif kind == "zset":
            out.extend(db.zrange(key, 0, -1))
        elif kind == "set":
            out.extend(db.smembers(key))
    return "\n".join(out)


def test_a_delete_deletes(server: Server, db: redis.Redis) -> None:
    client = server.client("sk-del")
    secret = f"SECRET-{uuid.uuid4().hex}"
    opts = {"max_output_tokens": 4, "temperature": 0}
    r1 = client.responses.create(model=MODEL, input=f"My password is {secret}. Say ok.", **opts)
    client.responses.create(model=MODEL, input="Again.", previous_response_id=r1.id, **opts)
    # A second continuation of r1 forks a new session holding a copy of r1's turn.
    client.responses.create(model=MODEL, input="Once more.", previous_response_id=r1.id, **opts)
    assert secret in _everything(db)
    client.responses.delete(r1.id)
    assert secret not in _everything(db)
    # Conversations: the items and the responses stored in it.
    conv = client.conversations.create(items=[{"type": "message", "role": "user",
                                               "content": f"Remember {secret}."}])
    client.responses.create(model=MODEL, input=f"Also {secret}.", conversation=conv.id, **opts)
    assert secret in _everything(db)
    client.conversations.delete(conv.id)
    assert secret not in _everything(db)
    # Sessions.
    sid = _session(server, "sk-del", f"The key is {secret}.").json()["id"]
    assert secret in _everything(db)
    assert server.http("DELETE", f"/v1/sessions/{sid}", "sk-del").status_code == 200
    assert secret not in _everything(db)
