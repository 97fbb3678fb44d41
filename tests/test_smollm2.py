"""The engine on the real embedded SmolLM2: equal to transformers' greedy generate, and a
request's greedy tokens do not depend on what else is in the batch."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]


def test_greedy_equals_transformers(smollm2, hf_smollm2):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = smollm2.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = smollm2.tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = hf_smollm2.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=24,
                do_sample=False,
                min_new_tokens=24,
            )
        assert out.token_ids == ref[0, ids.shape[1] :].tolist(), prompt
        assert out.finish_reason == "length"
        assert out.text == smollm2.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def _mixed_prompts(tokenizer, n: int) -> list[list[int]]:
    words = "agents call tools and read results before they answer the user again".split()
    prompts = []
    for i in range(n):
        text = " ".join(words[(i * 3 + j) % len(words)] for j in range(3 + (i * 7) % 40))
        prompts.append(tokenizer.encode(f"Note {i}: {text}"))
    return prompts


@pytest.fixture(scope="module")
def mixed(smollm2):
    prompts = _mixed_prompts(smollm2.tokenizer, 16)
    params = [
        SamplingParams(max_tokens=6 + (i % 4) * 3, temperature=0, ignore_eos=True)
        for i in range(16)
    ]
    alone = [
        smollm2.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params, strict=True)
    ]
    return prompts, params, alone


def test_batch_of_16_equals_alone(smollm2, mixed):
    prompts, params, alone = mixed
    batched = [o.token_ids for o in smollm2.generate(prompts, params)]
    assert batched == alone
    smollm2.engine.reset_prefix_cache()  # the cache holds the finished KV; nothing else may
    assert smollm2.engine.allocator.num_used == 0


def test_chunked_prefill_and_preemption_equal_alone(smollm2_dir, mixed):
    prompts, params, alone = mixed
    # 8-token step budget chunks every prefill; 14 pages of 8 slots cannot hold all 16
    # requests, so the scheduler must preempt and recompute.
    small = LLM(model=str(smollm2_dir), max_num_batched_tokens=8, num_pages=14, page_size=8)
    outs = small.generate(prompts, params)
    assert [o.token_ids for o in outs] == alone
    assert small.engine.scheduler.num_preemptions > 0
    small.engine.reset_prefix_cache()
    assert small.engine.allocator.num_used == 0


def test_pages_all_free_after_abort(smollm2):
    eng = smollm2.engine
    for i in range(4):
        eng.add_request(
            f"abort-{i}", [1, 2, 3, 4, 5] * (i + 1), SamplingParams(max_tokens=50, ignore_eos=True)
        )
    eng.step()
    eng.step()
    assert eng.allocator.num_used > 0
    for i in range(0, 4, 2):
        out = eng.abort_request(f"abort-{i}")
        assert out is not None and out.finished and out.finish_reason == "abort"
    while eng.has_unfinished_requests():
        eng.step()
    eng.reset_prefix_cache()
    assert eng.allocator.num_used == 0
    assert eng.allocator.num_free == eng.allocator.num_pages


def test_stop_strings_and_seeded_sampling(smollm2):
    greedy = smollm2.generate(
        "The capital of France is", SamplingParams(max_tokens=20, temperature=0)
    )
    text = greedy[0].text
    stop = text[3:9]  # a stop string that spans token boundaries
    out = smollm2.generate(
        "The capital of France is", SamplingParams(max_tokens=20, temperature=0, stop=[stop])
    )[0]
    assert out.finish_reason == "stop" and out.text == text[: text.index(stop)]

    p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
    a = smollm2.generate(["Tell me a story"] * 3, p)
    assert a[0].token_ids == a[1].token_ids == a[2].token_ids
    b = smollm2.generate(["Tell me a story", "Other"], [p, SamplingParams(max_tokens=3)])
    assert b[0].token_ids == a[0].token_ids


def test_stop_strings_wait_for_min_tokens(smollm2):
    """As vLLM: a stop string is looked for only in the text of tokens past `min_tokens`
    (one that ends there, begun before, counts)."""
    prompt, n = "The capital of France is", 12
    greedy = smollm2.generate(prompt, SamplingParams(max_tokens=20, temperature=0,
                                                     ignore_eos=True))[0]
    text, stop = greedy.text, greedy.text[3:9]
    boundary = len(smollm2.tokenizer.decode(greedy.token_ids[:n], skip_special_tokens=True))
    assert text.index(stop) + len(stop) <= boundary  # its first occurrence is in the min_tokens
    out = smollm2.generate(prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                  stop=[stop], min_tokens=n))[0]
    later = [i for i in range(len(text)) if text.startswith(stop, i) and i + len(stop) > boundary]
    if later:
        assert out.finish_reason == "stop" and out.text == text[: later[0]]
    else:
        assert out.finish_reason == "length" and out.token_ids == greedy.token_ids
    assert out.token_ids[:n] == greedy.token_ids[:n]


def test_chat_and_logprobs(smollm2):
    out = smollm2.chat(
        [{"role": "user", "content": "What is 2+2?"}],
        SamplingParams(max_tokens=16, temperature=0, logprobs=3),
    )[0]
    assert out.text and out.finish_reason in ("stop", "length")
    assert len(out.logprobs) == len(out.token_ids)
    for lp, tok in zip(out.logprobs, out.token_ids, strict=True):
        assert lp.token_id == tok and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][0] == tok  # greedy picks the top token
