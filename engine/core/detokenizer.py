"""Incremental, UTF-8 safe detokenization and stop-string matching for one request.

Text is decoded over a short sliding window of tokens (starting inside the prompt, so tokenizers
that drop a leading space on a lone token still decode correctly) and appended only once it no
longer ends in an incomplete UTF-8 sequence. Stop strings are matched on the decoded text, so
they are found across token boundaries; text that could still be the start of a stop string
is held back from the stream, so a stop string never leaks.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from grammar.tool_parser import marker_tokens


class Decoder:
    """`tokenizer.decode(ids, skip_special_tokens=True)` for one tokenizer, shared by its
    requests, except that the special tokens of the model's tool-call format (Mistral's
    `[TOOL_CALLS]`, `grammar.tool_parser.marker_tokens`) keep their text, so calls parse.
    Where transformers' wrapper would only call its Rust tokenizer (a fast tokenizer that does
    not clean up spaces), this calls the Rust tokenizer directly: the wrapper costs about twice
    the decode itself. Lone tokens, the usual detokenizer prefix, are cached."""

    def __init__(self, tokenizer: Any):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
            self._skip_special = partial(tokenizer.decode, skip_special_tokens=True)
        else:
            self._skip_special = partial(backend.decode, skip_special_tokens=True)
        self._markers = marker_tokens(tokenizer)
        self.decode = self._keep_markers if self._markers else self._skip_special
        self._lone: dict[int, str] = {}

    def _keep_markers(self, ids: list[int]) -> str:
        """Decode the runs between marker tokens, and the markers as their text."""
        if self._markers.keys().isdisjoint(ids):
            return self._skip_special(ids)
        out, start = [], 0
        for i, t in enumerate(ids):
            if t in self._markers:
                out += [self._skip_special(ids[start:i]), self._markers[t]]
                start = i + 1
        out.append(self._skip_special(ids[start:]))
        return "".join(out)

    def __call__(self, ids: list[int]) -> str:
        if len(ids) != 1:
            return self.decode(ids)
        text = self._lone.get(ids[0])
        if text is None:
            text = self._lone[ids[0]] = self.decode(ids)
        return text


class IncrementalDetokenizer:
    def __init__(self, decoder: Decoder, prompt_ids: list[int], stop: list[str]):
        self.decoder = decoder
        # The window is ids[prefix_offset:]; ids[prefix_offset:read_offset] is already in `text`
        # and decodes to `prefix` (kept: a token costs one decode, and a lone token none).
        self.ids = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.prefix = decoder(self.ids)
        self.stop = stop
        self.text = ""
        self.emitted = 0  # chars of `text` already handed out

    def add(self, token_id: int, stops: bool = True) -> str | None:
        """Append a token; return the matched stop string if the text now contains one (the
        text is then cut before it). `stops=False` (the request's `min_tokens` not passed yet):
        stop strings are not looked for in this token's text."""
        self.ids.append(token_id)
        full = self.decoder.decode(self.ids[self.prefix_offset :])  # usually 2+ tokens: uncached
        if len(full) <= len(self.prefix) or full.endswith("\ufffd"):
            return None  # mid-character: wait for the next token
        before = len(self.text)
        self.text += full[len(self.prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.prefix = self.decoder(self.ids[self.prefix_offset :])
        return self._find_stop(before) if self.stop and stops else None

    def _find_stop(self, before: int) -> str | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, max(0, before - len(s) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        return best[1]

    def take(self, final: bool) -> str:
        """The text not yet handed out, minus a tail that may begin a stop string."""
        end = len(self.text) if final or not self.stop else len(self.text) - self._held_back()
        out = self.text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return out

    def _held_back(self) -> int:
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return hold
