"""Sampling filters against direct definitions."""

from __future__ import annotations

import torch

from engine.request import Request
from engine.sampler import Sampler, _filtered_probs
from engine.sampling_params import SamplingParams


def reqs(**kw):
    return [Request("r", [1], SamplingParams(**kw))]


def test_top_k_top_p_min_p():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    assert (_filtered_probs(logits, reqs(top_k=2))[0] > 0).tolist() == [1, 1, 0, 0, 0]
    # top_p=0.8: 0.5 + 0.2 < 0.8, so 0.15 is still needed; 0.1 is not.
    assert (_filtered_probs(logits, reqs(top_p=0.8))[0] > 0).tolist() == [1, 1, 1, 0, 0]
    assert (_filtered_probs(logits, reqs(min_p=0.3))[0] > 0).tolist() == [1, 1, 1, 0, 0]
    p = _filtered_probs(logits, reqs(top_k=2))[0]
    assert torch.allclose(p[:2], torch.tensor([0.5, 0.2]) / 0.7)


def test_draws_follow_the_distribution():
    torch.manual_seed(0)
    sampler = Sampler(seed=0)
    probs = torch.tensor([0.6, 0.3, 0.1])
    counts = torch.zeros(3)
    rs = [Request(f"r{i}", [1], SamplingParams()) for i in range(4000)]
    toks = sampler(probs.log().repeat(4000, 1), rs)
    for s in toks:
        counts[s.token_id] += 1
    assert torch.allclose(counts / 4000, probs, atol=0.03)


def test_penalties_and_bias():
    sampler = Sampler()
    r = Request("r", [1], SamplingParams(temperature=0, presence_penalty=2.0, logit_bias={3: 5.0}))
    r.token_ids.append(0)  # token 0 already generated: penalized
    logits = torch.tensor([[3.0, 2.5, 0.0, 0.0]])
    assert sampler(logits.clone(), [r])[0].token_id == 3  # bias wins
    r.params.logit_bias = {}
    assert sampler(logits.clone(), [r])[0].token_id == 1  # presence penalty pushes 0 below 1


def test_rows_not_ok_come_back_as_minus_one():
    """The runner's non-finite flags ride with the tokens: a row not ok gets token -1 and no
    logprob; the others are sampled as if it were not there."""
    sampler = Sampler(seed=0)
    rs = [Request(f"r{i}", [1], SamplingParams(temperature=t, logprobs=1, seed=7))
          for i, t in enumerate([0.0, 0.0, 1.0])]
    logits = torch.tensor([[0.0, 5.0, 1.0], [9.0, 0.0, 0.0], [0.0, 0.0, 30.0]])
    out = sampler(logits.clone(), rs, ok=torch.tensor([True, False, True]))
    assert [s.token_id for s in out] == [1, -1, 2]
    assert out[1].logprob is None and out[0].logprob.token_id == 1
    assert out[0].logprob.top[0][0] == 1 and out[2].logprob.token_id == 2
