"""Hardening, round two: slow and stalled clients take no connections or memory from others.
Real sockets against one real `switchboard serve` with small limits: headers and bodies that
stall are cut at their deadlines, connections beyond the cap take the stalest places while
/health answers throughout, and a stream whose client stops reading is aborted in the engine
(its KV pages freed) and its connection closed, while another client is served."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.access.connections import ConnectionLimits
from tests.conftest import GatewayServer, busy_pages, read_metrics, serve

DEADLINE_S = 2.0  # --header-timeout and --body-timeout
KEEP_ALIVE_S = 3.0  # --keep-alive-timeout
CAP = 32  # --max-connections
STREAM_BUFFER = 16384  # --max-stream-buffer-bytes
HEALTH_S = 1.0  # the slowest /health answer allowed
REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n"
           b"Authorization: Bearer sk-test-alpha\r\n")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    with serve(tmp_path_factory.mktemp("slow"), "--header-timeout", str(DEADLINE_S),
               "--body-timeout", str(DEADLINE_S), "--keep-alive-timeout", str(KEEP_ALIVE_S),
               "--max-connections", str(CAP),
               "--max-stream-buffer-bytes", str(STREAM_BUFFER)) as s:
        yield s


def _connect(server: GatewayServer, sent: bytes = b"") -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    s.sendall(sent)
    return s


def _read_all(s: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset ends it too)."""
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _dropped(server: GatewayServer, reason: str) -> float:
    return read_metrics(server.url)[f'switchboard_connections_dropped_total{{reason="{reason}"}}']


def _health(server: GatewayServer) -> float:
    """One /health on a fresh connection, as a probe makes it: its latency (asserts a 200)."""
    t = time.monotonic()
    r = httpx.get(server.url + "/health", timeout=HEALTH_S * 5)
    assert r.status_code == 200, r.text
    return time.monotonic() - t


def test_stalled_headers_and_bodies_are_cut_at_their_deadlines(server: GatewayServer) -> None:
    late = _dropped(server, "header_timeout")
    t = time.monotonic()
    s = _connect(server, b"GET /health HTTP/1.1\r\nHo")  # a partial header, then nothing
    answer = _read_all(s)
    took = time.monotonic() - t
    assert answer.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in answer
    assert DEADLINE_S - 0.1 < took < DEADLINE_S + 3, took
    assert _dropped(server, "header_timeout") == late + 1

    t = time.monotonic()  # the headers, then a tenth of the body they announce
    s = _connect(server, REQUEST + b"Content-Length: 100\r\n\r\n" + b"{" * 10)
    assert _read_all(s) == b""  # the app had the request: it hears of a disconnect
    assert DEADLINE_S - 0.1 < time.monotonic() - t < DEADLINE_S + 3
    assert _dropped(server, "body_timeout") >= 1


def test_an_idle_connection_outlives_the_clients_keep_alive(server: GatewayServer) -> None:
    """A keep-alive connection idle past the header deadline still takes the next request
    (clients reuse theirs for up to 5 s: a server closing one first races their next request,
    which then reads a reset); idle past --keep-alive-timeout, the server closes it, and that
    is no dropped connection. The default outlasts httpx's (and the openai SDK's) idle expiry."""
    assert ConnectionLimits().keep_alive_timeout > httpx.Limits().keepalive_expiry
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    late = _dropped(server, "header_timeout")
    for idle in (0.0, DEADLINE_S + 0.5):
        time.sleep(idle)
        conn.request("GET", "/health")
        r = conn.getresponse()
        assert r.status == 200 and r.read()
    t = time.monotonic()
    assert conn.sock.recv(1) == b""  # closed by the server, unprompted
    assert KEEP_ALIVE_S - 0.1 < time.monotonic() - t < KEEP_ALIVE_S + 3
    assert _dropped(server, "header_timeout") == late


def test_a_flood_beyond_the_cap_takes_the_stalest_places(server: GatewayServer) -> None:
    """Half again the cap in stalled connections: the oldest are closed as newer ones come
    (without a word: under a flood a write costs as much as the close), /health answers at
    once throughout, and once the header deadline has passed every stalled connection is gone
    and requests are served again."""
    evicted = _dropped(server, "evicted")
    flood = [_connect(server, b"GET /v1/models HTTP/1.1\r\nX-Slow: ") for _ in range(CAP * 3 // 2)]
    latencies = []
    end = time.monotonic() + DEADLINE_S + 1.5  # through the deadline and past it
    while time.monotonic() < end:
        latencies.append(_health(server))
        time.sleep(0.1)
    assert max(latencies) < HEALTH_S, latencies
    answers = [_read_all(s) for s in flood]
    assert len([a for a in answers if a == b""]) >= CAP // 2
    assert answers[0] == b""  # the oldest went first
    assert all(a == b"" or a.startswith(b"HTTP/1.1 408 ") for a in answers)
    assert _dropped(server, "evicted") - evicted >= CAP // 2
    m = read_metrics(server.url)
    assert m["switchboard_connections_open"] <= 2, m["switchboard_connections_open"]
    r = httpx.post(server.base_url + "/chat/completions", timeout=60,
                   headers={"Authorization": f"Bearer {server.api_key}"},
                   json={"model": server.model, "max_tokens": 4,
                         "messages": [{"role": "user", "content": "Hi!"}]})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_a_stream_nobody_reads_is_aborted_and_frees_its_pages(server: GatewayServer) -> None:
    """A client that sends a streaming request and never reads: tiny receive buffer, and a
    small MSS, which keeps the server's socket buffer small (as over a real network rather
    than loopback). Past the stream buffer bound the request ends (aborted, pages freed) and
    the connection closes; another client's request is served meanwhile."""
    before = read_metrics(server.url)
    aborted = before.get('switchboard_sequences_finished_total{finish_reason="abort"}', 0)
    body = json.dumps({"model": server.model, "max_tokens": 1500, "ignore_eos": True, "n": 4,
                       "stream": True, "logprobs": True, "top_logprobs": 20,
                       "messages": [{"role": "user", "content": "Tell me a long story."}]})
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    host, port = server.url.removeprefix("http://").split(":")
    s.connect((host, int(port)))
    s.sendall(REQUEST + f"Content-Length: {len(body)}\r\n\r\n{body}".encode())

    other: list[httpx.Response] = []
    served = threading.Thread(target=lambda: other.append(httpx.post(
        server.base_url + "/completions", timeout=60,
        headers={"Authorization": f"Bearer {server.api_key}"},
        json={"model": server.model, "prompt": "Once upon a time", "max_tokens": 8})))
    served.start()
    deadline = time.monotonic() + 45
    while time.monotonic() < deadline:
        m = read_metrics(server.url)
        if m['switchboard_connections_dropped_total{reason="stream_buffer"}'] >= 1:
            break
        time.sleep(0.5)
    else:
        pytest.fail("the unread stream was never aborted")
    served.join(60)
    assert other and other[0].status_code == 200
    assert other[0].json()["usage"]["completion_tokens"] == 8
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = read_metrics(server.url)
        idle = busy_pages(m) <= 0 and m["switchboard_running_batch_size"] == 0
        if idle and m["switchboard_requests_in_flight"] == 0:
            break
        time.sleep(0.2)
    assert busy_pages(m) <= 0 and m["switchboard_running_batch_size"] == 0
    assert m["switchboard_requests_in_flight"] == 0
    assert m['switchboard_sequences_finished_total{finish_reason="abort"}'] == aborted + 4
    s.settimeout(10)
    assert b"HTTP/1.1 200 " in _read_all(s)[:64]  # what had reached it, then the close
    s.close()
    assert "read nothing while" in Path(server.log).read_text()
