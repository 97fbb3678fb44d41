"""Reasoning output: what a reasoning model writes between its markers (`<think>` ... `</think>`),
kept apart from its answer.

A model reasons in a `ReasoningFormat`: two marker tokens, named by `--reasoning-parser` or,
on "auto", found in its chat template. A request that reasons (`SamplingParams.reasoning`,
on unless the prompt is raw) carries a `Reasoning`: whether it is still thinking, how many
tokens it has thought, and its budget (`max_reasoning_tokens`). Three stages read it:

- the output stage (`ReasoningDetokenizer`): reasoning text and answer text are detokenized
  apart, the markers dropped; stop strings apply to the answer only;
- the grammar stage (engine/sampling/structured.py): while thinking, the constraint is not applied
  (only the end of the output is banned, so the answer still comes); it starts at the first
  token after the end marker;
- the mask stage forces the end marker as the budget's last token.

The phase is decided per token, by id, so markers that are plain added tokens (Qwen3's) and
special ones (dropped by the detokenizer) work alike. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config import ModelLoadError
from engine.core.detokenizer import Decoder, IncrementalDetokenizer

# --reasoning-parser names (vLLM's) -> (start marker, end marker)
PARSERS: dict[str, tuple[str, str]] = {
    "qwen3": ("<think>", "</think>"),
    "deepseek_r1": ("<think>", "</think>"),
}


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str
    start_id: int
    end_id: int

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, parser: str) -> ReasoningFormat | None:
        """The format `parser` names ("none": no reasoning; "auto": the first of `PARSERS`
        whose markers the chat template mentions, if they are single tokens here).
        Raises ModelLoadError when a named parser's markers are not single tokens."""
        if parser == "none":
            return None
        if parser == "auto":
            template = getattr(tokenizer, "chat_template", None)
            if not isinstance(template, str):
                return None
            found = [m for m in PARSERS.values() if m[0] in template and m[1] in template]
            if not found:
                return None
            markers = found[0]
        else:
            markers = PARSERS[parser]
        ids = [_single_token(tokenizer, m) for m in markers]
        if ids[0] is None or ids[1] is None:
            if parser == "auto":
                return None
            raise ModelLoadError(f"--reasoning-parser {parser}: the markers {markers} are not "
                                 "single tokens of this model's tokenizer")
        return cls(markers[0], markers[1], ids[0], ids[1])

    def thinks_first(self, prompt_ids: list[int], tokenizer: Any) -> bool:
        """Whether the output starts inside reasoning: yes, unless the prompt has closed it
        already (a template's "no thinking" form, e.g. Qwen3's `enable_thinking=False`, ends
        the prompt with an empty `<think>\\n\\n</think>\\n\\n`)."""
        tail = tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)
        return not tail.rstrip().endswith(self.end)


def _single_token(tokenizer: Any, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


@dataclass
class Reasoning:
    """One request's reasoning phase. `budget`: the most reasoning tokens, the end marker
    included (None: no limit)."""

    fmt: ReasoningFormat
    budget: int | None = None
    thinking: bool = True
    num_tokens: int = 0  # output tokens of the reasoning, markers included

    @property
    def must_end(self) -> bool:
        """The next token must be the end marker: the budget's last one."""
        return self.thinking and self.budget is not None and self.num_tokens >= self.budget - 1

    def advance(self, token: int) -> bool:
        """Count `token` in; True if it belongs to the reasoning (the end marker does)."""
        if not self.thinking:
            return False
        self.num_tokens += 1
        if token == self.fmt.end_id:
            self.thinking = False
        return True


class ReasoningDetokenizer:
    """The output stage of a reasoning request, with `IncrementalDetokenizer`'s interface for
    the answer (`add`, `take`, `text`) and `take_reasoning` beside it. Each part has its own
    detokenizer, so neither sees the other's text; leading whitespace of each is dropped
    (Qwen3 writes "\\n\\n" after `</think>`)."""

    def __init__(self, decoder: Decoder, prompt_ids: list[int], stop: list[str],
                 reasoning: Reasoning):
        self.reasoning = reasoning
        self.decoder, self.stop = decoder, stop
        self.thoughts = IncrementalDetokenizer(decoder, prompt_ids, [])
        self.answer: IncrementalDetokenizer | None = None
        if not reasoning.thinking:
            self.answer = IncrementalDetokenizer(decoder, prompt_ids, stop)
        self._started = {"thoughts": False, "answer": False}

    def add(self, token_id: int, stops: bool = True) -> str | None:
        """Append a token; the matched stop string, if the answer now contains one (looked
        for only with `stops`)."""
        r = self.reasoning
        if r.advance(token_id):
            if token_id not in (r.fmt.start_id, r.fmt.end_id):
                self.thoughts.add(token_id)
            if not r.thinking:  # the answer's window starts after the reasoning
                self.answer = IncrementalDetokenizer(self.decoder, self.thoughts.ids, self.stop)
            return None
        assert self.answer is not None, "an answer follows the reasoning's end"
        return self.answer.add(token_id, stops)

    @property
    def text(self) -> str:
        """The answer so far (what a constraint checks)."""
        return self.answer.text.lstrip() if self.answer is not None else ""

    @property
    def reasoning_text(self) -> str:
        return self.thoughts.text.lstrip()

    def take(self, final: bool) -> str:
        if self.answer is None:
            return ""
        return self._lstrip_start("answer", self.answer.take(final))

    def take_reasoning(self, final: bool) -> str:
        return self._lstrip_start("thoughts", self.thoughts.take(final))

    def _lstrip_start(self, part: str, delta: str) -> str:
        if not self._started[part]:
            delta = delta.lstrip()
            self._started[part] = bool(delta)
        return delta
