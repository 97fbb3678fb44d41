"""Structured output end to end on SmolLM2: a constrained request that finishes with "stop"
returns output that validates — across real MaskBench schemas, regex, choice and EBNF."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from engine import InvalidRequestError, SamplingParams
from tests.maskbench import MASKBENCH


def dev_schemas(n: int, max_bytes: int = 1500) -> list[tuple[str, dict]]:
    """`n` small schemas spread deterministically over the dev set."""
    files = sorted(MASKBENCH.glob("*.json"))
    picked = []
    for f in files[:: max(1, len(files) // (3 * n))]:
        schema = json.loads(f.read_text())["schema"]
        if len(json.dumps(schema)) <= max_bytes:
            picked.append((f.stem, schema))
    return picked[:n]


@pytest.mark.skipif(not MASKBENCH.is_dir(), reason="../shared/maskbench-dev not present")
def test_dev_set_outputs_validate_or_hit_length(smollm2):
    cases = dev_schemas(200)
    assert len(cases) >= 150
    params = [
        SamplingParams(
            max_tokens=56,
            temperature=1.0,
            seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": s}},
        )
        for i, (_, s) in enumerate(cases)
    ]
    outs = smollm2.generate(["Answer in JSON:"] * len(cases), params)
    reasons = {"stop": 0, "length": 0, "error": 0}
    for (_, schema), out in zip(cases, outs, strict=True):
        reasons[out.finish_reason] += 1
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), schema)  # never invalid as "stop"
    # "error" = a relaxed backend let an invalid output through and the final check caught it.
    assert reasons["stop"] >= len(cases) // 4 and reasons["error"] <= len(cases) // 20, reasons


def test_regex_choice_and_ebnf(smollm2):
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    specs = [
        (
            {"type": "regex", "regex": r"[A-Z][a-z]{2,6} [0-9]{2}"},
            lambda t: re.fullmatch(r"[A-Z][a-z]{2,6} [0-9]{2}", t),
        ),
        (
            {"type": "choice", "choices": ["yes", "no", "maybe"]},
            lambda t: t in ("yes", "no", "maybe"),
        ),
        (
            {"type": "grammar", "grammar": grammar},
            lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t),
        ),
        ({"type": "json_object"}, lambda t: isinstance(json.loads(t), dict)),
    ]
    params = [
        SamplingParams(max_tokens=40, temperature=0.8, seed=3, response_format=rf)
        for rf, _ in specs
    ]
    outs = smollm2.generate(["Reply:"] * len(specs), params)
    for (rf, ok), out in zip(specs, outs, strict=True):
        if out.finish_reason == "stop":
            assert ok(out.text), (rf, out.text)
    assert sum(o.finish_reason == "stop" for o in outs) >= 3


def test_vllm_structured_outputs_field(smollm2):
    p = SamplingParams(
        max_tokens=8, temperature=0, structured_outputs={"choice": ["alpha", "beta"]}
    )
    out = smollm2.generate("Greek letter:", p)[0]
    assert out.finish_reason == "stop" and out.text in ("alpha", "beta")


@pytest.mark.parametrize(
    "rf",
    [
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wrong"}}},
        {"type": "json_schema", "json_schema": {"name": "x"}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/none"}}},
        {"type": "regex"},
        {"type": "choice", "choices": []},
        {"type": "nonsense"},
    ],
)
def test_malformed_specs_refused_at_construction(rf):
    with pytest.raises(InvalidRequestError):
        SamplingParams(response_format=rf)


def test_uncompilable_spec_fails_only_its_request(smollm2):
    eng = smollm2.engine
    bad = SamplingParams(max_tokens=4, response_format={"type": "grammar", "grammar": "root ::= ("})
    eng.add_request("bad-grammar", [1, 2, 3], bad)
    eng.add_request("plain", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    by_id = {o.request_id: o for o in outs if o.finished}
    assert by_id["bad-grammar"].finish_reason == "error" and by_id["bad-grammar"].error
    assert by_id["plain"].finish_reason == "length"
    eng.reset_prefix_cache()  # the cache holds the finished KV; nothing else may
    assert eng.allocator.num_used == 0


def test_compiling_grammar_does_not_hold_back_others(smollm2):
    """While a request waits for its grammar, unconstrained ones decode every step."""
    eng = smollm2.engine
    props = {f"field_{i}": {"type": ["string", "integer", "null"]} for i in range(40)}
    slow = {"type": "object", "properties": props, "minProperties": 3}
    eng.add_request(
        "slow",
        [1, 2, 3],
        SamplingParams(
            max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": slow}},
        ),
    )
    eng.add_request("fast", [4, 5, 6], SamplingParams(max_tokens=5, ignore_eos=True))
    steps, fast_done = 0, None
    while fast_done is None:
        steps += 1
        fast_done = next((steps for o in eng.step() if o.request_id == "fast" and o.finished), None)
    assert fast_done == 5  # one token per step from its first step: never waited
    deadline = time.monotonic() + 120
    while eng.has_unfinished_requests() and time.monotonic() < deadline:
        eng.step() or time.sleep(0.01)
    assert not eng.has_unfinished_requests()
    eng.reset_prefix_cache()
    assert eng.allocator.num_used == 0


def test_forced_text_encodes_as_the_tokenizer_does(smollm2):
    """The grammar stage encodes forced text with the Rust tokenizer directly: the same ids
    as transformers' `encode`, on the kinds of text grammars force."""
    tok, grammar = smollm2.tokenizer, smollm2.engine.grammar
    for text in ['{"name": "', '", "city": "', '"}', ' {\n  "arguments": {', "<tool_call>",
                 '\u00e9t\u00e9 "x"', "  \n\t", "[1, 2, 3]", "</s> and <|im_end|>"]:
        assert grammar._encode(text) == tok.encode(text, add_special_tokens=False), text


def test_jump_forward_appends_forced_tokens(smollm2):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
        "required": ["name", "city"],
        "additionalProperties": False,
    }
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    before = smollm2.engine.grammar.jump_forward_tokens
    out = smollm2.chat(
        [{"role": "user", "content": "A person as JSON"}],
        SamplingParams(max_tokens=60, temperature=0, response_format=rf),
    )[0]
    assert smollm2.engine.grammar.jump_forward_tokens > before
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), schema)
    # The text is what the tokens decode to: forced tokens went through the detokenizer too.
    assert out.text == smollm2.tokenizer.decode(out.token_ids, skip_special_tokens=True)
