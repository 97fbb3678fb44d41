"""outlines-core: the fallback backend. Everything becomes a regex compiled into a token-level
DFA index, so EBNF grammars are out of reach, but it covers some schemas xgrammar rejects."""

from __future__ import annotations

import json
from collections.abc import Callable

import outlines_core as oc
import torch
from outlines_core.json_schema import build_regex_from_schema

from grammar.backend import Backend, BackendError, Matcher, bitmask_row
from grammar.rewrite import ascii_digits
from grammar.spec import JSON_MAX_WHITESPACE, ConstraintSpec
from grammar.vocab import TokenVocab

MAX_ROLLBACK = 64
WHITESPACE = f"[ ]{{0,{JSON_MAX_WHITESPACE}}}"  # between JSON tokens (default: any run)
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


class OutlinesMatcher(Matcher):
    """Stop tokens are handled here, not by the index: outlines-core lists its EOS as allowed
    in final states but has no transition for it, and knows only one EOS."""

    def __init__(self, index: oc.Index, stop_token_ids: tuple[int, ...]):
        self._guide = oc.Guide(index, max_rollback=MAX_ROLLBACK)
        self._stops = stop_token_ids
        self._terminated = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        r = bitmask_row(bitmask, row)  # (W,)
        if self._terminated:
            r.zero_()
        else:
            self._guide.write_mask_into(r.data_ptr(), r.numel(), r.element_size())
        if self._terminated or self._guide.is_finished():
            for t in self._stops:
                word = int(r[t // 32]) | (1 << (t % 32))
                r[t // 32] = word - (1 << 32) if word >= 1 << 31 else word

    def accept(self, token_id: int) -> bool:
        if self._terminated:
            return False
        if token_id in self._stops:
            self._terminated = self._guide.is_finished()
            return self._terminated
        try:
            if not self._guide.accepts_tokens([token_id]):
                return False
            self._guide.advance(token_id, return_tokens=False)
        except ValueError:  # a token id the index does not know
            return False
        return True

    def rollback(self, n: int) -> None:
        if n and self._terminated:
            self._terminated, n = False, n - 1
        if n:
            self._guide.rollback_state(n)

    def is_terminated(self) -> bool:
        return self._terminated

    def forced_continuation(self) -> str:
        return ""  # the index holds token transitions, not the text the grammar forces


class OutlinesBackend(Backend):
    name = "outlines"

    def __init__(self, vocab: TokenVocab):
        self._stops = vocab.stop_token_ids
        self._vocab = vocab
        self._vocabulary: oc.Vocabulary | None = None  # built on first compile

    def compile(self, spec: ConstraintSpec) -> oc.Index:
        """Compile `spec`; the artifact is the (picklable) token index."""
        regex = to_regex(spec)
        if self._vocabulary is None:
            token_map: dict[bytes, list[int]] = {}
            for i, t in enumerate(self._vocab.tokens):
                if t and i not in self._stops:
                    token_map.setdefault(t, []).append(i)
            self._vocabulary = oc.Vocabulary(self._stops[0], token_map)
        try:
            return oc.Index(regex, self._vocabulary)
        except ValueError as e:
            raise BackendError(f"cannot build an index for this regex: {e}") from e

    def load(self, artifact: oc.Index) -> Callable[[], Matcher]:
        return lambda: OutlinesMatcher(artifact, self._stops)


def to_regex(spec: ConstraintSpec) -> str:
    """The regex outlines-core compiles for `spec`; BackendError when there is none."""
    if spec.kind in ("json_object", "json_schema"):
        schema = spec.schema()
        schema = {} if schema is True else schema
        try:
            return ascii_digits(build_regex_from_schema(json.dumps(schema), WHITESPACE))
        except ValueError as e:
            raise BackendError(str(e).splitlines()[0]) from e
    if spec.kind == "regex":
        assert isinstance(spec.payload, str)
        return ascii_digits(spec.payload)
    if spec.kind == "choice":
        assert isinstance(spec.payload, tuple)
        return "(" + "|".join(_escape(c) for c in spec.payload) + ")"
    raise BackendError(f"{spec.kind} constraints are not supported (regular languages only)")


def _escape(s: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in s)
