"""Speculative decoding (engine/spec/speculative.py): prompt-lookup drafts verified in one forward
give exactly the tokens of decoding one step at a time, greedy and seeded sampling alike, with
stop strings, max_tokens and logprobs as without speculation; constrained requests draft what
their grammar forces and what they copy, and still validate; opted-out and penalized requests
never draft; no page leaks."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from engine.sampling.params import SamplingParams
from engine.spec.speculative import MIN_ACCEPTANCE, PROBATION, PromptLookup, Speculator
from engine.spec.steps import DraftLoopStep


def test_prompt_lookup_takes_the_longest_latest_match():
    d = PromptLookup(min_ngram=2, max_ngram=4)
    # Suffix (2, 3, 4) occurs at 1..3: what followed it is proposed, up to k tokens.
    assert d.propose([1, 2, 3, 4, 5, 6, 9, 9, 2, 3, 4], 3) == [5, 6, 9]
    assert d.propose([1, 2, 3, 4, 5, 6, 9, 9, 2, 3, 4], 1) == [5]
    # The longer match wins over a later, shorter one; among equals, the latest.
    assert d.propose([7, 1, 2, 8, 5, 1, 2, 9, 5, 1, 2], 2) == [9, 5]
    assert d.propose([1, 2, 7, 3, 1, 2, 8, 0, 1, 2], 1) == [8]
    assert d.propose([1, 2, 3], 3) == []  # no earlier occurrence
    assert d.propose([4, 2, 5, 2], 3) == []  # a 1-token match is below min_ngram
    # Only the last `window` tokens are searched, the match's n-gram included.
    recent = PromptLookup(min_ngram=2, max_ngram=4, window=6)
    assert recent.propose([1, 2, 3, 9, 9, 9, 1, 2], 2) == []
    assert recent.propose([1, 2, 3, 9, 1, 2, 7, 1, 2], 2) == [7, 1]


@contextmanager
def speculating(llm, k: int = 4):
    eng = llm.engine
    eng.speculator = Speculator(k)
    try:
        yield eng.speculator
    finally:
        eng.speculator = None


def _copy_prompts(llm) -> list[list[int]]:
    """Chat prompts that ask to repeat text: the model copies its context, so drafts hit."""
    texts = [
        "def add_numbers(first_value, second_value):\n    return first_value + second_value\n",
        '{"service": "billing", "status": 503, "region": "eu-west-1", "retry": true}',
        "The quick brown fox jumps over the lazy dog. The quick brown fox jumps again.",
    ]
    tok = llm.tokenizer
    return [tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": f"Repeat this exactly:\n{t}"}], tokenize=False,
        add_generation_prompt=True)) for t in texts]


def _mixed_workload(llm):
    """Copying prompts under greedy, seeded and top-p sampling, logprobs (request 2),
    max_tokens inside a draft, a logit bias, and a stop string met inside an accepted draft
    (request 0); with their outputs from plain decoding."""
    prompts = _copy_prompts(llm)
    prompts = [prompts[i % len(prompts)] for i in range(6)]
    params = [
        SamplingParams(max_tokens=40, temperature=0),
        SamplingParams(max_tokens=40, temperature=0.8, seed=11),
        SamplingParams(max_tokens=30, temperature=0, logprobs=2),
        SamplingParams(max_tokens=7, temperature=0),  # max_tokens inside a draft
        SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, seed=5),
        SamplingParams(max_tokens=40, temperature=0, logit_bias={13: 2.0}),
    ]
    plain = llm.generate(prompts, params)
    text = plain[0].text
    params[0] = SamplingParams(max_tokens=40, temperature=0, stop=[text[20:26]])
    plain[0] = llm.generate([prompts[0]], [params[0]])[0]
    assert plain[0].finish_reason == "stop"
    return prompts, params, plain


def _assert_same_outputs(got, plain) -> None:
    """Tokens, text and finish reasons equal; request 2's logprobs within a tolerance."""
    for g, want in zip(got, plain, strict=True):
        assert (g.token_ids, g.text, g.finish_reason) == (
            want.token_ids, want.text, want.finish_reason)
    lps, want_lps = got[2].logprobs or [], plain[2].logprobs or []
    assert [lp.token_id for lp in lps] == [lp.token_id for lp in want_lps]
    assert [lp.logprob for lp in lps] == pytest.approx([lp.logprob for lp in want_lps],
                                                       abs=1e-3)


def test_speculation_gives_the_tokens_of_plain_decoding(smollm2):
    prompts, params, plain = _mixed_workload(smollm2)
    eng = smollm2.engine
    eng.reset_prefix_cache()
    free = eng.allocator.num_free
    with speculating(smollm2) as spec:
        got = smollm2.generate(prompts, params)
    assert spec.stats.forwards > 0 and spec.stats.accepted > 0
    assert spec.stats.emitted > spec.stats.forwards  # more than one token per forward
    _assert_same_outputs(got, plain)
    eng.reset_prefix_cache()
    assert eng.allocator.num_free == free


@contextmanager
def looping(llm, k: int = 4, max_batch: int = 8):
    """The overlapped speculative loop (engine/spec/loop.py) on this CPU engine: on CUDA the
    overlapped schedule is the default. Yields the speculator and the requests of each loop
    step as it is read back."""
    eng = llm.engine
    eng.speculator, eng.overlap = Speculator(k, max_batch=max_batch), True
    steps: list[list[str]] = []
    mode = next(m for m in eng.modes if isinstance(m, DraftLoopStep))
    collect = mode._collect

    def counting(prev):
        steps.append([r.request_id for r in prev.reqs])
        return collect(prev)

    mode._collect = counting
    try:
        yield eng.speculator, steps
    finally:
        eng.speculator, eng.overlap = None, False
        del mode._collect


def test_the_overlapped_loop_gives_the_tokens_of_plain_decoding(smollm2):
    """Drafts looked up on the device, verified, accepted and appended there, the next step
    queued before the host reads them: the tokens, text, finish reasons and logprobs of plain
    decoding, greedy and seeded, with max_tokens and a stop string inside accepted drafts and
    requests leaving the loop while the others go on; no page leaks."""
    prompts, params, plain = _mixed_workload(smollm2)
    eng = smollm2.engine
    eng.reset_prefix_cache()
    free = eng.allocator.num_free
    times = eng.step_times["speculative"][0]
    with looping(smollm2) as (spec, steps):
        got = smollm2.generate(prompts, params)
    assert len(steps) >= 8 and max(map(len, steps)) == len(prompts)
    assert len(steps[-1]) < len(prompts)  # requests left while the others went on
    assert eng.step_times["speculative"][0] - times == len(steps)
    assert spec.stats.accepted > 0 and spec.stats.emitted > 1.5 * spec.stats.forwards
    _assert_same_outputs(got, plain)
    eng.reset_prefix_cache()
    assert eng.allocator.num_free == free


def test_the_loop_drops_aborted_requests_and_hands_back_for_new_ones(smollm2):
    """A request aborted while its step is in flight leaves the loop; one that arrives ends
    the loop so that the regular schedule admits it, and the loop starts again with it. Every
    request gets its plain-decoding tokens."""
    prompts = _copy_prompts(smollm2)
    params = SamplingParams(max_tokens=36, temperature=0)
    want = [o.token_ids for o in smollm2.generate(prompts, [params] * 3)]
    eng = smollm2.engine
    eng.reset_prefix_cache()
    free = eng.allocator.num_free
    tokens: dict[str, list[int]] = {}
    done: dict[str, str | None] = {}

    def take(outputs):
        for o in outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                done[o.request_id] = o.finish_reason

    def step():
        take(eng.step())

    with looping(smollm2) as (spec, steps):
        eng.add_request("a", prompts[0], params)
        eng.add_request("x", prompts[1], params)
        while len(steps) < 3:
            step()
        take([eng.abort_request("x")])
        eng.add_request("b", prompts[2], params)
        while eng.has_unfinished_requests():
            step()
    assert tokens["a"] == want[0] and tokens["b"] == want[2]
    assert tokens["x"] == want[1][: len(tokens["x"])] and done["x"] == "abort"
    loops_with_b = [i for i, ids in enumerate(steps) if "b" in ids]
    assert loops_with_b and "x" not in steps[loops_with_b[0]]
    eng.reset_prefix_cache()
    assert eng.allocator.num_free == free


def test_seeded_sampling_is_the_same_with_and_without_speculation(smollm2):
    """Each position is drawn with the noise it has without speculation, and a draft is
    accepted exactly when it is the token drawn: over many seeds, identical outputs (so the
    same distribution)."""
    prompt = _copy_prompts(smollm2)[1]
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=s) for s in range(12)]
    plain = smollm2.generate([prompt] * 12, params)
    with speculating(smollm2, k=3) as spec:
        got = smollm2.generate([prompt] * 12, params)
    assert spec.stats.drafted > 0
    assert [g.token_ids for g in got] == [p.token_ids for p in plain]
    assert len({tuple(p.token_ids) for p in plain}) > 1  # the seeds do sample


def test_opted_out_and_penalized_requests_do_not_draft(smollm2):
    prompt = _copy_prompts(smollm2)[0]
    for params in (SamplingParams(max_tokens=20, temperature=0, speculative=False),
                   SamplingParams(max_tokens=20, temperature=0, frequency_penalty=0.5)):
        with speculating(smollm2) as spec:
            smollm2.generate([prompt], [params])
        assert spec.stats.drafted == 0 and spec.stats.forced == 0, params


def test_requests_that_cannot_draft_keep_the_overlapped_loop(smollm2):
    """Only a batch with a request that may draft leaves the overlapped loop for the regular
    schedule, which starts drafting; opted-out requests keep overlapping."""
    from tests.test_overlap import overlapped

    prompt = _copy_prompts(smollm2)[0]
    params = [SamplingParams(max_tokens=12, temperature=0, speculative=False)] * 2
    want = smollm2.generate([prompt, prompt], params)
    times = smollm2.engine.step_times  # per kind: [steps, seconds], for /metrics
    before = {k: v[0] for k, v in times.items()}
    with speculating(smollm2) as spec, overlapped(smollm2) as ahead:
        got = smollm2.generate([prompt, prompt], params)
    assert sum(ahead) >= 8 and spec.stats.forwards == 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert times["overlapped"][0] - before["overlapped"] >= 8
    assert times["speculative"][0] == before["speculative"]
    with speculating(smollm2) as spec, overlapped(smollm2) as ahead:
        smollm2.generate([prompt], [SamplingParams(max_tokens=12, temperature=0)])
    # A request that drafts runs the overlapped speculative loop instead (`looping` below).
    assert not any(ahead) and spec.stats.forwards > 0
    assert times["speculative"][0] - before["speculative"] >= spec.stats.forwards
    assert all(s > 0 for n, s in times.values() if n)


RECORD = {"service": "billing", "status": 503, "region": "eu-west-1", "retry": True}
RECORD_SCHEMA = {
    "type": "object",
    "properties": {"service": {"type": "string"}, "status": {"type": "integer"},
                   "region": {"type": "string"}, "retry": {"type": "boolean"}},
    "required": ["service", "status", "region", "retry"],
    "additionalProperties": False,
}  # fmt: skip


def test_constrained_drafts_are_forced_then_looked_up(smollm2):
    """A JSON-schema request drafts the keys and punctuation its grammar forces (accepted
    without verification) and the values it copies from its prompt (verified under the mask of
    each position): the same tokens as without speculation (jump-forward included), valid."""
    import json

    import jsonschema

    tok = smollm2.tokenizer
    prompt = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": f"Repeat this JSON exactly:\n{json.dumps(RECORD)}"}],
        tokenize=False, add_generation_prompt=True))
    rf = {"type": "json_schema", "json_schema": {"name": "r", "schema": RECORD_SCHEMA}}
    params = [SamplingParams(max_tokens=60, temperature=0, response_format=rf),
              SamplingParams(max_tokens=60, temperature=0.8, seed=7, response_format=rf),
              SamplingParams(max_tokens=60, temperature=0, response_format=rf, logprobs=1)]
    plain = smollm2.generate([prompt] * 3, params)
    eng = smollm2.engine
    eng.reset_prefix_cache()
    free = eng.allocator.num_free
    with speculating(smollm2) as spec:
        got = smollm2.generate([prompt] * 3, params)
    assert spec.stats.forced > 0 and spec.stats.accepted > 0  # both kinds of draft
    for g, want in zip(got, plain, strict=True):
        assert (g.token_ids, g.text, g.finish_reason) == (
            want.token_ids, want.text, want.finish_reason)
        assert g.finish_reason == "stop", g.text
        jsonschema.validate(json.loads(g.text), RECORD_SCHEMA)
    assert len(got[2].logprobs or []) == len(got[2].token_ids)
    eng.reset_prefix_cache()
    assert eng.allocator.num_free == free


def test_a_forced_run_shares_one_forward_with_looked_up_drafts(smollm2):
    """A tool call's head (`<tool_call>\n{"name": "...", "arguments": {"service": "`) is forced
    by its grammar: the step after the first token emits all of it, and the value copied from
    the prompt after it, in one forward; the tokens are those of plain decoding, and the call
    validates."""
    import json

    import jsonschema

    from grammar.tools import parse_tools, tool_constraint

    tool = {"type": "function", "function": {"name": "search_logs", "parameters": {
        "type": "object", "properties": {"service": {"type": "string"}},
        "required": ["service"], "additionalProperties": False}}}
    constraint = tool_constraint(parse_tools([tool], {"type": "function",
                                                      "function": {"name": "search_logs"}}))
    tok = smollm2.tokenizer
    prompt = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Search the logs of service payments-eu-west-1."}],
        tokenize=False, add_generation_prompt=True))
    params = SamplingParams(max_tokens=40, temperature=0, constraint=constraint)
    plain = smollm2.generate([prompt], [params])[0]
    eng = smollm2.engine
    per_step: list[int] = []
    with speculating(smollm2) as spec:
        eng.add_request("forced-run", prompt, params)
        while eng.has_unfinished_requests():
            per_step.extend(len(o.new_token_ids) for o in eng.step())
    assert sum(per_step) == len(plain.token_ids)
    head = len(tok.encode('\n{"name": "search_logs", "arguments": {"service": "',
                          add_special_tokens=False))
    assert per_step[1] > head, per_step  # the forced head and what follows, in one forward
    assert spec.stats.forced >= head - 1
    call = plain.text.removeprefix("<tool_call>").split("</tool_call>")[0]
    jsonschema.validate(json.loads(call)["arguments"], tool["function"]["parameters"])


def test_a_request_whose_drafts_fail_stops_drafting():
    from engine.core.request import Request
    from engine.core.scheduler import ScheduledSeq

    spec = Speculator(4)
    req = Request("r", [1, 2, 3, 1, 2], SamplingParams(max_tokens=50))
    seq = ScheduledSeq(req, 4, 1)
    seq.draft = [3, 1, 2, 3]
    assert spec._looks_up(req)
    while spec.stats.drafted < PROBATION:
        assert spec.accepted(seq, [9, 9, 9, 9, 9]) == 0  # every draft rejected
    assert not spec._looks_up(req)
    assert spec.drafts(req)  # what its grammar forces is still drafted
    spec.release(req)
    assert spec._looks_up(req)
    assert spec.accepted(seq, [3, 1, 7, 3, 0]) == 2
    assert MIN_ACCEPTANCE > 0


def test_serve_flag_sets_speculation() -> None:
    import argparse

    from gateway.cli import add_serve_parser, config_from_args

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--num-speculative-tokens", "4", "--port", "0"])
    assert config_from_args(args).num_speculative_tokens == 4
    from gateway.config import ConfigError

    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        config_from_args(parser.parse_args(["serve", "--num-speculative-tokens", "-1"]))


def test_acceptance_keeps_the_target_distribution():
    """A drafted decode's emitted tokens follow the target distribution, as speculative
    sampling's rejection rule promises for a one-hot draft d: accepted with probability p(d),
    otherwise a token of p restricted to the others; then the next position's token, under
    the grammar mask applied at that draft position. 4,000 seeded requests, chi-square at
    significance 1e-3 (fixed seeds: deterministic), no draws into the masked tokens."""
    from engine.core.scheduler import ScheduledSeq
    from engine.sampling.sampler import Sampler
    from tests.test_sampler import CHI2_CRIT, PROBS8, _chi2, request

    n, draft = 4000, 1  # the draft is token 1 (p = 0.20)
    second = torch.tensor([0.05, 0.25, 0.10, 0.20, 0.05, 0.15, 0.10, 0.10])
    banned = [3, 6]  # the grammar's mask at the draft's position
    masked = second.clone()
    masked[banned] = 0
    masked /= masked.sum()
    rows = torch.stack([PROBS8.log(), second.log().index_fill(0, torch.tensor(banned),
                                                              float("-inf"))])
    reqs = [request(f"r{i}", seed=i, temperature=1.0) for i in range(n)]
    sampler, spec = Sampler(seed=5), Speculator(1)
    drawn = sampler.collect(sampler.launch(rows.repeat(n, 1), [r for r in reqs for _ in (0, 1)],
                                           offsets=[0, 1] * n))
    first, after = torch.zeros(8, dtype=torch.float64), torch.zeros(8, dtype=torch.float64)
    accepted = 0
    for i, req in enumerate(reqs):
        seq = ScheduledSeq(req, req.num_tokens - 1, 2)
        seq.draft = [draft]
        t0, t1 = drawn[2 * i].token_id, drawn[2 * i + 1].token_id
        kept = spec.accepted(seq, [t0, t1])
        first[t0] += 1  # the first emitted token: the draft if accepted, else the drawn one
        if kept:
            accepted += 1
            after[t1] += 1
    stat, df = _chi2(first, PROBS8.double())
    assert stat < CHI2_CRIT[df], (stat, df)
    stat, df = _chi2(after, masked.double())
    assert stat < CHI2_CRIT[df], (stat, df)
    # acceptance ~ Binomial(n, p(d)): within 4 standard deviations
    p = float(PROBS8[draft])
    assert abs(accepted - n * p) < 4 * (n * p * (1 - p)) ** 0.5
    assert spec.stats.accepted == accepted


def test_verify_graph_inputs_give_the_eager_logits(smollm2):
    """On a GPU, a speculative step of several sequences replays a CUDA graph
    (`engine.runner.verify_graphs.VerifyGraphs`): `verify_forward` over `verify_layout`'s padded
    inputs.
    Run here without the capture, that forward gives each such step's eager logits."""
    from engine.runner.model_runner import _ends_sampled
    from engine.runner.verify_graphs import VERIFY_SIZES, verify_forward, verify_layout

    runner = smollm2.engine.runner
    forward, checked, q = runner.forward, [], 4  # 1 + the drafts of `speculating(k=3)`

    def both(inputs, input_ids=None):
        logits = forward(inputs, input_ids)
        s = len(inputs.tables)
        if s <= VERIFY_SIZES[-1] and inputs.num_decodes < s and _ends_sampled(inputs) \
                and max(inputs.num_new_tokens) <= q:
            b = next(size for size in VERIFY_SIZES if size >= s)
            d = {k: torch.from_numpy(v) for k, v in
                 verify_layout(inputs, b, q, runner.pad_page, runner.page_size).items()}
            starts = torch.arange(0, (b + 1) * q, q, dtype=torch.int32)
            got = verify_forward(runner.model, runner.kv_caches, d, b, q, runner.page_size,
                                 starts)
            torch.testing.assert_close(got[: len(inputs.sample_rows)], logits,
                                       atol=2e-4, rtol=1e-4)
            checked.append((s, sum(inputs.num_new_tokens)))
        return logits

    prompts = _copy_prompts(smollm2)
    params = [SamplingParams(max_tokens=24, temperature=0),
              SamplingParams(max_tokens=24, temperature=0.8, seed=3),
              SamplingParams(max_tokens=24, temperature=0)]
    runner.forward = both
    try:
        with speculating(smollm2, k=3):
            smollm2.generate(prompts, params)
    finally:
        del runner.forward
    assert any(tokens > s for s, tokens in checked), checked  # drafts in several sequences


def test_a_cpu_engine_speculates_for_a_lone_decode_only():
    """On a CPU the forward is compute-bound from a few rows on: `num_speculative_tokens`
    gives a speculator that drafts only when a step has one decode."""
    from engine import LLM
    from engine.spec.speculative import CPU_MAX_BATCH, MAX_BATCH

    spec = LLM("synthetic:tiny", num_pages=64, num_speculative_tokens=3).engine.speculator
    assert spec is not None and spec.k == 3 and spec.max_batch == CPU_MAX_BATCH < MAX_BATCH
    assert spec.wants(1) and not spec.wants(2)
