"""The sampler inside the engine (embedded SmolLM2) and `min_tokens` through the gateway's
request planning."""

from __future__ import annotations

import json

import pytest

from engine import SamplingParams
from gateway.errors import APIError
from gateway.openai.params import plan_completion
from gateway.openai.schemas import CompletionRequest
from gateway.openai.tokenizer import GatewayTokenizer
from tests.test_gateway_units import _facts, _FakeHF

SHORT = [{"role": "user", "content": "Reply with one word: yes or no. Is water wet?"}]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_min_tokens_holds_eos_back(smollm2, sampled):
    kw = dict(temperature=0.8, seed=7) if sampled else dict(temperature=0.0)
    free = smollm2.chat(SHORT, SamplingParams(max_tokens=40, **kw))[0]
    assert free.finish_reason == "stop" and len(free.token_ids) < 12  # EOS comes quickly
    n = len(free.token_ids) + 6
    held = smollm2.chat(SHORT, SamplingParams(max_tokens=40, min_tokens=n, **kw))[0]
    assert len(held.token_ids) >= n
    eos = smollm2.engine.eos_token_ids
    assert not eos & set(held.token_ids[:n])
    again = smollm2.chat(SHORT, SamplingParams(max_tokens=40, min_tokens=n, **kw))[0]
    assert again.token_ids == held.token_ids  # greedy, or seeded: reproducible


def test_min_tokens_through_the_gateway():
    tok = GatewayTokenizer(_FakeHF())

    def plan(**extra):
        body = {"model": "m", "prompt": "a b", "max_tokens": 5, **extra}
        return plan_completion(CompletionRequest.model_validate_json(json.dumps(body)), tok,
                               _facts(), None).jobs

    assert plan()[0].params.min_tokens == 0
    assert plan(min_tokens=5)[0].params.min_tokens == 5
    with pytest.raises(APIError) as e:
        plan(min_tokens=6)
    assert e.value.status == 400 and e.value.param == "min_tokens"
