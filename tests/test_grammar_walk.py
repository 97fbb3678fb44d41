"""Constrained random walks with the real SmolLM2 tokenizer.

A walk starts a matcher, repeatedly fills the bitmask, picks a random allowed token (seeded),
and accepts it until the matcher terminates; past a soft limit it steers toward the end
(stop token, closing brackets, short values). The decoded text must then satisfy the spec.
MaskBench cases also check that the token sequences of valid instances are accepted and
those of invalid ones rejected.
"""

from __future__ import annotations

import glob
import json
import random
import re
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch

from grammar.backend import BackendError, Matcher
from grammar.backends import make_backend
from grammar.compiler import GrammarCompiler
from grammar.rewrite import disjoint_one_of
from grammar.spec import ConstraintSpec, parse_structured_outputs
from grammar.validate import check_output
from grammar.vocab import TokenVocab
from tests.maskbench import MASKBENCH

PAD = 37  # embedding rows past len(tokenizer): never allowed, and V % 32 != 0


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from engine.config import default_cache_dir
    from engine.runner.loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(None, default_cache_dir()))


@pytest.fixture(scope="session")
def vocab(tokenizer) -> TokenVocab:
    return TokenVocab.from_tokenizer(tokenizer, len(tokenizer) + PAD)


def allowed_ids(row: torch.Tensor, vocab_size: int) -> np.ndarray:
    """Token ids whose bit is set in one bitmask row."""
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


class Walker:
    """Random walks over one vocabulary."""

    CLOSERS = set(b'"}])')
    ATOMS = {b"0", b"1", b"true", b"false", b"null", b'""', b"[]", b"{}", b"a", b'"a', b'":'}

    def __init__(self, vocab: TokenVocab):
        self.vocab = vocab
        self.stops = set(vocab.stop_token_ids)
        tokens = vocab.tokens
        self.closing = [i for i, t in enumerate(tokens) if t.strip() and set(t) <= self.CLOSERS]
        self.atoms = [i for i, t in enumerate(tokens) if t.strip() in self.ATOMS]
        self.solid = {i for i, t in enumerate(tokens) if t.strip()}  # not only whitespace
        self.never = {i for i, t in enumerate(tokens) if not t}  # specials and padding rows
        self.bitmask = torch.zeros(1, (vocab.vocab_size + 31) // 32, dtype=torch.int32)

    def allowed(self, m: Matcher) -> set[int]:
        m.fill_bitmask(self.bitmask, 0)
        return set(allowed_ids(self.bitmask[0], self.vocab.vocab_size).tolist())

    def walk(self, m: Matcher, seed: int, soft_limit: int = 16, hard_limit: int = 600) -> str:
        """Walk to termination; return the text (stop token excluded)."""
        rng = random.Random(seed)
        out: list[int] = []
        for step in range(hard_limit):
            allowed = self.allowed(m)
            assert allowed, f"dead end after {out}"
            assert not allowed & self.never, "a special or padding token was allowed"
            if step < soft_limit:
                tok = rng.choice(sorted(allowed))
            elif allowed & self.stops:
                tok = min(allowed & self.stops)
            else:
                tok = self._toward_end(m, allowed, rng)
            assert m.accept(tok)
            if m.is_terminated():
                return b"".join(self.vocab.tokens[t] for t in out).decode()
            out.append(tok)
        raise AssertionError(f"no stop after {hard_limit} tokens")

    def _toward_end(self, m: Matcher, allowed: set[int], rng: random.Random) -> int:
        close = [t for t in self.closing if t in allowed]
        atoms = [t for t in self.atoms if t in allowed]
        for t in (close + atoms)[:32]:  # one step of lookahead: does it let us stop?
            assert m.accept(t)
            done = bool(self.allowed(m) & self.stops)
            m.rollback(1)
            if done:
                return t
        if close:
            return rng.choice(close)
        if atoms and rng.random() < 0.5:
            return rng.choice(atoms)
        return rng.choice(sorted(allowed & self.solid) or sorted(allowed))


def accepts(m: Matcher, token_ids: list[int], stop: int) -> bool:
    return all(m.accept(t) for t in token_ids) and m.accept(stop) and m.is_terminated()


@pytest.fixture(scope="session")
def walker(vocab: TokenVocab) -> Walker:
    return Walker(vocab)


@pytest.fixture(scope="session")
def backends(vocab: TokenVocab):
    names = ("xgrammar", "outlines", "llguidance", "llguidance-relaxed")
    return {name: make_backend(name, vocab) for name in names}


_compiled: dict[tuple[str, ConstraintSpec], object] = {}


def matcher(backend, spec: ConstraintSpec) -> Matcher:
    """A fresh matcher; each (backend, spec) compiles once per session."""
    key = (backend.name, spec)
    if key not in _compiled:
        _compiled[key] = backend.load(backend.compile(spec))
    return _compiled[key]()


# -- one random walk per kind and backend ----------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c d"]}},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}
ARITH = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+ | "(" expr ")"'
CHOICES = ("yes", "no", "maybe not", 'a "quoted" one', "ünïcödé", "back\\slash")
KIND_SPECS = {
    "json_object": ConstraintSpec("json_object"),
    "json_schema": parse_structured_outputs({"json": PERSON}),
    "regex_phone": ConstraintSpec("regex", r"(\+\d{1,3} )?\(\d{3}\) \d{3}-\d{4}"),
    "regex_email": ConstraintSpec("regex", r"[a-z]{3,8}@[a-z]{2,6}\.(com|org|net)"),
    "choice": ConstraintSpec("choice", CHOICES),
    "grammar": ConstraintSpec("grammar", ARITH),
}


def is_arith(text: str) -> bool:
    """Whether `text` is in ARITH's language: fold innermost parentheses, then one regex."""
    flat = r"\d+(?:[+-]\d+)*"
    while True:
        folded = re.sub(rf"\({flat}\)", "0", text)
        if folded == text:
            return re.fullmatch(flat, text) is not None
        text = folded


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", list(KIND_SPECS))
@pytest.mark.parametrize("backend_name", ["xgrammar", "outlines", "llguidance"])
def test_random_walk(backends, walker: Walker, backend_name: str, case: str, seed: int):
    spec = KIND_SPECS[case]
    if backend_name == "outlines" and spec.kind == "json_object":
        pytest.skip("outlines-core takes ~20 s to index its any-object regex")
    if backend_name == "outlines" and spec.kind == "grammar":
        with pytest.raises(BackendError, match="not supported"):
            backends[backend_name].compile(spec)
        return
    text = walker.walk(matcher(backends[backend_name], spec), seed)
    assert check_output(spec, text) is None, text
    if spec.kind == "json_object":
        assert isinstance(json.loads(text), dict)
    if spec.kind == "grammar":
        assert is_arith(text), text


@pytest.mark.parametrize("backend_name", ["xgrammar", "outlines", "llguidance"])
def test_matcher_accept_reject_rollback(backends, walker: Walker, tokenizer, backend_name: str):
    spec = KIND_SPECS["regex_phone"]
    m = matcher(backends[backend_name], spec)
    stop = walker.vocab.stop_token_ids[0]
    ids = tokenizer.encode("(555) 123-4567", add_special_tokens=False)
    assert stop not in walker.allowed(m)
    assert not m.accept(tokenizer.encode("x", add_special_tokens=False)[0])  # state unchanged
    for t in ids[:2]:
        assert m.accept(t)
    before = walker.allowed(m)
    for t in ids[2:4]:
        assert m.accept(t)
    m.rollback(2)
    assert walker.allowed(m) == before
    assert accepts(m, ids[2:], stop)
    assert not m.accept(ids[0])  # nothing after the stop token
    m.rollback(1)  # un-stop
    assert not m.is_terminated() and stop in walker.allowed(m)


def test_forced_continuation(backends, walker: Walker):
    m = matcher(backends["xgrammar"], ConstraintSpec("choice", ("hello world", "hello there")))
    assert m.forced_continuation() == "hello "
    m = matcher(backends["xgrammar"], KIND_SPECS["json_schema"])
    assert m.forced_continuation().startswith("{")
    assert matcher(backends["outlines"], KIND_SPECS["choice"]).forced_continuation() == ""
    m = matcher(backends["llguidance"], ConstraintSpec("choice", ("hello world", "hello there")))
    assert m.forced_continuation() == "hello "
    assert matcher(backends["llguidance"], KIND_SPECS["json_schema"]).forced_continuation() == "{"


# A Glaive tool's shape: "either these keys or those", where an object with both would match
# two branches. Backends read oneOf as anyOf; the rewrite makes the branches disjoint, exactly.
VOLUME = {
    "type": "object",
    "properties": {
        "dims": {
            "type": "object",
            "properties": {"length": {"type": "integer"}, "radius": {"type": "integer"},
                           "height": {"type": "integer"}},
            "oneOf": [{"required": ["length"]}, {"required": ["radius"]},
                      {"required": ["radius", "height"]}],
        }
    },
    "required": ["dims"],
    "additionalProperties": False,
}  # fmt: skip


def test_disjoint_one_of_rewrite():
    branches = VOLUME["properties"]["dims"]["oneOf"]
    obj = {"type": "object"}
    assert disjoint_one_of(branches) == [  # {radius, height} always matches {radius} too
        {**obj, "required": ["length"], "properties": {"radius": False}},
        {**obj, "required": ["radius"], "properties": {"height": False, "length": False}},
    ]  # {length, height} matches the first branch alone: height is not forbidden there
    assert disjoint_one_of([{"required": ["a"]}, {"type": "object"}]) is None
    # Both hold or neither: nothing satisfies this oneOf (a non-object satisfies both too).
    assert disjoint_one_of([{"required": ["a"]}, {"required": ["a"]}]) == [False]


@pytest.mark.parametrize("backend_name", ["llguidance", "llguidance-relaxed"])
def test_one_of_required_branches_stay_exclusive(
    backends, walker: Walker, tokenizer, backend_name: str
):
    spec = parse_structured_outputs({"json": VOLUME})
    stop = walker.vocab.stop_token_ids[0]
    backend = backends[backend_name]
    for text, valid in [('{"dims": {"radius": 2}}', True), ('{"dims": {"length": 1}}', True),
                        ('{"dims": {"length": 1, "height": 3}}', True),
                        ('{"dims": {"length": 1, "radius": 2}}', False),
                        ('{"dims": {"radius": 2, "height": 3}}', False)]:  # fmt: skip
        assert (check_output(spec, text) is None) == valid, text
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert accepts(matcher(backend, spec), ids, stop) == valid, text
    for seed in range(4):
        text = walker.walk(matcher(backend, spec), seed)
        assert check_output(spec, text) is None, text


# -- MaskBench cases, through the GrammarCompiler --------------------------------------

# Keywords some backend may silently relax; the exact cases below avoid them.
RELAXED = {"not", "oneOf", "allOf", "anyOf", "contains", "uniqueItems", "multipleOf",
           "patternProperties", "dependencies", "if", "then", "propertyNames",
           "additionalItems", "@siblingKeys", "@minmaxProperties"}  # fmt: skip


def maskbench_sample(n: int = 20) -> list[str]:
    """Every k-th small case whose keywords every backend enforces (file order)."""
    names = []
    for path in sorted(glob.glob(str(MASKBENCH / "*.json"))):
        case = json.loads(Path(path).read_text())
        feats = set(case["meta"]["features"])
        if feats & RELAXED or any(f.startswith("format") for f in feats):
            continue
        if len(json.dumps(case["schema"])) < 500:
            names.append(Path(path).stem)
    return names[:: max(1, len(names) // n)][:n]


CASES = maskbench_sample() if MASKBENCH.is_dir() else []


@pytest.fixture(scope="module")
def compiled_cases(tokenizer) -> dict[str, tuple[dict, Future]]:
    """Submit every case at once; the worker compiles them while the tests run."""
    with GrammarCompiler(tokenizer, len(tokenizer) + PAD) as compiler:
        out = {}
        for name in CASES:
            case = json.loads((MASKBENCH / f"{name}.json").read_text())
            out[name] = (case, compiler.submit(parse_structured_outputs({"json": case["schema"]})))
        yield out


@pytest.mark.skipif(not CASES, reason="no MaskBench dev set")
@pytest.mark.parametrize("name", CASES)
def test_maskbench_case(compiled_cases, walker: Walker, tokenizer, name: str):
    case, future = compiled_cases[name]
    grammar = future.result(timeout=120)
    stop = walker.vocab.stop_token_ids[0]
    for test in case["tests"]:
        ids = tokenizer.encode(
            json.dumps(test["data"], ensure_ascii=False), add_special_tokens=False
        )
        assert accepts(grammar.matcher(), ids, stop) == test["valid"], test["description"]
    text = walker.walk(grammar.matcher(), seed=len(name))
    assert check_output(grammar.spec, text) is None, text


@pytest.mark.parametrize("backend_name", ["xgrammar", "outlines", "llguidance-relaxed"])
def test_check_output_catches_silently_relaxed_keywords(backends, walker, backend_name: str):
    """These backends ignore uniqueItems: every walk here yields [1, 1...], which must fail."""
    schema = {"type": "array", "items": {"enum": [1]}, "minItems": 2, "uniqueItems": True}
    spec = parse_structured_outputs({"json": schema})
    text = walker.walk(matcher(backends[backend_name], spec), seed=0)
    assert json.loads(text)[:2] == [1, 1]
    assert "non-unique" in check_output(spec, text)
