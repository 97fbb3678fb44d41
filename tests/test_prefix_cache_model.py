"""The prefix cache on the real SmolLM2: a cached prefix changes speed, never the tokens."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from engine import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
_ids = itertools.count()


def run(engine, prompt, tenant="default", adapter=None, session=None):
    """Run one request alone; returns (token ids, cached prompt tokens)."""
    rid = f"pc-{next(_ids)}"
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, adapter=adapter)
    engine.add_request(rid, prompt, params, tenant, session_id=session)
    tokens, cached = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                cached = out.num_cached_tokens
    return tokens, cached


@pytest.fixture()
def engine(smollm2):
    eng = smollm2.engine
    eng.reset_prefix_cache()
    yield eng
    eng.reset_prefix_cache()
    assert eng.allocator.num_used == 0  # nothing leaked besides what the cache held


@pytest.fixture(scope="module")
def prompt(smollm2):
    text = "Tool result: " + ", ".join(f"row {i} has value {i * 7 % 13}" for i in range(30))
    return smollm2.tokenizer.encode(text)  # ~ 300 tokens: many full pages


def test_repeat_hits_the_cache_with_identical_greedy_tokens(engine, prompt):
    cold, cached0 = run(engine, prompt)
    warm, cached1 = run(engine, prompt)
    ps = engine.cfg.page_size
    assert cached0 == 0 and cached1 >= len(prompt) - 2 * ps
    assert warm == cold
    longer, cached2 = run(engine, prompt + cold)  # a follow-up turn reuses prompt + reply
    assert cached2 >= len(prompt)
    engine.reset_prefix_cache()
    assert run(engine, prompt + cold) == (longer, 0)


def test_tenants_and_adapters_never_share(engine, prompt, smollm2, hf_smollm2, tmp_path):
    run(engine, prompt, tenant="alpha")
    assert run(engine, prompt, tenant="beta")[1] == 0
    assert run(engine, prompt, tenant="alpha")[1] > 0

    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    lora = peft.get_peft_model(copy.deepcopy(hf_smollm2),
                               peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    lora.save_pretrained(tmp_path / "a1")
    smollm2.load_adapter("a1", tmp_path / "a1")
    try:
        assert run(engine, prompt, adapter="a1")[1] == 0  # not the base model's KV
        assert run(engine, prompt, adapter="a1")[1] > 0
        # The same files registered again are the same adapter: its KV is found again.
        smollm2.unload_adapter("a1")
        smollm2.load_adapter("a1", tmp_path / "a1")
        assert run(engine, prompt, adapter="a1")[1] > 0
        # Other weights under the same name are another adapter: their KV starts cold.
        smollm2.unload_adapter("a1")
        with torch.no_grad():
            next(p for n, p in lora.named_parameters() if "lora_B" in n).add_(0.01)
        lora.save_pretrained(tmp_path / "a1")
        smollm2.load_adapter("a1", tmp_path / "a1")
        assert run(engine, prompt, adapter="a1")[1] == 0
    finally:
        smollm2.unload_adapter("a1")


def test_session_resumes_from_pinned_or_evicted_kv(engine, prompt):
    first, _ = run(engine, prompt, session="S")
    cache = engine.prefix_cache
    assert cache.pins.is_pinned("S") and cache.tree.protected_pages > 0
    assert cache.make_room(engine.allocator.num_pages - cache.tree.protected_pages)
    turn2 = prompt + first
    warm, cached = run(engine, turn2, session="S")
    assert cached >= len(prompt)
    engine.release_session("S")
    freed = cache.tree.evict(engine.allocator.num_pages).device  # everything, as a full pool would
    engine.allocator.free(freed)
    assert cache.tree.cached_pages == 0
    assert run(engine, turn2, session="S") == (warm, 0)  # re-prefills, same tokens
