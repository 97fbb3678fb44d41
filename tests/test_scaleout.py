"""Scale-out on loopback: a real redis-server, two real `switchboard serve --redis-url`
replicas (SmolLM2, one thread, a small KV pool) and `switchboard router` in front, driven with
the openai SDK and httpx. Replica A publishes the API keys; replica B reads them from Redis.
The tests run in file order: the last two kill the replicas."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import redis.asyncio as aioredis
from conftest import ROOT, THREADS, _wait_for_banner
from openai import OpenAI
from test_lora_http import make_adapter
from test_sessions import redis_server, redis_url  # noqa: F401 - module-scoped fixtures

from gateway import registry
from gateway.access.limits import SharedLimiter
from gateway.config import TenantLimits
from gateway.errors import APIError
from gateway.registry import ReplicaInfo
from gateway.router.pool import choose, fleet_base
from tests.tiny_models import save_tiny

MODEL = "SmolLM2-135M-Instruct"
KEYS = {"sk-scale-alpha": "alpha", "sk-scale-beta": "beta",
        "sk-scale-tpm": {"tenant": "metered", "tokens_per_minute": 25},
        "sk-scale-one": {"tenant": "single", "max_concurrent_requests": 1}}
REPLICA_FLAGS = ["--threads", "1", "--kv-pages", "64", "--page-size", "16", "--max-num-seqs",
                 "4", "--max-num-batched-tokens", "128", "--max-loras", "2", "--max-cpu-loras",
                 "2", "--log-level", "warning"]
T0 = {"temperature": 0, "max_tokens": 6}
HI = [{"role": "user", "content": "Hi"}]


@dataclass
class Proc:
    popen: subprocess.Popen
    url: str = ""

    @property
    def address(self) -> str:
        return self.url.removeprefix("http://")

    def stop(self) -> None:
        self.popen.kill()
        self.popen.wait(20)


def _spawn(args: list[str], log: Path) -> Proc:
    with log.open("w") as out:
        return Proc(subprocess.Popen([sys.executable, "-m", "gateway.main", *args], cwd=ROOT,
                                     stdout=out, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **THREADS}))


def _replica(tmp: Path, name: str, redis: str, *extra: str) -> tuple[Proc, Path]:
    log = tmp / f"{name}.log"
    return _spawn(["serve", "--port", "0", "--redis-url", redis, "--adapter-dir",
                   str(tmp / f"adapters-{name}"), *REPLICA_FLAGS, *extra], log), log


@dataclass
class Fleet:
    a: Proc
    b: Proc
    router: Proc
    redis_url: str
    tmp: Path

    def client(self, proc: Proc | None = None, key: str = "sk-scale-alpha") -> OpenAI:
        url = (proc or self.router).url
        return OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)

    def http(self, method: str, path: str, proc: Proc | None = None,
             key: str = "sk-scale-alpha", **kw) -> httpx.Response:
        return httpx.request(method, (proc or self.router).url + path, timeout=120,
                             headers={"Authorization": f"Bearer {key}"}, **kw)

    def status(self) -> dict:
        return httpx.get(self.router.url + "/router/replicas", timeout=10).json()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Fleet]:  # noqa: F811
    tmp = tmp_path_factory.mktemp("scaleout")
    (tmp / "keys.json").write_text(json.dumps(KEYS))
    a, a_log = _replica(tmp, "a", redis_url, "--api-keys", str(tmp / "keys.json"))
    b, b_log = _replica(tmp, "b", redis_url)
    router = _spawn(["router", "--redis-url", redis_url, "--port", "0"], tmp / "router.log")
    try:
        a.url, b.url = _wait_for_banner(a.popen, a_log, 300), _wait_for_banner(b.popen, b_log, 300)
        router.url = _wait_for(lambda: re.search(r"router at (http://\S+)",
                                                  (tmp / "router.log").read_text()), 60).group(1)
        fleet = Fleet(a, b, router, redis_url, tmp)
        _wait_for(lambda: len(fleet.status()["replicas"]) == 2, 30)
        yield fleet
    finally:
        for proc in (a, b, router):
            if proc.popen.poll() is None:
                proc.stop()


def _wait_for(check, timeout: float):  # noqa: ANN001, ANN202 - a predicate and its result
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)
    return result


def _served_by(raw) -> str:  # noqa: ANN001 - an openai raw response
    return raw.headers["x-switchboard-replica"]


# -- pieces without servers -------------------------------------------------------------


def test_choice_rules() -> None:
    a, b, c = (ReplicaInfo(url=f"http://h:{i}", model="m", base="x", ready=True, id=n,
                           started=i) for i, n in enumerate("abc"))
    loads = {"a": 5, "b": 1, "c": 3}
    assert choose([a, b, c], lambda r: loads[r.id]) is b
    assert choose([a, b, c], lambda r: loads[r.id], affinity="a") is a  # affinity beats load
    assert choose([b, c], lambda r: loads[r.id], affinity="a") is b  # its replica is gone
    picks = {choose([a, b, c], lambda r: 0, prefix=f"p{i}").id for i in range(32)}
    assert picks == {"a", "b", "c"}  # prefixes spread over the replicas...
    first = choose([a, b, c], lambda r: 0, prefix="p1")
    other = next(r for r in (a, b, c) if r is not first)
    assert choose([first, other], lambda r: 0, prefix="p1") is first  # ...and stay put
    assert choose([a, b, c], lambda r: 100 if r is first else 0, prefix="p1") is not first
    odd = ReplicaInfo(model="other", base="y", id="d", started=-1)
    assert fleet_base([odd, a, b]) == a.base_model  # the majority
    assert fleet_base([odd, a]) == odd.base_model  # a tie: the longest-running


def test_shared_token_bucket_and_concurrency(redis_url: str) -> None:  # noqa: F811
    limits = {"t": TenantLimits(tokens_per_minute=60), "c": TenantLimits(max_concurrent_requests=1)}

    async def main() -> None:
        r = aioredis.Redis.from_url(redis_url, decode_responses=True)
        await registry.publish(r, ReplicaInfo(id="live-1"))
        one, two = (SharedLimiter(r, rid, lambda t: limits[t]) for rid in ("live-1", "dead-1"))
        ticket = await one.admit("t")
        ticket.record_tokens(70)  # 60 a minute, 1 a second: 10 in debt
        await one.drain()
        with pytest.raises(APIError) as e:
            await two.admit("t")  # another replica sees the same bucket
        assert e.value.code == "tokens_per_minute_exceeded"
        assert 10 <= int(e.value.headers["Retry-After"]) <= 12

        slot = await two.admit("c")  # held by dead-1, which never heartbeats
        await one.admit("c")  # dead-1's count is swept: live-1 gets the slot
        with pytest.raises(APIError) as e:
            await two.admit("c")
        assert e.value.code == "concurrency_limit_exceeded"
        slot.release()
        await two.drain()
        await r.aclose()

    asyncio.run(main())


# -- the fleet ----------------------------------------------------------------------------


def test_router_forwards_and_names_the_replica(fleet: Fleet) -> None:
    replicas = {fleet.a.address, fleet.b.address}
    raw = fleet.client().chat.completions.with_raw_response.create(model=MODEL, messages=HI, **T0)
    assert _served_by(raw) in replicas and raw.parse().choices[0].message.content
    with fleet.client().chat.completions.with_streaming_response.create(
            model=MODEL, messages=HI, stream=True, **T0) as stream:
        assert _served_by(stream) in replicas
        assert "data: [DONE]" in "".join(stream.iter_lines())
    for path in ("/v1/models", "/v1/adapters"):
        r = fleet.http("GET", path)
        assert r.status_code == 200 and r.headers["x-switchboard-replica"] in replicas
    r = fleet.http("GET", "/v1/models", key="sk-wrong")  # B read the keys from Redis
    assert r.status_code == 401 and r.headers["x-switchboard-replica"] in replicas
    assert fleet.http("GET", "/v1/models", fleet.b, key="sk-wrong").status_code == 401


def test_adapter_uploaded_through_one_replica_is_used_through_the_other(fleet: Fleet) -> None:
    folder = make_adapter(fleet.tmp / "bot")
    files = [("files", (p.name, p.read_bytes())) for p in sorted(folder.iterdir())]
    up = fleet.http("POST", "/v1/adapters", fleet.a, data={"name": "bot"}, files=files)
    assert up.status_code == 200, up.text
    again = fleet.http("POST", "/v1/adapters", fleet.b, data={"name": "bot"}, files=files)
    assert again.status_code == 409  # the name is taken fleet-wide
    listed = fleet.http("GET", "/v1/adapters", fleet.b).json()["data"]
    assert [(x["id"], x["tier"]) for x in listed] == [("bot", "store")]  # not fetched yet
    b = fleet.client(fleet.b)

    def first_logprob(model: str) -> float:
        r = b.chat.completions.create(model=model, messages=HI, max_tokens=1, temperature=0,
                                      logprobs=True)
        return r.choices[0].logprobs.content[0].logprob

    assert abs(first_logprob("bot") - first_logprob(MODEL)) > 1e-3  # fetched, and applied
    assert fleet.http("GET", "/v1/adapters/bot", fleet.b).json()["tier"] != "store"
    with pytest.raises(openai.NotFoundError):  # another tenant's
        fleet.client(fleet.b, "sk-scale-beta").chat.completions.create(
            model="bot", messages=HI, **T0)
    assert fleet.http("DELETE", "/v1/adapters/bot", fleet.b).status_code == 200
    with pytest.raises(openai.NotFoundError):  # deleted through B, gone on A too
        fleet.client(fleet.a).chat.completions.create(model="bot", messages=HI, **T0)


def test_rate_limits_hold_across_replicas(fleet: Fleet) -> None:
    # 25 tokens a minute: the first request's prompt alone overdraws the shared bucket.
    fleet.client(fleet.a, "sk-scale-tpm").chat.completions.create(model=MODEL, messages=HI, **T0)
    with pytest.raises(openai.RateLimitError) as e:
        fleet.client(fleet.b, "sk-scale-tpm").chat.completions.create(
            model=MODEL, messages=HI, **T0)
    assert e.value.body["code"] == "tokens_per_minute_exceeded"
    assert int(e.value.response.headers["Retry-After"]) >= 1

    # One request at a time, fleet-wide: B refuses while A streams.
    single = dict(model=MODEL, messages=HI, temperature=0, max_tokens=24, stream=True)
    stream = fleet.client(fleet.a, "sk-scale-one").chat.completions.create(**single)
    next(iter(stream))
    with pytest.raises(openai.RateLimitError) as e:
        fleet.client(fleet.b, "sk-scale-one").chat.completions.create(
            model=MODEL, messages=HI, **T0)
    assert e.value.body["code"] == "concurrency_limit_exceeded"
    list(stream)
    _wait_for(lambda: fleet.http("POST", "/v1/chat/completions", fleet.b, "sk-scale-one", json={
        "model": MODEL, "messages": HI, **T0}).status_code == 200, 10)  # the slot came back


def test_a_replica_of_another_base_model_is_refused(fleet: Fleet, smollm2_dir: Path) -> None:
    tiny = save_tiny(fleet.tmp / "tiny", "llama")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / f, tiny / f)
    odd, log = _replica(fleet.tmp, "odd", fleet.redis_url, "--model", str(tiny))
    try:
        odd.url = _wait_for_banner(odd.popen, log, 300)
        refused = _wait_for(lambda: fleet.status()["refused"], 30)
        assert [r["address"] for r in refused] == [odd.address]
        assert "tiny" in refused[0]["reason"] and MODEL in refused[0]["reason"]
        assert fleet.status()["base_model"].startswith(MODEL)
        for _ in range(4):
            assert fleet.http("GET", "/v1/models").headers["x-switchboard-replica"] != odd.address
    finally:
        odd.stop()


def test_chained_responses_go_to_the_replica_holding_their_kv(fleet: Fleet) -> None:
    create = fleet.client().responses.with_raw_response.create
    first = create(model=MODEL, input="Name a color.", max_output_tokens=4, temperature=0)
    home, prev = _served_by(first), first.parse().id
    # Keep `home` busy with a stream the router counts (a new response: routed by load alone):
    # by load, the next turn would go to the idle replica; it must follow its KV instead.
    busy = []
    while not busy or _served_by(busy[-1]) != home:
        assert len(busy) < 2
        busy.append(create(model=MODEL, input="Count to a hundred.", max_output_tokens=400,
                           store=False, stream=True))
        next(iter(busy[-1].parse()))
    try:
        for text in ("Another one.", "And a third."):
            turn = create(model=MODEL, input=text, previous_response_id=prev,
                          max_output_tokens=4, temperature=0)
            assert _served_by(turn) == home
            prev = turn.parse().id
            assert turn.parse().usage.input_tokens_details.cached_tokens >= 16
    finally:
        for b in busy:
            b.parse().close()


def test_a_session_moves_when_its_replica_dies(fleet: Fleet) -> None:
    system = {"role": "system", "content": "You are terse."}
    made = fleet.http("POST", "/v1/sessions", json={"model": MODEL, "messages": [system]})
    sid, home = made.json()["id"], made.headers["x-switchboard-replica"]
    chat = fleet.client().chat.completions.with_raw_response

    def turn(text: str):  # noqa: ANN202 - an openai raw response
        return chat.create(model=MODEL, messages=[{"role": "user", "content": text}],
                           extra_body={"session_id": sid}, **T0)

    assert _served_by(turn("Name a color.")) == home
    second = turn("Another one.")
    assert _served_by(second) == home and second.parse().usage.prompt_tokens_details.cached_tokens
    dead = fleet.a if home == fleet.a.address else fleet.b
    dead.stop()
    third = turn("And a third.")
    assert _served_by(third) != home
    history = fleet.http("GET", f"/v1/sessions/{sid}").json()["messages"]
    assert [m["role"] for m in history] == ["system"] + ["user", "assistant"] * 3
    reply = third.parse()
    assert history[-1]["content"] == reply.choices[0].message.content
    # The same prompt sessionless, by a tenant whose prefix cache holds none of it.
    cold = fleet.client(key="sk-scale-beta").chat.completions.create(
        model=MODEL, messages=history[:-1], **T0)
    assert cold.choices[0].message.content == reply.choices[0].message.content
    assert cold.usage.prompt_tokens == reply.usage.prompt_tokens  # the whole history
    # Its heartbeat stops: within the TTL, the router no longer lists it at all.
    _wait_for(lambda: dead.address not in {r["address"] for r in fleet.status()["replicas"]},
              registry.TTL_S + 5)


def test_no_healthy_replica_is_503_with_retry_after(fleet: Fleet) -> None:
    for proc in (fleet.a, fleet.b):
        if proc.popen.poll() is None:
            proc.stop()
    r = fleet.http("POST", "/v1/chat/completions", json={"model": MODEL, "messages": HI})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica"
    assert int(r.headers["Retry-After"]) >= 1
    assert httpx.get(fleet.router.url + "/ready").status_code == 503
