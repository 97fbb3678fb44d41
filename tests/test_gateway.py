"""The gateway end to end: the real `openai` SDK (sync, async, streaming) and raw HTTP against
`switchboard serve` on the embedded SmolLM2, started once per session (tests/conftest.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.conftest import busy_pages

if TYPE_CHECKING:
    from tests.conftest import GatewayServer

ROOT = Path(__file__).resolve().parents[1]
CHAT = [{"role": "user", "content": "Name one color."}]


@pytest.fixture(scope="module")
def server(gateway_server: GatewayServer) -> GatewayServer:
    return gateway_server


@pytest.fixture(scope="module")
def client(server: GatewayServer) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0, timeout=300)


def _aclient(server: GatewayServer, key: str | None = None) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.base_url, api_key=key or server.api_key, max_retries=0,
                       timeout=300)


def _headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_health_ready_and_models(server: GatewayServer, client: OpenAI) -> None:
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready").status_code == 200
    assert [m.id for m in client.models.list()] == [server.model]
    assert client.models.retrieve(server.model).id == server.model


def test_plain_and_streamed_agree_at_temperature_zero(server: GatewayServer) -> None:
    async def streamed_chat(c: AsyncOpenAI) -> tuple[str, str, object, list]:
        stream = await c.chat.completions.create(
            model=server.model, messages=CHAT, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
        return text, finish, chunks[-1].usage, chunks

    async def streamed_text(c: AsyncOpenAI) -> tuple[str, str]:
        stream = await c.completions.create(model=server.model, prompt="The capital of France is",
                                            max_tokens=8, temperature=0, stream=True)
        chunks = [chunk async for chunk in stream]
        return "".join(ch.choices[0].text for ch in chunks), chunks[-1].choices[0].finish_reason

    async def main():
        c = _aclient(server)
        return await asyncio.gather(
            c.chat.completions.create(model=server.model, messages=CHAT, max_tokens=8,
                                      temperature=0),
            streamed_chat(c),
            c.completions.create(model=server.model, prompt="The capital of France is",
                                 max_tokens=8, temperature=0),
            streamed_text(c),
        )

    plain, (text, finish, usage, chunks), plain_text, (stext, sfinish) = asyncio.run(main())
    assert plain.choices[0].message.content == text and text
    assert plain.choices[0].finish_reason == finish
    assert chunks[0].choices[0].delta.role == "assistant"
    assert usage.completion_tokens == plain.usage.completion_tokens
    assert usage.prompt_tokens == plain.usage.prompt_tokens
    # The two chats race: the one admitted second may reuse the first one's prompt pages.
    assert 0 <= plain.usage.prompt_tokens_details.cached_tokens < plain.usage.prompt_tokens
    assert plain_text.choices[0].text == stext and stext
    assert plain_text.choices[0].finish_reason == sfinish


def test_sixteen_concurrent_requests_all_complete(server: GatewayServer) -> None:
    async def main():
        c = _aclient(server)
        return await asyncio.gather(*[
            c.chat.completions.create(
                model=server.model, max_tokens=4, temperature=0.8, seed=i,
                messages=[{"role": "user", "content": f"Give me a word about the number {i}."}])
            for i in range(16)
        ])

    results = asyncio.run(main())
    assert len(results) == 16
    for r in results:
        assert r.choices[0].finish_reason in ("stop", "length")
        assert 1 <= r.usage.completion_tokens <= 4


def test_sampling_options(server: GatewayServer, client: OpenAI) -> None:
    forced = {"2000": 100}  # a logit bias that makes the same token win every step

    async def main():
        c = _aclient(server)
        seeded = dict(model=server.model, messages=CHAT, n=2, seed=7, temperature=1.0,
                      max_tokens=6)
        return await asyncio.gather(
            c.chat.completions.create(**seeded),
            c.chat.completions.create(**seeded),
            c.chat.completions.create(model=server.model, messages=CHAT, max_tokens=3,
                                      temperature=0, logprobs=True, top_logprobs=2),
            c.completions.create(model=server.model, prompt="Hi", max_tokens=6, temperature=0,
                                 logit_bias=forced, logprobs=1),
            c.chat.completions.create(
                model=server.model, messages=CHAT, max_tokens=5, presence_penalty=1.5,
                frequency_penalty=0.5, top_p=0.9,
                extra_body={"top_k": 5, "min_p": 0.05, "ignore_eos": True, "future_field": 1}),
            c.completions.create(model=server.model, prompt="Echo me", max_tokens=2, echo=True),
        )

    a, b, lp, biased, extras, echo = asyncio.run(main())
    assert [ch.index for ch in a.choices] == [0, 1]
    assert [ch.message.content for ch in a.choices] == [ch.message.content for ch in b.choices]
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
    tokens = biased.choices[0].logprobs.tokens
    assert len(tokens) == 6 and len(set(tokens)) == 1
    assert extras.choices[0].finish_reason == "length" and extras.usage.completion_tokens == 5
    assert echo.choices[0].text.startswith("Echo me")

    full = biased.choices[0].text
    stop = full[1:4]  # spans token boundaries when the token is short
    stopped = client.completions.create(model=server.model, prompt="Hi", max_tokens=6,
                                        temperature=0, logit_bias=forced, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == full[: full.index(stop)]
    streamed = "".join(
        ch.choices[0].text for ch in client.completions.create(
            model=server.model, prompt="Hi", max_tokens=6, temperature=0, logit_bias=forced,
            stop=[stop], stream=True))
    assert streamed == stopped.choices[0].text  # the stop string never leaks into a stream


def test_wrong_or_missing_key_is_401(server: GatewayServer) -> None:
    bad = OpenAI(base_url=server.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=server.model, messages=CHAT, max_tokens=1)
    r = httpx.post(server.base_url + "/chat/completions", json={"model": server.model})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


MALFORMED = [
    b"this is not json",
    b"[1, 2, 3]",
    b"",
    b'{"model": "SmolLM2-135M-Instruct"}',
    b'{"model": "SmolLM2-135M-Instruct", "messages": "hi"}',
    b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "robot", "content": "x"}]}',
    b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": 1}]}',
    b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}], '
    b'"max_tokens": "ten"}',
    b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}], '
    b'"temperature": 7}',
    b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}], '
    b'"max_tokens": 999999}',
    b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}], '
    b'"logit_bias": {"not-a-token": 1}}',
    b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}], '
    b'"stream_options": {"include_usage": true}}',
    b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}], '
    b'"response_format": {"type": "json_schema"}}',
    b"\xff\xfe\x00garbage",
]


@pytest.mark.parametrize("body", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_bodies_are_400_in_the_error_shape(server: GatewayServer, body: bytes) -> None:
    r = httpx.post(server.base_url + "/chat/completions", content=body,
                   headers={**_headers(server.api_key), "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_other_client_errors(server: GatewayServer, client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=1)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=server.model, prompt=[10**9], max_tokens=1)
    h = _headers(server.api_key)
    r = httpx.post(server.base_url + "/completions", headers=h,
                   content=b'{"prompt": "' + b"x" * (5 * 2**20) + b'"}')
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert httpx.get(server.base_url + "/chat/completions", headers=h).status_code == 405
    assert httpx.get(server.base_url + "/nothing", headers=h).json()["error"]["code"]


def test_metrics_expose_the_histograms(server: GatewayServer, client: OpenAI) -> None:
    client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=2)
    m = server.metrics()
    assert m["switchboard_time_to_first_token_seconds_count"] >= 1
    assert m["switchboard_time_per_output_token_seconds_count"] >= 1
    assert 'switchboard_time_to_first_token_seconds_bucket{le="+Inf"}' in m
    assert m["switchboard_request_queue_time_seconds_count"] >= 1
    assert m["switchboard_preemptions_total"] == 0  # a pool of 160 pages never ran short
    assert m['switchboard_engine_steps_total{kind="synchronous"}'] >= 2  # prefill, decode
    assert m['switchboard_engine_step_seconds_total{kind="synchronous"}'] > 0
    loop = {part: m[f'switchboard_engine_loop_seconds_total{{part="{part}"}}']
            for part in ("wait", "commands", "step", "publish")}
    assert loop["step"] >= m['switchboard_engine_step_seconds_total{kind="synchronous"}']
    assert loop["wait"] > 0 and loop["commands"] > 0 and loop["publish"] > 0
    assert m["switchboard_kv_pages_total"] == 160 and "switchboard_kv_pages_used" in m
    assert "switchboard_queue_depth" in m and "switchboard_running_batch_size" in m
    assert m['switchboard_prompt_tokens_total{tenant="alpha"}'] > 0
    assert m['switchboard_generation_tokens_total{tenant="alpha"}'] > 0
    assert m['switchboard_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 1


def _wait_pages_free(server: GatewayServer, timeout: float = 60) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if busy_pages(m) <= 0 and m["switchboard_running_batch_size"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.1)


def _open_stream(server: GatewayServer, key: str, client: httpx.Client):
    body = {"model": server.model, "messages": CHAT, "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    return client.stream("POST", server.base_url + "/chat/completions", json=body,
                         headers=_headers(key), timeout=300)


def test_an_aborted_stream_frees_its_pages(server: GatewayServer) -> None:
    _wait_pages_free(server)
    with httpx.Client() as http, _open_stream(server, server.api_key, http) as r:
        lines = r.iter_lines()
        for _ in range(3):
            while not next(lines).startswith("data:"):
                pass
        assert busy_pages(server.metrics()) > 0
    m = _wait_pages_free(server, timeout=30)  # the client went away mid-stream
    assert m['switchboard_sequences_finished_total{finish_reason="abort"}'] >= 1


def test_a_client_gone_before_the_answer_frees_its_pages(server: GatewayServer) -> None:
    _wait_pages_free(server)
    aborted = server.metrics().get('switchboard_sequences_finished_total{finish_reason="abort"}', 0)
    body = {"model": server.model, "messages": CHAT, "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # not streamed: the client gives up waiting
        httpx.post(server.base_url + "/chat/completions", json=body,
                   headers=_headers(server.api_key), timeout=httpx.Timeout(60, read=1.5))
    m = _wait_pages_free(server, timeout=30)
    assert m['switchboard_sequences_finished_total{finish_reason="abort"}'] == aborted + 1


def test_full_queue_answers_429_at_once(server: GatewayServer) -> None:
    async def one(http: httpx.AsyncClient) -> httpx.Response:
        body = {"model": server.model, "messages": CHAT, "max_tokens": 1}
        return await http.post(server.base_url + "/chat/completions", json=body, timeout=300)

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(headers=_headers(server.api_key)) as http:
            return await asyncio.gather(*[one(http) for _ in range(40)])

    responses = asyncio.run(main())
    refused = [r for r in responses if r.status_code == 429]
    served = [r for r in responses if r.status_code == 200]
    assert len(refused) + len(served) == 40 and refused and len(served) >= 16
    for r in refused:
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
    assert max(r.elapsed for r in refused) < min(r.elapsed for r in served)


def test_tenant_limits(server: GatewayServer) -> None:
    beta = OpenAI(base_url=server.base_url, api_key="sk-test-beta", max_retries=0, timeout=300)
    with httpx.Client() as http, _open_stream(server, "sk-test-beta", http) as r:
        lines = r.iter_lines()  # keep a reference: closing this iterator closes the stream
        while not next(lines).startswith("data:"):
            pass
        with pytest.raises(openai.RateLimitError) as e:
            beta.chat.completions.create(model=server.model, messages=CHAT, max_tokens=1)
        assert e.value.body["code"] == "concurrency_limit_exceeded"
    _wait_pages_free(server)
    beta.chat.completions.create(model=server.model, messages=CHAT, max_tokens=1)

    gamma = OpenAI(base_url=server.base_url, api_key="sk-test-gamma", max_retries=0, timeout=300)
    first = gamma.chat.completions.create(model=server.model, messages=CHAT, max_tokens=12,
                                          extra_body={"ignore_eos": True})
    assert first.usage.total_tokens >= 40  # the tenant's whole minute
    with pytest.raises(openai.RateLimitError) as e:
        gamma.chat.completions.create(model=server.model, messages=CHAT, max_tokens=1)
    assert e.value.body["code"] == "tokens_per_minute_exceeded"
    assert 1 <= int(e.value.response.headers["Retry-After"]) <= 60


def test_examples_chat_runs_against_the_server(server: GatewayServer) -> None:
    env = {**os.environ, "OPENAI_BASE_URL": server.base_url, "OPENAI_API_KEY": server.api_key}
    out = subprocess.run(
        [sys.executable, "examples/chat.py", "--max-tokens", "6", "Hello!", "Thanks!"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("assistant> ") == 2
    assert "completion tokens" in out.stderr
