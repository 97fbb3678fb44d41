"""llguidance: an Earley parser over a lazily built lexer. Exact on most JSON Schema keywords
(it refuses the ones it does not implement instead of ignoring them), compiles in
milliseconds, and reads regex, Lark and GBNF grammars too."""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import llguidance as llg
import torch
from llguidance.gbnf_to_lark import any_to_lark

from grammar.any_order import any_order_lark
from grammar.backend import Backend, BackendError, Matcher, bitmask_row
from grammar.rewrite import ascii_digits, rewrite_schema
from grammar.spec import JSON_MAX_WHITESPACE, ConstraintSpec
from grammar.tools import tool_calls_lark
from grammar.vocab import TokenVocab

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stub only

# llguidance's own `lenient` option ignores unimplemented keywords, but was measured to reject
# valid instances of such schemas; the relaxed mode drops them itself instead. `coerce_one_of`
# reads oneOf as anyOf: exact whenever the branches are disjoint (the usual case: tagged unions,
# distinct types); `check_output` catches the rest. The whitespace pattern is an optional
# lexeme between any two JSON tokens: here up to JSON_MAX_WHITESPACE spaces.
JSON_OPTIONS: JsonCompileOptions = {
    "coerce_one_of": True,
    "lenient": False,
    "whitespace_pattern": f"[ ]{{1,{JSON_MAX_WHITESPACE}}}",
}
SCHEMA_KINDS = ("json_object", "json_schema", "tool_calls")  # rewritten and retried
MAX_RETRIES = 8  # rewrites of one schema (unknown formats, overlaps, cycles, relaxed keywords)
# Keywords that only ever rule instances out: without them a schema allows a superset.
RESTRICTING = frozenset(
    {"not", "uniqueItems", "dependencies", "dependentRequired", "dependentSchemas", "if",
     "then", "else", "propertyNames", "contains", "minContains", "maxContains",
     "minProperties", "maxProperties"}
)  # fmt: skip


class _Vocab:
    """What llg.LLTokenizer reads from a tokenizer object: bytes per id, the specials, and a
    way to tokenize the text a grammar forces."""

    def __init__(self, vocab: TokenVocab):
        self.eos_token_id = vocab.stop_token_ids[0]
        self.bos_token_id = None
        # A 0xFF first byte marks a special token: it never matches grammar text.
        stops = set(vocab.stop_token_ids)
        self.tokens = [b"\xff" + t if i in stops else t for i, t in enumerate(vocab.tokens)]
        self.special_token_ids = sorted(stops)
        self.is_tokenizer_wrapper = True
        self._hf = None
        if vocab.tokenizer_json is not None:
            from tokenizers import Tokenizer

            self._hf = Tokenizer.from_str(vocab.tokenizer_json)
        self._ids = {t: i for i, t in enumerate(vocab.tokens) if t and i not in stops}
        self._longest = max(map(len, self._ids), default=1)

    def __call__(self, text: bytes | str) -> list[int]:
        data = text.encode() if isinstance(text, str) else text
        if self._hf is not None:
            try:
                return self._hf.encode(data.decode(), add_special_tokens=False).ids
            except UnicodeDecodeError:
                pass
        return self._greedy(data)

    def _greedy(self, data: bytes) -> list[int]:
        """Longest-match tokenization: valid, if not always canonical."""
        out, i = [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                tid = self._ids.get(data[i : i + n])
                if tid is not None:
                    out.append(tid)
                    i += n
                    break
            else:
                raise ValueError(f"no token for byte {data[i]:#x}")
        return out


def make_lltokenizer(vocab: TokenVocab) -> llg.LLTokenizer:
    return llg.LLTokenizer(
        _Vocab(vocab),  # type: ignore[arg-type]  # llguidance reads any object with its fields n_vocab=vocab.vocab_size, eos_token=list(vocab.stop_token_ids)
    )


class LLGuidanceMatcher(Matcher):
    """llguidance's matcher enters a sticky error state on a forbidden token, so `accept`
    checks first; the stop token is tracked here so that `rollback` can undo it.

    Two places where llguidance's mask and its matcher disagree, made to agree here: in an error
    state (e.g. a grammar with no way to go on) its mask allows only EOS, which it does not
    accept; and it applies its resource limits (lexer size, items per parser row) when a token
    is consumed, not when the mask is computed, so a token the mask allowed can still fail.
    """

    def __init__(self, m: llg.LLMatcher, stop_token_ids: tuple[int, ...]):
        self._m = m
        self._stops = stop_token_ids
        self._terminated = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        r = bitmask_row(bitmask, row)  # (W,)
        if self._terminated:
            r.zero_()
            return
        self._m.unsafe_compute_mask_ptr(r.data_ptr(), r.numel() * r.element_size())
        if self._m.is_error():  # its mask then allows only EOS, which `accept` refuses
            r.zero_()
            why = _first_line(self._m.get_error())
            if not why.startswith("NoExtension"):  # a dead end: an empty mask says it all
                raise BackendError(why)

    def accept(self, token_id: int) -> bool:
        """Raises BackendError when llguidance fails on a token it validated (a limit)."""
        if self._terminated:
            return False
        if token_id in self._stops:
            if not self._m.is_accepting():
                return False
            self._terminated = True
            return True
        if self._m.validate_tokens([token_id]) != 1:
            return False
        if not self._m.consume_token(token_id):
            raise BackendError(_first_line(self._m.get_error()))
        return True

    def rollback(self, n: int) -> None:
        if n and self._terminated:
            self._terminated, n = False, n - 1
        if n:
            self._m.rollback(n)

    def is_terminated(self) -> bool:
        return self._terminated

    def forced_continuation(self) -> str:
        if self._terminated:
            return ""
        forced = self._m.compute_ff_bytes()
        return forced.decode("utf-8", errors="ignore")  # drops a split trailing character


class LLGuidanceBackend(Backend):
    """Strict: a schema with a keyword llguidance does not implement is refused. Relaxed: such
    keywords are dropped when they only ever rule instances out (RESTRICTING), so the mask
    allows a superset of the schema's instances; `check_output` narrows it back."""

    # The artifact is grammar text; the lexer and parser built from it took 60 to 280 times
    # its size on large schemas.
    bytes_per_artifact_byte = 128.0

    def __init__(self, vocab: TokenVocab, *, relaxed: bool = False):
        self._vocab = vocab
        self.relaxed = relaxed
        self.name = "llguidance-relaxed" if relaxed else "llguidance"
        self.tokenizer = make_lltokenizer(vocab)  # ~0.5 s; before a worker caps its memory

    def compile(self, spec: ConstraintSpec) -> str:
        """Translate and check `spec`; the artifact is llguidance's grammar JSON text."""
        if spec.kind not in SCHEMA_KINDS:
            if self.relaxed:
                raise BackendError("relaxed mode applies to JSON schemas only")
            return self._check(to_llguidance(spec))
        return self.compile_schemas(spec)[0]

    def compile_schemas(self, spec: ConstraintSpec) -> tuple[str, Callable[[Any], Any]]:
        """The grammar of a spec with JSON schemas, and the rewrite of its schemas it was
        compiled from: each error llguidance names that a rewrite answers (an unknown format,
        overlapping patterns, a cycle of references with keywords beside it, a keyword the
        relaxed mode may drop) is retried under that rewrite."""
        drop_formats, overlaps, cycles, drop_keys = _LEARNED.get(spec.key, _NOTHING_LEARNED)
        drop_keys = drop_keys if self.relaxed else frozenset()
        for attempt in range(MAX_RETRIES):
            _learn(spec.key, (drop_formats, overlaps, cycles, drop_keys))
            rewrite = partial(rewrite_schema, drop_keys=drop_keys, drop_formats=drop_formats,
                              overlaps=overlaps, cycles=cycles)  # fmt: skip
            if attempt == 0 and (grammar := self._any_order(spec, rewrite)):
                return grammar, rewrite
            try:  # llguidance's own JSON grammar: its errors name what to rewrite
                grammar = self._check(to_llguidance(spec, rewrite))
            except BackendError as e:
                error = str(e)
            else:  # once the rewrite that compiles is found, one more any-order attempt
                return (attempt and self._any_order(spec, rewrite) or grammar), rewrite
            if unknown := re.search(r"Unknown format:(.*)", error):
                drop_formats |= {unknown.group(1).strip()}
                continue
            overlap = re.fullmatch(r"patternProperty regexes /(.*)/ are not disjoint", error)
            if overlap and overlap.group(1) not in overlaps:
                overlaps += (overlap.group(1),)  # merged into one pattern (`merge_patterns`)
                continue
            if error.startswith("circular references with sibling keys") and not cycles:
                cycles = True  # `ref_cycles`
                continue
            more = _unimplemented(error) if self.relaxed else None
            if not more or not more <= RESTRICTING or more <= drop_keys:
                raise BackendError(error)
            drop_keys |= more
        raise BackendError(error)

    def _any_order(self, spec: ConstraintSpec, rewrite: Callable[[Any], Any]) -> str | None:
        """The any-order grammar of `spec` (`grammar.any_order`), None where there is none or
        llguidance refuses it (the ordered JSON grammar then stands)."""
        try:
            grammar = any_order_llguidance(spec, rewrite)
            return None if grammar is None else self._check(grammar)
        except (BackendError, ValueError):  # ValueError: llguidance's, on the Lark text
            return None

    def _check(self, grammar: str) -> str:
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise BackendError(_first_line(messages[0]))
        return grammar

    def load(self, artifact: str) -> Callable[[], Matcher]:
        template = llg.LLMatcher(self.tokenizer, artifact, log_level=0)
        if template.is_error():
            raise BackendError(_first_line(template.get_error()))
        stops = self._vocab.stop_token_ids
        return lambda: LLGuidanceMatcher(template.deep_copy(), stops)


def to_llguidance(spec: ConstraintSpec, rewrite: Callable[[Any], Any] = lambda s: s) -> str:
    """llguidance's grammar text for `spec`, its JSON schemas passed through `rewrite`;
    BackendError when it cannot be translated."""
    try:
        if spec.kind in ("json_object", "json_schema"):
            return llg.LLMatcher.grammar_from_json_schema(
                json.dumps(_schema(spec, rewrite)), overrides=JSON_OPTIONS
            )
        if spec.kind == "tool_calls":
            lark = tool_calls_lark(spec, rewrite, dict(JSON_OPTIONS))
            assert lark is not None  # not asked in any order
            return llg.LLMatcher.grammar_from_lark(lark)
        if spec.kind == "regex":
            assert isinstance(spec.payload, str)
            return llg.LLMatcher.grammar_from_regex(ascii_digits(spec.payload))
        if spec.kind == "grammar":
            assert isinstance(spec.payload, str)
            return llg.LLMatcher.grammar_from_lark(any_to_lark(spec.payload))
        if spec.kind == "choice":
            assert isinstance(spec.payload, tuple)
            lark = "start: " + " | ".join(json.dumps(c) for c in spec.payload)
            return llg.LLMatcher.grammar_from_lark(lark)
    except Exception as e:  # ValueError, or the GBNF converter's own errors
        raise BackendError(_first_line(str(e) or type(e).__name__)) from e
    raise BackendError(f"unknown constraint kind {spec.kind!r}")


def any_order_llguidance(spec: ConstraintSpec, rewrite: Callable[[Any], Any]) -> str | None:
    """llguidance's grammar text for `spec` with its objects' members in any order
    (`grammar.any_order`), or None where that would not differ from `to_llguidance`'s."""
    lark = None
    if spec.kind in ("json_object", "json_schema"):
        lark = any_order_lark(_schema(spec, rewrite), dict(JSON_OPTIONS), JSON_MAX_WHITESPACE)
    elif spec.kind == "tool_calls":
        try:
            lark = tool_calls_lark(spec, rewrite, dict(JSON_OPTIONS), any_order=True)
        except ValueError:  # tool_choice auto: not a Lark grammar
            return None
    return None if lark is None else llg.LLMatcher.grammar_from_lark(lark)


def _schema(spec: ConstraintSpec, rewrite: Callable[[Any], Any]) -> Any:
    schema = rewrite(spec.schema())
    return {} if schema is True or schema is None else schema


# What compiling a spec taught (formats to drop, patterns to merge, cycles to rewrite, keywords
# the relaxed mode dropped), by spec key: the relaxed mode, which runs after strict llguidance
# failed on the same spec, and a recompile after the cache let the grammar go start from there
# instead of finding each rewrite again, one failed compile apiece.
Learned = tuple[frozenset[str], tuple[str, ...], bool, frozenset[str]]
_NOTHING_LEARNED: Learned = (frozenset(), (), False, frozenset())
_LEARNED: OrderedDict[str, Learned] = OrderedDict()
LEARNED_SPECS = 256


def _learn(key: str, learned: Learned) -> None:
    if learned != _NOTHING_LEARNED:
        _LEARNED[key] = learned
        _LEARNED.move_to_end(key)
        if len(_LEARNED) > LEARNED_SPECS:
            _LEARNED.popitem(last=False)


def _unimplemented(error: str) -> frozenset[str] | None:
    """The keywords an llguidance error names as unimplemented, if it is such an error."""
    if "min/maxProperties only supported" in error:
        return frozenset({"minProperties", "maxProperties"})
    found = re.search(r"Unimplemented keys: (\[.*?\])", error)
    return frozenset(json.loads(found.group(1))) if found else None


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0][:500] if message.strip() else "unknown error"
