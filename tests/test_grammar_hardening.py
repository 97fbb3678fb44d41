"""Structured output against hostile and careless constraints (issue 16): a constraint no output
satisfies, or one past a backend's limits, is a GrammarError at compile time (a 400), never a
mask that allows a token its matcher then refuses; JSON whitespace is bounded in every backend;
a tool without parameters takes none; the compile cache is bounded by bytes and schemas by
size."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import pytest
import torch

from engine import SamplingParams
from engine.sampling.structured import GrammarStage
from grammar.backend import BackendError, Matcher
from grammar.backends import make_backend
from grammar.compiler import GrammarCompiler
from grammar.probe import allowed_tokens, probe
from grammar.spec import (
    MAX_SCHEMA_NODES,
    ConstraintSpec,
    GrammarError,
    parse_response_format,
)
from grammar.tool_parser import HERMES
from grammar.tools import NO_PARAMETERS, check_tool_output, parse_tools, tool_constraint
from grammar.vocab import TokenVocab

REF_CYCLE = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
UNSATISFIABLE = [
    {"type": "json_schema", "json_schema": {"name": "cycle", "schema": REF_CYCLE}},
    {"type": "regex", "regex": r"[^\x00-\x{10FFFF}]"},  # an empty character class
    {"type": "grammar", "grammar": "root ::= a\na ::= b\nb ::= a"},  # never produces text
]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from engine.config import default_cache_dir
    from engine.runner.loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(None, default_cache_dir()))


@pytest.fixture(scope="module")
def vocab(tokenizer) -> TokenVocab:
    return TokenVocab.from_tokenizer(tokenizer, len(tokenizer))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    with GrammarCompiler(tokenizer, len(tokenizer), timeout_s=60) as c:
        yield c


def empty_bitmask(vocab: TokenVocab) -> torch.Tensor:
    return torch.zeros((1, -(-vocab.vocab_size // 32)), dtype=torch.int32)  # (1, V / 32)


# -- unsatisfiable and oversized constraints ------------------------------------------------


@pytest.mark.parametrize("rf", UNSATISFIABLE, ids=["ref-cycle", "empty-class", "rule-cycle"])
def test_unsatisfiable_constraint_is_a_grammar_error(compiler: GrammarCompiler, rf):
    spec = parse_response_format(rf)
    with pytest.raises(GrammarError, match="no output can satisfy this") as e:
        compiler.compile(spec)
    assert e.value.param == spec.param
    # The verdict stops the chain: xgrammar reads the empty class as something else.
    assert "xgrammar" not in e.value.message


def test_llguidance_mask_allows_only_what_its_matcher_takes(vocab: TokenVocab):
    backend = make_backend("llguidance", vocab)
    bitmask = empty_bitmask(vocab)
    # A dead end: llguidance's own mask allows EOS there, which its matcher refuses.
    spec = parse_response_format(UNSATISFIABLE[0])
    backend.load(backend.compile(spec))().fill_bitmask(bitmask, 0)
    assert not bitmask.any()
    # A lexer limit llguidance checks when it consumes a token, not when it masks: the
    # matcher says so instead of refusing the token as if the grammar forbade it.
    m = backend.load(backend.compile(ConstraintSpec("regex", "a{1000000}")))()
    m.fill_bitmask(bitmask, 0)
    (token,) = allowed_tokens(bitmask[0], vocab.vocab_size)
    with pytest.raises(BackendError, match="lexer error: too many expressions"):
        m.accept(token)


@pytest.mark.parametrize("regex", ["a{1000000}", "(a{1000}){1000}"])
def test_grammar_past_a_backend_limit_falls_back(compiler: GrammarCompiler, regex: str):
    """llguidance fails on the first token of these; the probe sends them to xgrammar, whose
    mask and matcher agree along the walk."""
    grammar = compiler.compile(ConstraintSpec("regex", regex))
    assert grammar.backend != "llguidance"
    probe(grammar.matcher(), compiler.vocab, steps=64)


def test_artifact_over_the_byte_cap_is_refused(tokenizer):
    with GrammarCompiler(
        tokenizer, len(tokenizer), backends=["llguidance"], max_artifact_bytes=64
    ) as c:
        with pytest.raises(GrammarError, match="over the 64 byte limit"):
            c.compile(ConstraintSpec("regex", "[0-9]+"))


class _Stuck(Matcher):
    """A matcher whose state allows nothing."""

    def fill_bitmask(self, bitmask, row):
        bitmask[row].zero_()

    def accept(self, token_id):
        return False

    def rollback(self, n):
        pass

    def is_terminated(self):
        return False

    def forced_continuation(self):
        return ""


class _OverLimit(_Stuck):
    """A matcher that fails on a token its mask allowed (a backend's resource limit)."""

    def fill_bitmask(self, bitmask, row):
        bitmask[row].fill_(-1)

    def accept(self, token_id):
        raise BackendError("llguidance: lexer error: too many expressions constructed")


def test_stage_fails_a_row_its_matcher_cannot_continue(tokenizer):
    stage = GrammarStage(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    try:
        _, _, errors = stage._fill(
            [(0, _Stuck().fill_bitmask), (2, _OverLimit().fill_bitmask)], [0, 2], 3)
        assert errors == {0: "the grammar allows no next token: the output cannot be completed"}
        why = GrammarStage.accept(SimpleNamespace(matcher=_OverLimit(), reasoning=None), 7)
        assert why == ("the grammar backend failed on sampled token 7: llguidance: lexer "
                       "error: too many expressions constructed")
    finally:
        stage.close()


def test_first_compile_builds_the_compiler_off_the_callers_thread(tokenizer):
    """The caller may be the event loop; building the compiler takes ~1.3 s."""
    stage = GrammarStage(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    try:
        t0 = time.perf_counter()
        good = stage.compile(ConstraintSpec("regex", "[0-9]+"))
        bad = stage.compile(ConstraintSpec("grammar", 'root ::= "a" ('))
        assert time.perf_counter() - t0 < 0.2
        assert good.result(timeout=120).backend == "llguidance"
        with pytest.raises(GrammarError, match="cannot compile this grammar"):
            bad.result(timeout=120)
    finally:
        stage.close()


def test_unsatisfiable_request_fails_alone(smollm2):
    eng = smollm2.engine
    bad = SamplingParams(max_tokens=4, response_format=UNSATISFIABLE[2])
    eng.add_request("unsatisfiable", [1, 2, 3], bad)
    eng.add_request("plain", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    by_id = {o.request_id: o for o in outs if o.finished}
    assert by_id["unsatisfiable"].finish_reason == "error"
    assert "no output can satisfy this grammar" in by_id["unsatisfiable"].error
    assert by_id["plain"].finish_reason == "length"


def test_schema_over_the_node_limit_is_refused_before_checking_it():
    props = {f"p{i}": {"type": "string"} for i in range(20_000)}
    rf = {"type": "json_schema",
          "json_schema": {"name": "big", "schema": {"type": "object", "properties": props}}}
    t0 = time.perf_counter()
    with pytest.raises(GrammarError, match=f"more than {MAX_SCHEMA_NODES} objects and arrays"):
        parse_response_format(rf)
    assert time.perf_counter() - t0 < 2  # checking it against the metaschema took 5 to 16 s


# -- JSON whitespace ------------------------------------------------------------------------


@pytest.mark.parametrize("backend_name", ["llguidance", "xgrammar", "outlines"])
def test_json_whitespace_is_at_most_one_space(vocab: TokenVocab, tokenizer, backend_name: str):
    backend = make_backend(backend_name, vocab)
    spec = parse_response_format(
        {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    )
    factory = backend.load(backend.compile(spec))
    bitmask, stop = empty_bitmask(vocab), vocab.stop_token_ids[0]

    def accepts(text: str) -> bool:
        m = factory()
        for t in [*tokenizer.encode(text, add_special_tokens=False), stop]:
            m.fill_bitmask(bitmask, 0)
            if not (int(bitmask[0, t // 32]) >> (t % 32)) & 1 or not m.accept(t):
                return False
        return True

    assert accepts('{"name": "Ann", "age": 3}') and accepts('{"name":"Ann","age":3}')
    assert accepts('{ "name" : "Ann" , "age" : 3 }')
    assert not accepts('{\n  "name": "Ann",\n  "age": 3\n}')
    assert not accepts('{"name":  "Ann", "age": 3}') and not accepts('{"name":\t"Ann", "age": 3}')
    # Between tokens the mask offers no newline, tab or second space.
    m = factory()
    for t in tokenizer.encode('{"name":', add_special_tokens=False):
        assert m.accept(t)
    m.fill_bitmask(bitmask, 0)
    texts = [vocab.tokens[t] for t in allowed_tokens(bitmask[0], vocab.vocab_size)]
    assert texts and not [t for t in texts if re.search(rb"[\n\r\t]|^\s\s", t)]


def test_json_output_has_no_whitespace_runs(smollm2):
    ask = "Describe New York City as a pretty-printed, indented JSON object."
    prompt = smollm2.tokenizer.apply_chat_template(
        [{"role": "user", "content": ask}], add_generation_prompt=True, tokenize=False
    )
    schema = {"type": "object", "properties": {"name": {"type": "string"},
              "country": {"type": "string"}, "population": {"type": "integer"}}}
    formats = [{"type": "json_object"},
               {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}]
    params = [SamplingParams(max_tokens=48, temperature=1.0, seed=seed, response_format=rf)
              for rf in formats for seed in range(4)]
    outs = smollm2.generate([prompt] * len(params), params)
    for out in outs:
        assert out.finish_reason in ("stop", "length"), out.error
        between = STRING.sub('""', out.text)
        if between.count('"') % 2:  # cut inside a string: drop its start
            between = between[: between.rfind('"')]
        assert not re.search(r"[\n\r\t]|  ", between), out.text


# -- tools without parameters ---------------------------------------------------------------


def test_tool_without_parameters_takes_no_arguments(compiler: GrammarCompiler, tokenizer):
    choice = parse_tools([{"type": "function", "function": {"name": "now"}}], "required", False)
    assert choice.tools[0].parameters == NO_PARAMETERS
    spec = tool_constraint(choice)
    assert check_tool_output(spec, HERMES.render("now", "{}")) is None
    assert check_tool_output(spec, HERMES.render("now", '{"tz": "UTC"}')) is not None
    # The grammar ends the arguments at once: `{`, at most a space, `}`.
    m = compiler.compile(spec).matcher()
    prefix = HERMES.render("now", "{").rstrip()
    prefix = prefix[: prefix.index("{", prefix.index('"arguments"')) + 1]
    for t in tokenizer.encode(prefix, add_special_tokens=False):
        assert m.accept(t)
    bitmask = empty_bitmask(compiler.vocab)
    m.fill_bitmask(bitmask, 0)
    texts = {compiler.vocab.tokens[t] for t in allowed_tokens(bitmask[0], compiler.vocab_size)}
    assert texts and all(t.lstrip(b" ").startswith(b"}") or t == b" " for t in texts), texts


# -- the compile cache ----------------------------------------------------------------------


def test_cache_evicts_by_bytes(tokenizer):
    with GrammarCompiler(tokenizer, len(tokenizer), backends=["llguidance"]) as c:
        a = c.submit(ConstraintSpec("regex", "[0-9]{3}a"))
        assert a.result().nbytes > 0
        one = c.cached_bytes  # the spec's text and the grammar's estimated memory
        c.cache_bytes = int(one * 2.5)  # room for two such entries
        b = c.submit(ConstraintSpec("regex", "[0-9]{3}b"))
        b.result()
        d = c.submit(ConstraintSpec("regex", "[0-9]{3}d"))
        d.result()
        assert c.cached_bytes <= c.cache_bytes
        assert c.submit(ConstraintSpec("regex", "[0-9]{3}d")) is d  # still cached
        assert c.submit(ConstraintSpec("regex", "[0-9]{3}b")) is b
        assert c.submit(ConstraintSpec("regex", "[0-9]{3}a")) is not a  # evicted first
        # An entry larger than the whole budget is not kept (and evicts nothing for it).
        before = c.cached_bytes
        c.cache_bytes = before
        big = c.submit(ConstraintSpec("regex", "[0-9]{3}" + "x" * 5000))
        big.result()
        assert c.cached_bytes == before
        assert c.submit(ConstraintSpec("regex", "[0-9]{3}" + "x" * 5000)) is not big
