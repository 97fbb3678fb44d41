"""Server-sent events in OpenAI's streaming shape: `data: {chunk}` lines, then `data: [DONE]`.

A client that disconnects ends the stream: Starlette cancels the body iterator (or its next
send fails); either way the iterator is closed and its `finally` aborts the generation, so the
engine frees the request's pages before its next step.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Protocol

import orjson
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.messages import RequestOutput
from gateway.errors import error_body, generation_failed
from gateway.openai.generation import Choice, Generation

DONE = "data: [DONE]\n\n"


class StreamFormat(Protocol):
    def chunks(self, choice: Choice, out: RequestOutput) -> list[dict[str, object]]: ...
    def usage_chunk(self) -> dict[str, object]: ...


def event(data: dict[str, object]) -> str:
    return f"data: {orjson.dumps(data).decode()}\n\n"


async def stream_events(
    gen: Generation, fmt: StreamFormat, include_usage: bool
) -> AsyncGenerator[str, None]:
    try:
        events: list[str] = []  # written together while more outputs are queued
        async for choice, out in gen.outputs():
            if choice.finish_reason == "error":
                failure = generation_failed(choice.error, choice.error_code)
                events.append(event(error_body(failure.message, "server_error", None,
                                               failure.code)))
            else:
                events += [event(chunk) for chunk in fmt.chunks(choice, out)]
            if events and not (gen.pending or gen.done):  # the last go with the usage
                yield "".join(events)
                events = []
        if include_usage:
            events.append(event(fmt.usage_chunk()))
        if events:
            yield "".join(events)
        yield DONE  # alone: a session's stream holds it back until its history is written
    finally:
        gen.close()


class SSEResponse(StreamingResponse):
    """A streaming response that always cleans up, however the stream ends: the body
    iterator is closed and `on_close` runs (even when the client left before the first
    chunk, when the iterator's own `finally` never ran)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncGenerator[str, None], on_close: Callable[[], None]):
        super().__init__(content, headers={"Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        self.events = content  # `body_iterator` itself, typed as the generator it is
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.events.aclose()
