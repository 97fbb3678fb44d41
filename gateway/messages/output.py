"""The reply as Anthropic's message, or as its stream of events.

A message's content is blocks: `thinking` (a reasoning model's reasoning), then `text`, then
`tool_use` blocks when the request offered tools (the chat's call parser, grammar/tool_parser.py,
splits the output). The stream is

    message_start, ping,
    per block: content_block_start, content_block_delta (text_delta, thinking_delta,
               input_json_delta), content_block_stop,
    message_delta (stop_reason, stop_sequence, usage), message_stop

and an `error` event if generation fails. Both are built from the same parser's events, so the
`anthropic` SDK's stream helper assembles the message the non-streamed call returns. A call cut
by max_tokens streams as far as it came; the non-streamed message keeps only whole calls that
validate, as chat completions do.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator

import orjson

from engine.messages import RequestOutput
from gateway.errors import anthropic_error, generation_failed
from gateway.openai.generation import Choice, Generation
from grammar.tool_parser import Arguments, CallStart, Text, ToolCallParser
from grammar.tools import tool_parser, valid_calls

Block = dict[str, object]
Event = dict[str, object]


def usage(gen: Generation) -> dict[str, int]:
    """Anthropic's usage: `input_tokens` are the prompt tokens the prefix cache did not hold."""
    c = gen.ordered[0]
    prompt, cached = len(c.job.prompt_ids), c.num_cached_tokens
    return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": len(c.token_ids)}


def stop_reason(c: Choice, calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished choice; `calls`: it made a whole call."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


class MessageFormat:
    """`omit_thinking` (`thinking.display` "omitted"): thinking blocks come without their
    text."""

    def __init__(self, gen: Generation, model: str, omit_thinking: bool = False):
        self.gen, self.model, self.omit_thinking = gen, model, omit_thinking
        self.choice = gen.ordered[0]
        spec = self.choice.job.params.constraint
        self.spec = spec if spec is not None and spec.kind == "tool_calls" else None

    def message(self, content: list[Block], usage: dict[str, int], stop: str | None = None,
                sequence: str | None = None) -> dict[str, object]:
        return {"id": self.gen.response_id, "type": "message", "role": "assistant",
                "model": self.model, "content": content, "stop_reason": stop,
                "stop_sequence": sequence, "usage": usage}

    def body(self) -> dict[str, object]:
        """The finished (non-streamed) message."""
        c = self.choice
        content: list[Block] = []
        if c.reasoning:
            content.append(_thinking("" if self.omit_thinking else c.reasoning))
        if self.spec is None:
            if c.text:
                content.append(_text(c.text))
            return self.message(content, usage(self.gen), *stop_reason(c, False))
        parsed = tool_parser(self.spec)
        parsed.feed(c.text, final=True)
        if parsed.result.content:
            content.append(_text(parsed.result.content))
        calls = valid_calls(self.spec, parsed.result.calls)
        content += [{"type": "tool_use", "id": _tool_id(), "name": call.name,
                     "input": json.loads(call.arguments)} for call in calls]
        return self.message(content, usage(self.gen), *stop_reason(c, bool(calls)))

    async def events(self) -> AsyncGenerator[str, None]:
        """The stream; an `error` event, and no message_stop, when generation fails."""
        try:
            start = self.message([], {**usage(self.gen), "output_tokens": 0})
            yield sse({"type": "message_start", "message": start}) + sse({"type": "ping"})
            blocks = Blocks(tool_parser(self.spec) if self.spec is not None else None,
                            self.omit_thinking)
            async for c, out in self.gen.outputs():
                if c.finish_reason == "error":
                    failure = generation_failed(c.error, c.error_code)
                    yield sse(anthropic_error(failure)[1])
                    return
                events = blocks.feed(out)
                if events:
                    yield "".join(sse(e) for e in events)
            c = self.choice
            if c.finish_reason in (None, "abort"):  # the client left
                return
            stop, sequence = stop_reason(c, blocks.calls)
            delta: Event = {"type": "message_delta", "usage": usage(self.gen),
                     "delta": {"stop_reason": stop, "stop_sequence": sequence}}
            yield sse(delta) + sse({"type": "message_stop"})
        finally:
            self.gen.close()


class Blocks:
    """Content blocks as the output streams: each engine output's reasoning and text (split
    into text and calls by `parser`, when the request offered tools) as block events."""

    def __init__(self, parser: ToolCallParser | None, omit_thinking: bool = False):
        self.parser, self.omit_thinking = parser, omit_thinking
        self.index = -1
        self.open: str | None = None  # the open block's kind

    @property
    def calls(self) -> bool:
        """Whether a whole call came out."""
        return self.parser is not None and any(c.complete for c in self.parser.result.calls)

    def feed(self, out: RequestOutput) -> list[Event]:
        events: list[Event] = []
        if out.new_reasoning_text and self.omit_thinking:
            events += [] if self.open == "thinking" else self._start("thinking", _thinking(""))
        elif out.new_reasoning_text:
            events += self._delta("thinking", {"type": "thinking_delta",
                                               "thinking": out.new_reasoning_text})
        if self.parser is None:
            if out.new_text:
                events += self._delta("text", {"type": "text_delta", "text": out.new_text})
        else:
            for e in self.parser.feed(out.new_text, out.finished):
                if isinstance(e, Text) and e.text:
                    events += self._delta("text", {"type": "text_delta", "text": e.text})
                elif isinstance(e, CallStart):
                    events += self._start("tool_use", {"type": "tool_use", "id": _tool_id(),
                                                       "name": e.name, "input": {}})
                elif isinstance(e, Arguments) and e.text:
                    events.append(self._event({"type": "input_json_delta",
                                               "partial_json": e.text}))
        if out.finished:
            events += self._stop()
        return events

    def _delta(self, kind: str, delta: dict[str, object]) -> list[Event]:
        events = []
        if self.open != kind:
            events = self._start(kind, _thinking("") if kind == "thinking" else _text(""))
        return [*events, self._event(delta)]

    def _event(self, delta: dict[str, object]) -> Event:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def _start(self, kind: str, block: Block) -> list[Event]:
        events = self._stop()
        self.index += 1
        self.open = kind
        return [*events, {"type": "content_block_start", "index": self.index,
                          "content_block": block}]

    def _stop(self) -> list[Event]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]


def sse(data: dict[str, object]) -> str:
    return f"event: {data['type']}\ndata: {orjson.dumps(data).decode()}\n\n"


def _text(text: str) -> Block:
    return {"type": "text", "text": text}


def _thinking(text: str) -> Block:
    # No signature: nothing here verifies one when the client sends the block back.
    return {"type": "thinking", "thinking": text, "signature": ""}


def _tool_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"

