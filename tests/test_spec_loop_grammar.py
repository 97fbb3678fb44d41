"""Constrained requests in the overlapped speculative loop (engine/spec/loop.py): the draw of
each step waits until the host has read the step before and filled the grammar masks of every
drafted position; the tokens are those of the overlapped schedule without drafts."""

from __future__ import annotations

import json

import jsonschema

from engine import SamplingParams
from grammar.tools import parse_tools, tool_constraint
from tests.test_overlap import overlapped
from tests.test_speculative import RECORD, RECORD_SCHEMA, looping

TOOL = {"type": "function", "function": {"name": "search_logs", "parameters": {
    "type": "object", "properties": {"service": {"type": "string"}, "limit": {"type": "integer"}},
    "required": ["service", "limit"], "additionalProperties": False}}}


def _chat(llm, text: str) -> list[int]:
    tok = llm.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}],
                                              tokenize=False, add_generation_prompt=True))


def test_constrained_requests_loop_with_masked_drafts(smollm2):
    """JSON-schema requests (greedy, seeded, with logprobs), a tool call and a free request,
    batched in the loop: each step verifies drafts under the masks of its positions; tokens,
    text, finish reasons and logprobs equal the overlapped schedule's without speculation, the
    outputs validate, and no page leaks."""
    rf = {"type": "json_schema", "json_schema": {"name": "r", "schema": RECORD_SCHEMA}}
    record = _chat(smollm2, f"Repeat this JSON exactly:\n{json.dumps(RECORD)}")
    call = tool_constraint(parse_tools([TOOL], {"type": "function",
                                                "function": {"name": "search_logs"}}))
    prompts = [record, record, record,
               _chat(smollm2, "Search the logs of service payments-eu-west-1, 20 lines."),
               _chat(smollm2, "Count from one to ten in words.")]
    params = [SamplingParams(max_tokens=60, temperature=0, response_format=rf),
              SamplingParams(max_tokens=60, temperature=0.8, seed=7, response_format=rf),
              SamplingParams(max_tokens=60, temperature=0, response_format=rf, logprobs=1),
              SamplingParams(max_tokens=48, temperature=0, constraint=call),
              SamplingParams(max_tokens=24, temperature=0)]
    eng = smollm2.engine
    with overlapped(smollm2):
        plain = smollm2.generate(prompts, params)
    eng.reset_prefix_cache()
    free = eng.allocator.num_free
    with looping(smollm2) as (spec, steps):
        got = smollm2.generate(prompts, params)
    assert steps and max(map(len, steps)) == len(prompts)  # constrained ones looped
    assert spec.stats.accepted > 0 and spec.stats.emitted > 1.5 * spec.stats.forwards
    for g, want in zip(got, plain, strict=True):
        assert (g.token_ids, g.text, g.finish_reason) == (
            want.token_ids, want.text, want.finish_reason)
    for g in got[:3]:
        assert g.finish_reason == "stop", g.text
        jsonschema.validate(json.loads(g.text), RECORD_SCHEMA)
    assert got[3].text.startswith('<tool_call>\n{"name": "search_logs"'), got[3].text
    lps, want_lps = got[2].logprobs or [], plain[2].logprobs or []
    assert len(lps) == len(got[2].token_ids)
    assert [lp.token_id for lp in lps] == [lp.token_id for lp in want_lps]
    eng.reset_prefix_cache()
    assert eng.allocator.num_free == free
