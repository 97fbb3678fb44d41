"""OpenAI response bodies and stream chunks, for chat and text completions.

Both formats offer the same three methods the serving code calls: `body` (the whole response),
`chunks` (stream chunks for one engine output) and `usage_chunk`.
"""

from __future__ import annotations

from typing import Any

from engine.messages import RequestOutput, TokenLogprob
from gateway.generation import Choice, Generation
from gateway.tokenizer import GatewayTokenizer


class ChatFormat:
    def __init__(self, gen: Generation, model: str, tok: GatewayTokenizer, include_usage: bool):
        self.gen, self.model, self.tok, self.include_usage = gen, model, tok, include_usage
        self._started: set[int] = set()

    def body(self) -> dict[str, Any]:
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": self._logprobs(c.logprobs) if c.job.params.logprobs is not None
                else None,
                "finish_reason": c.finish_reason,
            }
            for c in self.gen.ordered
        ]
        return self._envelope("chat.completion", choices, usage=self.gen.usage())

    def chunks(self, choice: Choice, out: RequestOutput) -> list[dict[str, Any]]:
        chunks = []
        delta: dict[str, Any] = {}
        if choice.index not in self._started:
            self._started.add(choice.index)
            delta = {"role": "assistant", "content": ""}
        if out.new_text:
            delta["content"] = out.new_text
        logprobs = self._logprobs(out.logprobs) if out.logprobs else None
        if delta or logprobs:
            chunks.append(self._chunk(choice.index, delta, logprobs, None))
        if out.finished:
            chunks.append(self._chunk(choice.index, {}, None, choice.finish_reason))
        return chunks

    def usage_chunk(self) -> dict[str, Any]:
        return self._envelope("chat.completion.chunk", [], usage=self.gen.usage())

    def _chunk(self, index: int, delta: dict[str, Any], logprobs: Any, finish: str | None):
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        extra = {"usage": None} if self.include_usage else {}
        return self._envelope("chat.completion.chunk", [choice], **extra)

    def _envelope(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.gen.response_id, "object": obj, "created": self.gen.created,
                "model": self.model, "system_fingerprint": None, "choices": choices, **extra}

    def _logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.tok.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in lps
        ]}


class CompletionFormat:
    def __init__(self, gen: Generation, model: str, tok: GatewayTokenizer, include_usage: bool,
                 echo: bool = False):
        self.gen, self.model, self.tok, self.include_usage = gen, model, tok, include_usage
        self.echo = echo
        self._started: set[int] = set()
        self._offsets: dict[int, int] = {}  # choice index -> text offset of its next token

    def body(self) -> dict[str, Any]:
        choices = []
        for c in self.gen.ordered:
            lp = None
            if c.job.params.logprobs is not None:
                self._offsets.pop(c.index, None)
                lp = self._logprobs(c, c.logprobs)
            choices.append({"index": c.index, "text": self._prefix(c) + c.text, "logprobs": lp,
                            "finish_reason": c.finish_reason})
        return self._envelope("text_completion", choices, usage=self.gen.usage())

    def chunks(self, choice: Choice, out: RequestOutput) -> list[dict[str, Any]]:
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

    def usage_chunk(self) -> dict[str, Any]:
        return self._envelope("text_completion", [], usage=self.gen.usage())

    def _prefix(self, c: Choice) -> str:
        return self.tok.decode(c.job.prompt_ids) if self.echo else ""

    def _envelope(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.gen.response_id, "object": obj, "created": self.gen.created,
                "model": self.model, "system_fingerprint": None, "choices": choices, **extra}

    def _logprobs(self, c: Choice, lps: list[TokenLogprob]) -> dict[str, Any]:
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
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{self.tok.token_text(t): v for t, v in lp.top} for lp in lps],
            "text_offset": offsets,
        }
