"""The engine thread, with a fake engine (no model): outputs reach their sinks, a failing
request never kills the loop, an abort is applied before the next step."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest

from engine.config import EngineConfig
from engine.ipc.async_engine import AsyncEngine
from engine.messages import GenerateRequest, RequestOutput
from engine.sampling.params import InvalidRequestError, SamplingParams

POISON_ADD, POISON_STEP, INVALID = 13, 17, 19  # max_tokens values that make the fake fail


@dataclass
class _Req:
    request_id: str
    params: SamplingParams
    num_out: int = 0


class _Allocator:
    num_pages = 100

    def __init__(self, engine: FakeEngine):
        self.engine = engine

    @property
    def num_used(self) -> int:
        return len(self.engine.requests)  # one page per live request


class _Scheduler:
    def __init__(self, engine: FakeEngine):
        self.engine = engine

    @property
    def running(self) -> list[_Req]:
        return list(self.engine.requests.values())

    def requests(self) -> list[_Req]:
        return self.running


class FakeEngine:
    """Each step emits one token ("x") per live request."""

    max_model_len = 64
    max_num_seqs = 8
    model_dir = None

    def __init__(self, cfg: EngineConfig):
        self.requests: dict[str, _Req] = {}
        self.allocator = _Allocator(self)
        self.scheduler = _Scheduler(self)
        self.log: list[tuple[str, tuple[str, ...]]] = []

    def validate(self, prompt: list[int], params: SamplingParams) -> None:
        pass

    def add_request(self, rid: str, prompt: list[int], params: SamplingParams, tenant: str,
                    session_id: str | None = None):
        if params.max_tokens == POISON_ADD:
            raise RuntimeError("poisoned add")
        if params.max_tokens == INVALID:
            raise InvalidRequestError("refused", "max_tokens")
        self.requests[rid] = _Req(rid, params)

    def abort_request(self, rid: str) -> RequestOutput | None:
        self.log.append(("abort", (rid,)))
        if self.requests.pop(rid, None) is None:
            return None
        return RequestOutput(rid, [], "", finished=True, finish_reason="abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.requests)

    num_waiting = 0

    def step(self) -> list[RequestOutput]:
        time.sleep(0.005)
        self.log.append(("step", tuple(self.requests)))
        outs = []
        for r in list(self.requests.values()):
            if r.params.max_tokens == POISON_STEP:  # fails after others finished this step
                raise RuntimeError("poisoned step")
            r.num_out += 1
            done = r.num_out >= r.params.max_tokens
            if done:
                del self.requests[r.request_id]
            outs.append(RequestOutput(r.request_id, [7], "x", finished=done,
                                      finish_reason="length" if done else None))
        return outs


def _engine(factory=FakeEngine) -> AsyncEngine:
    return AsyncEngine(EngineConfig(), engine_factory=factory)


async def _started(factory=FakeEngine) -> AsyncEngine:
    eng = _engine(factory)
    eng.start(asyncio.get_running_loop())
    assert await asyncio.to_thread(eng.wait_loaded, 10)
    return eng


def _req(rid: str, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens))


async def _collect(eng: AsyncEngine, req: GenerateRequest) -> list[RequestOutput]:
    sink: asyncio.Queue[RequestOutput] = asyncio.Queue()
    eng.add_request(req, sink)
    outs = []
    while not (outs and outs[-1].finished):
        outs.append(await asyncio.wait_for(sink.get(), 5))
    return outs


def test_outputs_reach_their_sinks() -> None:
    async def main() -> None:
        eng = await _started()
        a, b = await asyncio.gather(_collect(eng, _req("a", 3)), _collect(eng, _req("b", 5)))
        assert [o.new_text for o in a] == ["x"] * 3 and a[-1].finish_reason == "length"
        assert len(b) == 5 and all(o.request_id == "b" for o in b)
        assert eng.num_outstanding == 0
        eng.shutdown()
        assert not eng.alive

    asyncio.run(main())


@pytest.mark.parametrize("bad", [POISON_ADD, INVALID])
def test_a_failing_add_fails_only_that_request(bad: int) -> None:
    async def main() -> None:
        eng = await _started()
        good, failed = await asyncio.gather(_collect(eng, _req("good", 4)),
                                            _collect(eng, _req("bad", bad)))
        assert failed[-1].finish_reason == "error" and failed[-1].error
        assert good[-1].finish_reason == "length" and len(good) == 4
        assert eng.alive and eng.ready
        eng.shutdown()

    asyncio.run(main())


def test_a_failing_step_fails_its_batch_and_the_loop_goes_on() -> None:
    async def main() -> None:
        # Queued before the loop starts, so both land in the first step. "one" finishes inside
        # that step before "boom" breaks it: its output is lost, so it must fail too rather
        # than hang.
        eng = _engine()
        collecting = [asyncio.ensure_future(_collect(eng, _req(rid, n)))
                      for rid, n in (("one", 1), ("boom", POISON_STEP))]
        await asyncio.sleep(0)  # both requests are queued now
        eng.start(asyncio.get_running_loop())
        one, failed = await asyncio.gather(*collecting)
        assert failed[-1].finish_reason == "error" and "poisoned step" in failed[-1].error
        assert one[-1].finish_reason == "error"
        assert eng.alive
        after = await _collect(eng, _req("after", 2))
        assert after[-1].finish_reason == "length"
        await asyncio.sleep(0.05)
        assert eng.stats.kv_pages_used == 0
        eng.shutdown()

    asyncio.run(main())


def test_abort_is_applied_before_the_next_step() -> None:
    async def main() -> None:
        eng = await _started()
        sink: asyncio.Queue[RequestOutput] = asyncio.Queue()
        eng.add_request(_req("long", 1000), sink)
        await asyncio.wait_for(sink.get(), 5)  # it runs
        eng.abort("long")
        assert eng.num_outstanding == 0
        for _ in range(200):
            if eng.stats.kv_pages_used == 0:
                break
            await asyncio.sleep(0.01)
        assert eng.stats.kv_pages_used == 0
        log = eng._engine.log
        i = log.index(("abort", ("long",)))
        assert all("long" not in ids for kind, ids in log[i:] if kind == "step")
        eng.shutdown()

    asyncio.run(main())


def test_load_failure_is_reported_not_raised() -> None:
    def broken(cfg: EngineConfig) -> FakeEngine:
        raise OSError("no weights here")

    async def main() -> None:
        eng = _engine(broken)
        eng.start(asyncio.get_running_loop())
        assert await asyncio.to_thread(eng.wait_loaded, 10)
        assert isinstance(eng.load_error, OSError) and not eng.ready

    asyncio.run(main())


def _load_tiny(tmp_path, check) -> None:
    """Load a real engine (synthetic:tiny) through an `AsyncEngine`, then `check(engine)`."""

    async def run() -> None:
        engine = AsyncEngine(EngineConfig(model="synthetic:tiny", cache_dir=tmp_path,
                                          num_pages=64, max_loras=0))
        engine.start(asyncio.get_running_loop())
        try:
            assert await asyncio.to_thread(engine.wait_loaded, 120)
            assert engine.load_error is None and engine.ready
            check(engine)
        finally:
            await asyncio.to_thread(engine.shutdown)

    asyncio.run(run())


def test_a_loaded_engine_has_built_its_grammar_compiler(tmp_path):
    """The server's engine builds its grammar compiler while it loads, so the first constrained
    request neither waits for it nor stalls every stream while it is built (it holds the GIL
    for most of its ~1.3 s)."""

    def built(engine: AsyncEngine) -> None:
        assert engine._engine.grammar._compiler is not None

    _load_tiny(tmp_path, built)


def test_a_grammar_compiler_that_cannot_start_does_not_stop_the_load(tmp_path, monkeypatch):
    """Building the compiler at load is an optimization: when it fails (a tokenizer without
    EOS, say; here the build raises), the engine loads anyway and the failure waits for a
    constrained request."""
    from engine.sampling.structured import GrammarStage

    monkeypatch.setattr(GrammarStage, "compiler", property(lambda self: 1 / 0))
    _load_tiny(tmp_path, lambda engine: None)
