"""The sampler on CUDA: the same noise bits and tokens as on the CPU, and no host sync before
`collect` (the step's one sync)."""

from __future__ import annotations

import pytest
import torch

from engine.core.request import Request
from engine.sampling.counter_rng import hash32, open_uniform
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import Sampler

pytestmark = pytest.mark.gpu
EOS = 2

ROWS = [
    dict(temperature=0.0),
    dict(temperature=0.8, seed=1),
    dict(temperature=0.8, top_p=0.9, seed=2),
    dict(temperature=0.8, top_p=0.9, top_k=50, seed=3),
    dict(temperature=1.2, min_p=0.05, seed=4, logprobs=5),
    dict(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.4, repetition_penalty=1.2,
         logit_bias={7: 3.0, 100: -4.0}, seed=5),
    dict(temperature=0.9, min_tokens=40, max_tokens=64, stop_token_ids=[11], seed=6),
    dict(temperature=0.0, logprobs=3, min_tokens=40, max_tokens=64),
]


def _requests(rows: list[dict]) -> list[Request]:
    reqs = []
    for i, kw in enumerate(rows):
        r = Request(f"r{i}", [5, 6, 7, 5, 300 + i], SamplingParams(**kw))
        r.token_ids.extend([9, 9, 12])
        reqs.append(r)
    return reqs


def _decode(device: str, rows: list[dict], vocab: int, steps: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    sampler = Sampler(seed=0, eos_token_ids=[EOS])
    reqs = _requests(rows)
    for _ in range(steps):
        logits = (torch.randn(len(reqs), vocab, generator=gen) * 3).to(device)
        for r, s in zip(reqs, sampler(logits, reqs), strict=True):
            r.token_ids.append(s.token_id)
    return [r.output_token_ids for r in reqs]


def test_noise_bits_equal_on_cpu_and_cuda():
    ids = torch.arange(0, 1 << 20, 7)
    keys = torch.randint(0, 1 << 32, (4,))
    on_cpu = open_uniform(hash32(hash32(ids) ^ keys.unsqueeze(1)))
    on_gpu = open_uniform(hash32(hash32(ids.cuda()) ^ keys.cuda().unsqueeze(1)))
    assert torch.equal(on_cpu, on_gpu.cpu())


@pytest.mark.parametrize("vocab", [49152, 128256])
def test_same_tokens_on_cpu_and_cuda(vocab):
    assert _decode("cpu", ROWS, vocab, 6) == _decode("cuda", ROWS, vocab, 6)


def test_launch_does_not_sync():
    sampler = Sampler(seed=0, eos_token_ids=[EOS])
    reqs = _requests(ROWS)
    logits = torch.randn(len(reqs), 49152, device="cuda")
    ok = torch.ones(len(reqs), dtype=torch.bool, device="cuda")
    sampler(logits.clone(), reqs, ok)  # warm: pinned buffers, cached id hashes
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        drawn = sampler.launch(logits.clone(), reqs, ok)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(s.token_id >= 0 for s in sampler.collect(drawn))
