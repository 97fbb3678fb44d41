"""The overlapped decode schedule (engine/core/steps.py `OverlapStep`) gives exactly the synchronous
engine's outputs: tokens, text, finish reasons, logprobs; it drains for admissions, drops the
rows of requests aborted or stopped while a step was in flight, and leaks no page. On CUDA it
is the default; here (CPU) each test turns it on for the shared SmolLM2 engine."""

from __future__ import annotations

import json
from contextlib import contextmanager

import jsonschema
import pytest
import torch

from engine.sampling.params import SamplingParams


class Launches(list):
    """Per launch, whether it was queued ahead; `prefills`: the ahead ones that started
    requests (a prompt computed in the overlapped loop)."""

    prefills = 0


@contextmanager
def overlapped(llm, on: bool = True):
    """Run `llm` with the overlapped schedule `on`; count the steps queued ahead."""
    eng, runner = llm.engine, llm.engine.runner
    launch, ahead = runner.launch, Launches()

    def counting(batch, after=None):
        ahead.append(after is not None)
        if after is not None and any(s.num_new_tokens > 1 for s in batch.seqs):
            ahead.prefills += 1
        return launch(batch, after)

    eng.overlap, runner.launch = on, counting
    try:
        yield ahead
    finally:
        eng.overlap = False
        del runner.launch


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 4000, (int(k),), generator=g).tolist()
            for k in torch.randint(3, 40, (n,), generator=g)]


def _assert_same(got, want) -> None:
    """Same tokens, text and finish reason; logprobs within a tolerance: the two schedules run
    different batch shapes, whose float results differ in the last bits from CPU to CPU."""
    assert (got.token_ids, got.text, got.finish_reason) == (
        want.token_ids, want.text, want.finish_reason)
    got_lps, want_lps = got.logprobs or [], want.logprobs or []
    assert [lp.token_id for lp in got_lps] == [lp.token_id for lp in want_lps]
    assert [lp.logprob for lp in got_lps] == pytest.approx(
        [lp.logprob for lp in want_lps], abs=1e-3)


def test_overlap_matches_sync(smollm2):
    prompts = _prompts(7, seed=1)
    params = [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.8, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.9, seed=3, frequency_penalty=0.5),
        SamplingParams(max_tokens=18, temperature=0, repetition_penalty=1.3, ignore_eos=True),
    ]
    with overlapped(smollm2, on=False):
        sync = smollm2.generate(prompts, params)
    # A stop string met mid-run ends that request while its next step is already queued.
    text = sync[0].text
    params[0] = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                               stop=[text[len(text) // 2 : len(text) // 2 + 2]])
    with overlapped(smollm2, on=False):
        sync[0] = smollm2.generate([prompts[0]], [params[0]])[0]
    assert sync[0].finish_reason == "stop"
    with overlapped(smollm2) as ahead:
        over = smollm2.generate(prompts, params)
    assert sum(ahead) >= 10  # the decode steps did run ahead
    for got, want in zip(over, sync, strict=True):
        _assert_same(got, want)


def test_overlap_admits_aborts_and_frees_pages(smollm2):
    eng = smollm2.engine
    prompts = _prompts(5, seed=2)
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    with overlapped(smollm2, on=False):
        sync = smollm2.generate(prompts, [greedy] * 5)
    eng.reset_prefix_cache()
    free = eng.allocator.num_free
    got: dict[str, list[int]] = {}
    with overlapped(smollm2) as ahead:
        for i in range(3):
            eng.add_request(f"ov-{i}", prompts[i], greedy)
        steps = 0
        while eng.has_unfinished_requests():
            for o in eng.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
            steps += 1
            if steps == 4:  # joins while decodes run ahead: the schedule drains and admits
                eng.add_request("ov-3", prompts[3], greedy)
                eng.add_request("ov-4", prompts[4], greedy)
            if steps == 6:
                assert eng.abort_request("ov-1").finish_reason == "abort"
    assert sum(ahead) >= 5
    for i in (0, 2, 3, 4):
        assert got[f"ov-{i}"] == sync[i].token_ids
    assert got["ov-1"] == sync[1].token_ids[: len(got["ov-1"])] and len(got["ov-1"]) < 10
    eng.reset_prefix_cache()
    assert eng.allocator.num_free == free


def test_overlap_constrained_outputs_validate(smollm2):
    """Overlapped, a grammar's forced tokens are sampled one per step (no jump-forward): the
    masks of step N+1 are filled once step N's tokens are accepted."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                "n": {"type": "integer"}},
              "required": ["name", "n"], "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    params = [SamplingParams(max_tokens=60, temperature=t, seed=i, response_format=rf)
              for i in range(4) for t in (0, 0.7)]
    params.append(SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    with overlapped(smollm2) as ahead:
        outs = smollm2.generate(_prompts(9, seed=0), params)
    assert sum(ahead) >= 20
    # SmolLM2-135M may run out of tokens inside a string; most outputs complete.
    reasons = [o.finish_reason for o in outs[:8]]
    assert set(reasons) <= {"stop", "length"} and "stop" in reasons
    for out in outs[:8]:
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), schema)
    assert len(outs[8].token_ids) == 30


def test_overlap_prefills_arrivals_ahead_and_chunks_in_sync(smollm2):
    """Requests that arrive while the loop runs start inside it (their prompt computed in a
    step queued ahead, beside the decodes) when the whole prompt fits a step; one that needs
    chunks hands back to the regular schedule. Outputs are the synchronous engine's."""
    eng = smollm2.engine
    prompts = _prompts(5, seed=5)
    g = torch.Generator().manual_seed(9)
    prompts.append(torch.randint(0, 4000, (90,), generator=g).tolist())  # two chunks of 64
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True) for _ in range(3)]
    params += [SamplingParams(max_tokens=9, temperature=0.8, seed=4, ignore_eos=True),
               SamplingParams(max_tokens=8, temperature=0, logprobs=1, ignore_eos=True),
               SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)]
    budget = eng.scheduler.max_num_batched_tokens
    eng.scheduler.max_num_batched_tokens = 64
    try:
        with overlapped(smollm2, on=False):
            sync = smollm2.generate(prompts, params)
        eng.reset_prefix_cache()
        free = eng.allocator.num_free
        got: dict[str, list[int]] = {}
        with overlapped(smollm2) as ahead:
            eng.add_request("pa-0", prompts[0], params[0])
            steps = 0
            while eng.has_unfinished_requests():
                for o in eng.step():
                    got.setdefault(o.request_id, []).extend(o.new_token_ids)
                steps += 1
                if 2 <= steps <= 6:  # one arrival per step while decodes run ahead
                    i = steps - 1
                    eng.add_request(f"pa-{i}", prompts[i], params[i])
    finally:
        eng.scheduler.max_num_batched_tokens = budget
    assert ahead.prefills >= 3  # short prompts started inside the loop
    for i, want in enumerate(sync):
        assert got[f"pa-{i}"] == want.token_ids, i
    eng.reset_prefix_cache()
    assert eng.allocator.num_free == free
