"""GrammarCompiler: the LRU cache of futures, the backend fallback chain, and containment
(wall-time cap, memory cap, crashed workers) with the real SmolLM2 tokenizer."""

from __future__ import annotations

import os
import time

import pytest
import torch

from grammar.compiler import GrammarCompiler
from grammar.spec import ConstraintSpec, GrammarError, parse_response_format

# Optional properties in non-strict mode are slow for xgrammar: ~2-3 s and tens of MB.
SLOW = parse_response_format(
    {
        "type": "json_schema",
        "json_schema": {
            "name": "slow",
            "schema": {
                "type": "object",
                "properties": {f"f{i}": {"type": "string"} for i in range(100)},
            },
        },
    }
)


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from engine.config import default_cache_dir
    from engine.runner.loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(None, default_cache_dir()))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    with GrammarCompiler(tokenizer, len(tokenizer), timeout_s=30) as c:
        yield c


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_compiles_and_caches_by_spec(compiler: GrammarCompiler, tokenizer):
    spec = parse_response_format({"type": "choice", "choices": ["red", "green"]})
    future = compiler.submit(spec)
    assert compiler.submit(ConstraintSpec("choice", ("red", "green"))) is future  # same key
    grammar = future.result(timeout=60)
    assert grammar.backend == "llguidance" and grammar.spec == spec and grammar.compile_ms > 0
    # Fill row 1 of a batch bitmask; row 0 belongs to another request and stays untouched.
    bitmask = torch.full((2, (compiler.vocab_size + 31) // 32), 7, dtype=torch.int32)
    grammar.matcher().fill_bitmask(bitmask, 1)
    assert (bitmask[0] == 7).all()
    allowed = [t for t in range(compiler.vocab_size) if bitmask[1, t // 32] >> (t % 32) & 1]
    assert {tokenizer.decode([t]) for t in allowed} >= {"red", "green"}
    assert compiler.submit(ConstraintSpec("choice", ("green", "red"))) is not future


@pytest.mark.parametrize(
    "rf",
    [
        {"type": "regex", "regex": r"\p{L}+"},
        {
            "type": "json_schema",
            "json_schema": {"schema": {"type": "string", "pattern": r"\p{L}+"}},
        },
    ],
)
def test_falls_back_to_outlines(compiler: GrammarCompiler, tokenizer, rf, monkeypatch):
    """xgrammar cannot read Unicode classes (\\p{L}); outlines-core can."""
    monkeypatch.setattr(compiler, "backends", ("xgrammar", "outlines"))
    grammar = compiler.compile(parse_response_format(rf))
    assert grammar.backend == "outlines"
    m = grammar.matcher()
    text = "héllo" if rf["type"] == "regex" else '"héllo"'
    assert all(m.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))
    assert m.accept(tokenizer.eos_token_id) and m.is_terminated()


def test_all_backends_fail_names_each_reason(compiler: GrammarCompiler):
    spec = parse_response_format({"type": "grammar", "grammar": 'root ::= "a" ('})
    with pytest.raises(GrammarError) as e:
        compiler.compile(spec)
    assert "llguidance: Expected ')'" in e.value.message
    assert "llguidance-relaxed: relaxed mode applies to JSON schemas only" in e.value.message
    assert "xgrammar: EBNF parser error" in e.value.message
    assert "outlines: grammar constraints are not supported" in e.value.message
    assert e.value.param == "response_format.grammar"
    t0 = time.monotonic()
    with pytest.raises(GrammarError):  # a failure is cached: refused at once
        compiler.compile(spec)
    assert time.monotonic() - t0 < 0.1


def test_schema_no_backend_reads_is_a_grammar_error(compiler: GrammarCompiler):
    spec = ConstraintSpec("json_schema", '{"type": "strnig"}', param="x")  # bypasses parsing
    with pytest.raises(GrammarError, match="cannot compile this JSON schema") as e:
        compiler.compile(spec)
    assert e.value.param == "x"


def test_crashed_worker_is_replaced(compiler: GrammarCompiler):
    compiler.compile(ConstraintSpec("regex", "[0-9]+"))
    (pid,) = compiler.worker_pids
    os.kill(pid, 9)
    time.sleep(0.5)  # let the kernel close its socket; a crash mid-compile is the cap tests'
    grammar = compiler.compile(ConstraintSpec("regex", "[0-9]+x"))
    assert grammar.backend == "llguidance"
    (new_pid,) = compiler.worker_pids
    assert new_pid != pid


def test_wall_time_cap_kills_the_worker(compiler: GrammarCompiler, monkeypatch):
    compiler.compile(ConstraintSpec("regex", "a"))  # the worker is up
    (pid,) = compiler.worker_pids
    monkeypatch.setattr(compiler, "timeout_s", 0.5)
    monkeypatch.setattr(compiler, "backends", ("xgrammar",))
    t0 = time.monotonic()
    with pytest.raises(GrammarError, match="xgrammar: compilation took over the 0.5s limit"):
        compiler.compile(SLOW)
    assert time.monotonic() - t0 < 3
    assert not pid_alive(pid)


def test_memory_cap_kills_the_worker(tokenizer):
    with GrammarCompiler(tokenizer, len(tokenizer), backends=["xgrammar"], memory_limit_mb=8) as c:
        c.compile(ConstraintSpec("regex", "a"))
        (pid,) = c.worker_pids
        with pytest.raises(GrammarError, match="over the 8 MiB cap"):
            c.compile(SLOW)
        assert not pid_alive(pid)
        assert c.worker_pids == [None]  # replaced on next use (see the crash test)
