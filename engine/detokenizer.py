"""Incremental, UTF-8 safe detokenization and stop-string matching for one request.

Text is decoded over a short sliding window of tokens (starting inside the prompt, so tokenizers
that drop a leading space on a lone token still decode correctly) and appended only once it no
longer ends in an incomplete UTF-8 sequence. Stop strings are matched on the decoded text, so
they are found across token boundaries; text that could still be the start of a stop string
is held back from the stream, so a stop string never leaks.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], stop: list[str]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.text = ""
        self.emitted = 0  # chars of `text` already handed out

    def add(self, token_id: int) -> str | None:
        """Append a token; return the matched stop string if the text now contains one (the
        text is then cut before it)."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = decode(self.ids[self.prefix_offset :], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # mid-character: wait for the next token
        before = len(self.text)
        self.text += full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._find_stop(before)

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
        end = len(self.text) if final else len(self.text) - self._held_back()
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
