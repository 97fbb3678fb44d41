"""OpenAI response bodies and stream chunks, for chat and text completions.

Both formats offer the same three methods the serving code calls: `body` (the whole response),
`chunks` (stream chunks for one engine output) and `usage_chunk`.
"""

from __future__ import annotations

import uuid

from engine.messages import RequestOutput, TokenLogprob
from gateway.openai.generation import Choice, Generation
from gateway.openai.tokenizer import GatewayTokenizer
from grammar.spec import ConstraintSpec
from grammar.tool_parser import Arguments, CallStart, Event, Text, ToolCallParser
from grammar.tools import tool_parser, valid_calls


class ChatFormat:
    """Chat responses. A choice constrained to tool calls is split by `ToolCallParser` into
    content and `tool_calls`, streamed as OpenAI's `delta.tool_calls` (index, id and name
    first, then argument fragments) that add up to exactly the non-streamed message."""

    def __init__(self, gen: Generation, model: str, tok: GatewayTokenizer, include_usage: bool):
        self.gen, self.model, self.tok, self.include_usage = gen, model, tok, include_usage
        self._started: set[int] = set()
        self._parsers: dict[int, ToolCallParser] = {}  # choice index -> its stream's parser
        self._ids: dict[tuple[int, int], str] = {}  # (choice, call) -> call id

    def body(self) -> dict[str, object]:
        choices = []
        for c in self.gen.ordered:
            message, finish = self.message(c)
            lp = self._logprobs(c.logprobs) if c.job.params.logprobs is not None else None
            choices.append({"index": c.index, "message": message, "logprobs": lp,
                            "finish_reason": finish})
        return self._envelope("chat.completion", choices, usage=self.gen.usage())

    def chunks(self, choice: Choice, out: RequestOutput) -> list[dict[str, object]]:
        spec = _tool_spec(choice)
        if spec is not None:
            return self._tool_chunks(choice, spec, out)
        chunks = []
        delta: dict[str, object] = {}
        if choice.index not in self._started:
            self._started.add(choice.index)
            delta = {"role": "assistant", "content": ""}
        if out.new_reasoning_text:
            delta["reasoning_content"] = out.new_reasoning_text
        if out.new_text:
            delta["content"] = out.new_text
        logprobs = self._logprobs(out.logprobs) if out.logprobs else None
        if delta or logprobs:
            chunks.append(self._chunk(choice.index, delta, logprobs, None))
        if out.finished:
            chunks.append(self._chunk(choice.index, {}, None, choice.finish_reason))
        return chunks

    # -- tool calls -----------------------------------------------------------------------

    def message(self, c: Choice) -> tuple[dict[str, object], str | None]:
        spec = _tool_spec(c)
        if spec is None:
            return _with_reasoning({"role": "assistant", "content": c.text}, c), c.finish_reason
        # Only a finished ("stop") output was checked by the engine; otherwise keep the
        # complete calls that validate, never a call cut short.
        parsed = tool_parser(spec)
        parsed.feed(c.text, final=True)
        calls = valid_calls(spec, parsed.result.calls)
        # No text: `content` is null, as OpenAI's, whether or not a call came out.
        message = _with_reasoning({"role": "assistant", "content": parsed.result.content}, c)
        if calls:
            message["tool_calls"] = [
                {"id": self._call_id(c.index, i), "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}
                for i, call in enumerate(calls)
            ]
        return message, _finish(c, bool(calls))

    def _tool_chunks(
        self, choice: Choice, spec: ConstraintSpec, out: RequestOutput
    ) -> list[dict[str, object]]:
        parser = self._parsers.get(choice.index)
        if parser is None:
            parser = self._parsers[choice.index] = tool_parser(spec)
        deltas = [self._delta(choice.index, e) for e in parser.feed(out.new_text, out.finished)]
        deltas = [d for d in deltas if d]
        if out.new_reasoning_text:  # all of it comes before the answer's first delta
            deltas.insert(0, {"reasoning_content": out.new_reasoning_text})
        if choice.index not in self._started:
            self._started.add(choice.index)
            deltas.insert(0, {"role": "assistant", "content": None})
        logprobs = self._logprobs(out.logprobs) if out.logprobs else None
        if logprobs and not deltas:
            deltas.append({})
        chunks = [self._chunk(choice.index, d, logprobs if i == 0 else None, None)
                  for i, d in enumerate(deltas)]
        if out.finished:
            calls = any(c.complete for c in parser.result.calls)
            chunks.append(self._chunk(choice.index, {}, None, _finish(choice, calls)))
        return chunks

    def _delta(self, index: int, e: Event) -> dict[str, object]:
        if isinstance(e, Text):
            return {"content": e.text}
        if isinstance(e, CallStart):
            return {"tool_calls": [{"index": e.index, "id": self._call_id(index, e.index),
                                    "type": "function",
                                    "function": {"name": e.name, "arguments": ""}}]}
        if isinstance(e, Arguments):
            return {"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]}
        return {}

    def _call_id(self, choice: int, call: int) -> str:
        return self._ids.setdefault((choice, call), f"call_{uuid.uuid4().hex[:24]}")

    def usage_chunk(self) -> dict[str, object]:
        return self._envelope("chat.completion.chunk", [], usage=self.gen.usage())

    def _chunk(self, index: int, delta: dict[str, object], logprobs: dict[str, object] | None,
               finish: str | None) -> dict[str, object]:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        extra = {"usage": None} if self.include_usage else {}
        return self._envelope("chat.completion.chunk", [choice], **extra)

    def _envelope(
        self, obj: str, choices: list[dict[str, object]], **extra: object
    ) -> dict[str, object]:
        return {"id": self.gen.response_id, "object": obj, "created": self.gen.created,
                "model": self.model, "system_fingerprint": None, "choices": choices, **extra}

    def _logprobs(self, lps: list[TokenLogprob]) -> dict[str, object]:
        def entry(token_id: int, logprob: float) -> dict[str, object]:
            text = self.tok.token_text(token_id)
            return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

        return {"content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in lps
        ]}


def _with_reasoning(message: dict[str, object], c: Choice) -> dict[str, object]:
    """`message` with the choice's `reasoning_content` when it reasoned (as vLLM and SGLang
    name it)."""
    if c.num_reasoning_tokens:
        message["reasoning_content"] = c.reasoning
    return message


MIN_LOGPROB = -9999.0  # what a token the step banned (a grammar's mask, min_tokens) reports


def _finite(logprob: float) -> float:
    """JSON has no -Infinity: a banned token's logprob is reported as MIN_LOGPROB (vLLM's
    floor too)."""
    return max(logprob, MIN_LOGPROB)


def _tool_spec(c: Choice) -> ConstraintSpec | None:
    spec = c.job.params.constraint
    return spec if spec is not None and spec.kind == "tool_calls" else None


def _finish(c: Choice, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and c.finish_reason == "stop" else c.finish_reason


class CompletionFormat:
    def __init__(self, gen: Generation, model: str, tok: GatewayTokenizer, include_usage: bool,
                 echo: bool = False):
        self.gen, self.model, self.tok, self.include_usage = gen, model, tok, include_usage
        self.echo = echo
        self._started: set[int] = set()
        self._offsets: dict[int, int] = {}  # choice index -> text offset of its next token

    def body(self) -> dict[str, object]:
        choices = []
        for c in self.gen.ordered:
            lp = None
            if c.job.params.logprobs is not None:
                self._offsets.pop(c.index, None)
                lp = self._logprobs(c, c.logprobs)
            choices.append({"index": c.index, "text": self._prefix(c) + c.text, "logprobs": lp,
                            "finish_reason": c.finish_reason})
        return self._envelope("text_completion", choices, usage=self.gen.usage())

    def chunks(self, choice: Choice, out: RequestOutput) -> list[dict[str, object]]:
        text = out.new_text
        if choice.index not in self._started:
            self._started.add(choice.index)
            text = self._prefix(choice) + text
        logprobs = self._logprobs(choice, out.logprobs) if out.logprobs else None
        if not (text or logprobs or out.finished):
            return []
        finish = choice.finish_reason if out.finished else None
        item = {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        extra = {"usage": None} if self.include_usage else {}
        return [self._envelope("text_completion", [item], **extra)]

    def usage_chunk(self) -> dict[str, object]:
        return self._envelope("text_completion", [], usage=self.gen.usage())

    def _prefix(self, c: Choice) -> str:
        return self.tok.decode(c.job.prompt_ids) if self.echo else ""

    def _envelope(
        self, obj: str, choices: list[dict[str, object]], **extra: object
    ) -> dict[str, object]:
        return {"id": self.gen.response_id, "object": obj, "created": self.gen.created,
                "model": self.model, "system_fingerprint": None, "choices": choices, **extra}

    def _logprobs(self, c: Choice, lps: list[TokenLogprob]) -> dict[str, object]:
        tokens, offsets = [], []
        offset = self._offsets.get(c.index, 0)
        for lp in lps:
            text = self.tok.token_text(lp.token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        self._offsets[c.index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(lp.logprob) for lp in lps],
            "top_logprobs": [{self.tok.token_text(t): _finite(v) for t, v in lp.top}
                             for lp in lps],
            "text_offset": offsets,
        }
