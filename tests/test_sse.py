"""The SSE stream's writes: one per engine output while the stream keeps up, and the outputs
queued behind a stream that fell behind (a busy event loop) in one write, each still its own
event, so a client sees the same chunks either way."""

from __future__ import annotations

import asyncio
import json

from engine.messages import RequestOutput
from engine.protocols import EngineStats
from engine.sampling.params import SamplingParams
from gateway.access.limits import LocalTicket, TenantLimiter
from gateway.config import TenantLimits
from gateway.metrics import Metrics
from gateway.openai.bodies import CompletionFormat
from gateway.openai.generation import Generation
from gateway.openai.params import Job
from gateway.openai.sse import DONE, stream_events


def _generation() -> Generation:
    ticket = LocalTicket(TenantLimiter(lambda tenant: TenantLimits()), "t")
    metrics = Metrics(lambda: EngineStats(), lambda: 0)
    job = Job(0, 0, [1, 2, 3], SamplingParams(max_tokens=4))
    return Generation(None, "cmpl-1", [job], "t", ticket, metrics)  # type: ignore[arg-type]


def _output(i: int, text: str, last: bool = False) -> RequestOutput:
    return RequestOutput(request_id="cmpl-1-0", new_token_ids=[i], new_text=text, finished=last,
                         finish_reason="length" if last else None)


def _texts(write: str) -> list[str]:
    events = [e for e in write.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [json.loads(e[6:])["choices"][0]["text"] for e in events]


def test_outputs_queued_behind_a_stream_go_out_in_one_write() -> None:
    async def run() -> None:
        gen = _generation()
        writes = stream_events(gen, CompletionFormat(gen, "m", None, False), False)  # type: ignore[arg-type]
        gen.sink.put_nowait(_output(0, "a"))
        assert _texts(await anext(writes)) == ["a"]  # kept up: a write per output
        gen.sink.put_nowait(_output(1, "b"))
        gen.sink.put_nowait(_output(2, "c"))
        assert _texts(await anext(writes)) == ["b", "c"]  # fell behind: one write, two events
        gen.sink.put_nowait(_output(3, "d", last=True))
        assert _texts(await anext(writes)) == ["d"]
        assert await anext(writes) == DONE
        assert gen.ordered[0].text == "abcd" and gen.ordered[0].finish_reason == "length"

    asyncio.run(run())


def test_the_usage_chunk_shares_the_last_write_and_done_stays_alone() -> None:
    async def run() -> None:
        gen = _generation()
        for i, text in enumerate("xyz"):
            gen.sink.put_nowait(_output(i, text, last=i == 2))
        writes = [w async for w in stream_events(gen, CompletionFormat(gen, "m", None, True),  # type: ignore[arg-type]
                                                 include_usage=True)]
        assert writes[-1] == DONE and len(writes) == 2
        events = [json.loads(e[6:]) for e in writes[0].split("\n\n") if e]
        assert [e["choices"][0]["text"] for e in events[:-1]] == ["x", "y", "z"]
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3

    asyncio.run(run())
