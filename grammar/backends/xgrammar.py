"""xgrammar: the default backend. JSON Schema, regex, EBNF/GBNF, choice and tool calls (a
structural tag, grammar/tools.py); exact masks from a pushdown automaton, jump-forward strings,
and rollback."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import torch
import xgrammar as xgr

from grammar.backend import Backend, BackendError, Matcher
from grammar.spec import JSON_MAX_WHITESPACE, ConstraintSpec
from grammar.vocab import TokenVocab


class XGrammarMatcher(Matcher):
    def __init__(self, compiled: xgr.CompiledGrammar):
        self._m = xgr.GrammarMatcher(compiled)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        return self._m.accept_token(token_id)

    def rollback(self, n: int) -> None:
        if n:
            self._m.rollback(n)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def forced_continuation(self) -> str:
        return self._m.find_jump_forward_string()


class XGrammarBackend(Backend):
    name = "xgrammar"
    # The artifact is JSON several times the loaded grammar's size, and loading it peaks at
    # several times more: counted whole.
    bytes_per_artifact_byte = 1.0

    def __init__(self, vocab: TokenVocab):
        # RAW: `vocab.tokens` are already decoded bytes; empty ones are never allowed.
        self.info = xgr.TokenizerInfo(
            list(vocab.tokens),
            xgr.VocabType.RAW,
            vocab_size=vocab.vocab_size,
            stop_token_ids=list(vocab.stop_token_ids),
        )
        self._compiler: xgr.GrammarCompiler | None = None

    def compile(self, spec: ConstraintSpec) -> str:
        """Compile `spec`; the artifact is xgrammar's JSON serialization."""
        if self._compiler is None:  # single-threaded: the worker pool is the parallelism
            self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        c = self._compiler
        try:
            if spec.kind in ("json_object", "json_schema"):
                schema = spec.schema()
                schema = {} if schema is True else schema
                compiled = c.compile_grammar(json_grammar(json.dumps(schema)))
            elif spec.kind == "regex":
                compiled = c.compile_regex(_text(spec))
            elif spec.kind == "grammar":
                compiled = c.compile_grammar(_text(spec))
            elif spec.kind == "tool_calls":
                from grammar.tools import structural_tag

                compiled = c.compile_structural_tag(json.dumps(structural_tag(spec)))
            elif spec.kind == "choice":
                alts = " | ".join(_ebnf_literal(s) for s in spec.payload or ())
                compiled = c.compile_grammar(f"root ::= {alts}")
            else:
                raise BackendError(f"unknown constraint kind {spec.kind!r}")
        except (RuntimeError, ValueError, TypeError) as e:
            raise BackendError(_first_line(e)) from e
        return compiled.serialize_json()

    def load(self, artifact: str) -> Callable[[], Matcher]:
        compiled = xgr.CompiledGrammar.deserialize_json(artifact, self.info)
        return lambda: XGrammarMatcher(compiled)


# xgrammar's whitespace rule between JSON tokens as it prints with max_whitespace_cnt=1: one
# of space, newline, CR or tab; rewritten to a space, as the other backends allow.
_ANY_WHITESPACE = '("" | ([ \\n\\r\\t]))'
_ONE_SPACE = '("" | ([ ]))'


def json_grammar(schema: str) -> xgr.Grammar:
    """The grammar of `schema` (JSON text). strict_mode=False keeps JSON Schema's defaults
    (additionalProperties: true); between tokens at most one space (JSON_MAX_WHITESPACE)."""
    g = xgr.Grammar.from_json_schema(
        schema, strict_mode=False, max_whitespace_cnt=JSON_MAX_WHITESPACE
    )
    return xgr.Grammar.from_ebnf(str(g).replace(_ANY_WHITESPACE, _ONE_SPACE))


def _ebnf_literal(s: str) -> str:
    if s == "":
        return '""'
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _first_line(e: BaseException) -> str:
    """The message without xgrammar's `[hh:mm:ss] /path/file.cc:123: ` prefix."""
    text = (str(e).strip() or type(e).__name__).splitlines()[0]
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)[:500]


def _text(spec: ConstraintSpec) -> str:
    """The payload of a regex or grammar spec: its source text."""
    assert isinstance(spec.payload, str)
    return spec.payload
