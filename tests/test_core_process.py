"""The engine core in its own process (engine/ipc/core_process.py, engine/ipc/core_client.py):
outputs
reach their sinks over the socket, a core killed mid-stream fails every request in flight with
`engine_failed` within 2 s and is replaced, restarts are bounded, and nothing is orphaned.

The engine is tests/test_async_engine.py's fake (no model), built in the core process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from engine.config import EngineConfig
from engine.ipc.core_client import EngineProcess, EngineUnavailable
from engine.messages import GenerateRequest, RequestOutput
from engine.sampling.params import InvalidRequestError, SamplingParams
from tests.conftest import read_metrics
from tests.test_async_engine import FakeEngine
from tests.test_lora_http import make_adapter
from tests.test_sessions import redis_server, redis_url  # noqa: F401 - module-scoped fixtures


class SlowEngine(FakeEngine):
    """A token every 50 ms per request: a 40-token request runs 2 s."""

    def step(self) -> list[RequestOutput]:
        time.sleep(0.045)
        return super().step()


async def _started(restarts: int = 3) -> EngineProcess:
    eng = EngineProcess(EngineConfig(), restarts=restarts, engine_factory=SlowEngine)
    eng.start(asyncio.get_running_loop())
    assert await asyncio.to_thread(eng.wait_loaded, 60) and eng.load_error is None
    return eng


async def _collect(sink: asyncio.Queue) -> list[RequestOutput]:
    outs = []
    while not outs or not outs[-1].finished:
        outs.append(await asyncio.wait_for(sink.get(), 30))
    return outs


def _submit(eng: EngineProcess, rid: str, max_tokens: int) -> asyncio.Queue:
    sink: asyncio.Queue = asyncio.Queue()
    eng.add_request(GenerateRequest(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens)), sink)
    return sink


async def _until(predicate, timeout: float) -> None:  # noqa: ANN001 - a () -> bool
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_requests_run_in_the_core_process_and_its_facts_check_them():
    async def run() -> None:
        eng = await _started()
        try:
            assert eng.ready and eng.link.proc.pid != os.getpid() and eng.max_model_len == 64
            outs = await asyncio.gather(*(_collect(_submit(eng, f"r{i}", 3 + i))
                                          for i in range(4)))
            for i, seq in enumerate(outs):
                assert [o.new_text for o in seq] == ["x"] * (3 + i)
                assert seq[-1].finish_reason == "length"
            with pytest.raises(InvalidRequestError, match="maximum context length is 64"):
                eng.validate([1] * 10, SamplingParams(max_tokens=60))
            # an abort is applied in the core: the request stops, its sink hears nothing more
            sink = _submit(eng, "gone", 40)
            await asyncio.wait_for(sink.get(), 10)
            eng.abort("gone")
            await _until(lambda: eng.stats.num_running == 0, 5)
            assert eng.num_outstanding == 0
        finally:
            await asyncio.to_thread(eng.shutdown)
        assert eng.link.proc.exitcode == 0

    asyncio.run(run())


def test_a_killed_core_fails_its_requests_at_once_and_is_replaced():
    async def run() -> None:
        eng = await _started()
        try:
            first = eng.link.proc
            sinks = [_submit(eng, f"s{i}", 40) for i in range(16)]
            for sink in sinks:  # every stream has begun
                await asyncio.wait_for(sink.get(), 10)
            os.kill(first.pid, signal.SIGKILL)
            killed = time.monotonic()
            ends = await asyncio.gather(*(_collect(s) for s in sinks))
            assert time.monotonic() - killed < 2.0
            for seq in ends:
                assert seq[-1].finish_reason == "error" and seq[-1].error_code == "engine_failed"
                assert "exit code -9" in seq[-1].error
            assert not eng.ready and eng.num_outstanding == 0
            await _until(lambda: eng.ready, 60)
            assert eng.link.proc.pid != first.pid and eng.link.restarts == 1
            assert eng.fatal_error is None
            outs = await _collect(_submit(eng, "after", 3))
            assert [o.new_text for o in outs] == ["x", "x", "x"]
        finally:
            await asyncio.to_thread(eng.shutdown)

    asyncio.run(run())


def test_a_core_that_keeps_dying_is_not_restarted_past_the_limit():
    async def run() -> None:
        eng = await _started(restarts=1)
        try:
            os.kill(eng.link.proc.pid, signal.SIGKILL)
            await _until(lambda: eng.ready and eng.link.restarts == 1, 60)
            os.kill(eng.link.proc.pid, signal.SIGKILL)
            await _until(lambda: eng.fatal_error is not None, 10)
            assert "2 times" in eng.fatal_error and not eng.ready
            sink: asyncio.Queue = asyncio.Queue()
            eng.add_request(GenerateRequest("late", [1], SamplingParams(max_tokens=2)), sink)
            out = await asyncio.wait_for(sink.get(), 5)
            assert out.finish_reason == "error" and out.error_code == "engine_failed"
            with pytest.raises(EngineUnavailable):
                await eng.compile_grammar(None)  # type: ignore[arg-type]
        finally:
            await asyncio.to_thread(eng.shutdown)

    asyncio.run(run())


def test_a_core_that_cannot_load_reports_why_and_is_not_restarted(tmp_path):
    async def run() -> None:
        eng = EngineProcess(EngineConfig(model=str(tmp_path / "missing"), cache_dir=tmp_path))
        eng.start(asyncio.get_running_loop())
        assert await asyncio.to_thread(eng.wait_loaded, 120)
        assert eng.load_error is not None and "missing" in str(eng.load_error)
        await _until(lambda: not eng.link.alive, 10)
        assert eng.link.restarts == 0 and not eng.ready and eng.link.proc.exitcode is not None

    asyncio.run(run())


# -- through `switchboard serve` on the embedded model ------------------------------------------


def _core_pid(server_pid: int) -> int:
    """The pid of the serve process's engine core: its `spawn` child."""
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (p / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == server_pid and b"spawn_main" in cmd:
            return int(p.name)
    raise AssertionError(f"no engine core under pid {server_pid}")


def _stream(url: str, key: str, body: dict, first: threading.Event, done: list) -> None:
    events = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                first.set()
    done.append((time.monotonic(), events))


def _kill_core_under_streams(server, n: int) -> tuple[int, float, list]:  # noqa: ANN001
    """`n` streams that have each begun; then `kill -9` of the serve process's core. Returns
    the core's pid, when it was killed, and each stream's (end time, events) once all ended."""
    body = {"model": server.model, "max_tokens": 200, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a very long story."}]}
    firsts = [threading.Event() for _ in range(n)]
    done: list = []
    threads = [threading.Thread(target=_stream, args=(server.url, server.api_key, body, f,
                                                       done)) for f in firsts]
    for t in threads:
        t.start()
    for f in firsts:
        assert f.wait(60)
    core = _core_pid(server.pid)
    os.kill(core, signal.SIGKILL)
    killed = time.monotonic()
    for t in threads:
        t.join(30)
    assert len(done) == n
    return core, killed, done


def test_kill_9_of_the_core_under_16_streams(tmp_path):
    """All 16 streams end with an `engine_failed` error event and [DONE] within 2 s, /ready
    says 503 until the new core has loaded, then the server serves again: a session's next
    turn re-prefills from the stored history."""
    from tests.conftest import serve

    with serve(tmp_path, "--max-num-seqs", "16", "--max-queue", "32",
               "--kv-pages", "400") as server:
        headers = {"Authorization": f"Bearer {server.api_key}"}
        sid = httpx.post(server.url + "/v1/sessions", headers=headers, timeout=60, json={
            "model": server.model, "messages": [{"role": "system", "content": "Be brief."}]}
        ).json()["id"]
        turn = {"model": server.model, "max_tokens": 4, "temperature": 0, "session_id": sid,
                "messages": [{"role": "user", "content": "Hi!"}]}
        assert httpx.post(server.url + "/v1/chat/completions", headers=headers, json=turn,
                          timeout=60).status_code == 200

        core, killed, done = _kill_core_under_streams(server, 16)
        for ended, events in done:
            assert ended - killed < 2.0
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["code"] == "engine_failed" and "exit code -9" in error["message"]
        ready = httpx.get(server.url + "/ready")
        assert ready.status_code == 503
        deadline = time.monotonic() + 120
        while httpx.get(server.url + "/ready").status_code != 200:
            assert time.monotonic() < deadline, "the core was not restarted"
            time.sleep(0.2)
        assert _core_pid(server.pid) != core
        turn["messages"] = [{"role": "user", "content": "And again?"}]
        r = httpx.post(server.url + "/v1/chat/completions", headers=headers, json=turn,
                       timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        history = httpx.get(f"{server.url}/v1/sessions/{sid}", headers=headers).json()
        assert [m["role"] for m in history["messages"]] == [
            "system", "user", "assistant", "user", "assistant"]
        new_core = _core_pid(server.pid)
        os.kill(server.pid, signal.SIGKILL)  # the server dies: its core follows
        deadline = time.monotonic() + 5
        while Path(f"/proc/{new_core}").exists():
            assert time.monotonic() < deadline, "the core outlived its server"
            time.sleep(0.05)


def _spawned(pid: int) -> list[int]:
    """The serve process's `spawn` children: its engine core and its other HTTP servers."""
    out = []
    for p in Path("/proc").iterdir():
        try:
            if (p.name.isdigit() and b"spawn_main" in (p / "cmdline").read_bytes()
                    and int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid):
                out.append(int(p.name))
        except OSError:
            continue
    return out


def _sockets(pid: int) -> int:
    n = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            n += os.readlink(fd).startswith("socket:")
        except OSError:
            continue
    return n


def test_two_api_servers_share_the_port_and_the_core(tmp_path, redis_url):  # noqa: F811
    """`--api-servers 2`: a second HTTP process accepts connections on the same port; a
    session's turns alternate between the processes (history in Redis); a killed core fails
    both processes' streams and both serve again after its restart; SIGTERM stops all."""
    from tests.conftest import serve

    with serve(tmp_path, "--api-servers", "2", "--redis-url", redis_url,
               "--adapter-dir", str(tmp_path / "adapters")) as server:
        headers = {"Authorization": f"Bearer {server.api_key}"}
        children = _spawned(server.pid)
        assert len(children) == 2  # the core and the second HTTP process
        before = {pid: _sockets(pid) for pid in children}
        clients = [httpx.Client(base_url=server.url, headers=headers, timeout=60)
                   for _ in range(16)]
        try:
            for c in clients:  # 16 connections, kept open
                assert c.get("/ready").status_code == 200
            grew = [pid for pid in children if _sockets(pid) > before[pid]]
            assert grew, "no connection reached the second HTTP process"
            sid = clients[0].post("/v1/sessions", json={"model": server.model,
                                                        "messages": []}).json()["id"]
            for i, c in enumerate(clients[:6]):
                r = c.post("/v1/chat/completions", json={
                    "model": server.model, "session_id": sid, "max_tokens": 3,
                    "temperature": 0, "messages": [{"role": "user", "content": f"turn {i}"}]})
                assert r.status_code == 200, r.text
            history = clients[0].get(f"/v1/sessions/{sid}").json()["messages"]
            assert len(history) == 12

            # an adapter uploaded through one process serves through both, registered once:
            # the other process finds the shared version in the core's registry
            folder = make_adapter(tmp_path / "lora")
            files = [("files", (p.name, p.read_bytes())) for p in sorted(folder.iterdir())]
            assert clients[0].post("/v1/adapters", data={"name": "bot"},
                                   files=files).status_code == 200
            loads = read_metrics(server.url)['switchboard_adapter_loads_total{tier="host"}']
            for c in clients:
                r = c.post("/v1/completions", json={"model": "bot", "prompt": "Hi",
                                                    "max_tokens": 2})
                assert r.status_code == 200, r.text
                assert c.get("/v1/adapters/bot").json()["tier"] != "store"
            assert read_metrics(server.url)[
                'switchboard_adapter_loads_total{tier="host"}'] == loads

            _, killed, done = _kill_core_under_streams(server, 6)
            for ended, events in done:
                assert ended - killed < 2.0
                assert json.loads(events[-2])["error"]["code"] == "engine_failed"
            deadline = time.monotonic() + 120
            while not all(c.get("/ready").status_code == 200 for c in clients):
                assert time.monotonic() < deadline, "not every HTTP process serves again"
                time.sleep(0.2)
            for c in clients:
                r = c.post("/v1/completions", json={"model": server.model, "prompt": "Hi",
                                                    "max_tokens": 2})
                assert r.status_code == 200, r.text
        finally:
            for c in clients:
                c.close()
        left = _spawned(server.pid)
        os.kill(server.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while left := [pid for pid in left if Path(f"/proc/{pid}/cmdline").exists()
                       and Path(f"/proc/{pid}/cmdline").read_bytes()]:
            assert time.monotonic() < deadline, f"SIGTERM left {left} behind"
            time.sleep(0.1)
