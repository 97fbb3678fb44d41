"""Our Llama-family forward (Qwen3's q/k norm included) equals transformers' (fp32, max abs
error <= 1e-4): prefill, chunked prefill and step-by-step decode through the paged KV cache."""

from __future__ import annotations

import pytest
import torch

from engine.core.request import Request
from engine.core.scheduler import ScheduledSeq
from engine.runner.loader import load_model
from engine.runner.model_runner import ModelRunner
from engine.runner.step_inputs import StepInputs
from engine.sampling.params import SamplingParams
from tests.tiny_models import save_tiny

TOL = 1e-4


def _logits(runner: ModelRunner, seqs: list[ScheduledSeq]) -> torch.Tensor:
    """All-position logits of one step (the runner itself only computes the sampled rows)."""
    ordered = sorted(seqs, key=lambda s: s.num_new_tokens != 1)
    assert ordered == seqs, "test steps are given decodes first"
    ids, pos, meta, _ = runner._prepare(StepInputs.build(seqs, runner.page_size))
    with torch.inference_mode():
        return runner.model.compute_logits(runner.model(ids, pos, runner.kv_caches, meta))


@pytest.fixture(scope="module", params=["llama", "llama3", "qwen2", "qwen3", "mistral"])
def pair(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = save_tiny(tmp_path_factory.mktemp(request.param), request.param)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_model(path, torch.float32, "cpu")
    return hf, ours


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_prefill_and_decode_match(pair):
    hf, model = pair
    torch.manual_seed(1)
    ids = torch.randint(0, model.cfg.vocab_size, (40,)).tolist()
    ref = _hf_logits(hf, ids)

    runner = ModelRunner(model, num_pages=16, page_size=4)
    req = Request("r", ids, SamplingParams())
    req.pages = [5, 2, 9, 0, 7, 11, 3, 1, 4, 6, 8]  # scattered on purpose
    prompt_len = 30
    got = _logits(runner, [ScheduledSeq(req, 0, prompt_len)])
    assert (got - ref[:prompt_len]).abs().max() <= TOL

    for k in range(prompt_len, len(ids)):  # decode one token at a time from the cache
        got = _logits(runner, [ScheduledSeq(req, k, 1)])
        assert (got[0] - ref[k]).abs().max() <= TOL, f"decode position {k}"


def test_chunked_prefill_and_mixed_batch_match(pair):
    hf, model = pair
    torch.manual_seed(2)
    a = torch.randint(0, model.cfg.vocab_size, (37,)).tolist()
    b = torch.randint(0, model.cfg.vocab_size, (21,)).tolist()
    ref_a, ref_b = _hf_logits(hf, a), _hf_logits(hf, b)

    runner = ModelRunner(model, num_pages=32, page_size=4)
    ra, rb = Request("a", a, SamplingParams()), Request("b", b, SamplingParams())
    ra.pages, rb.pages = list(range(0, 10)), list(range(31, 20, -1))
    # b's prefill first (chunk 1); then a's chunks interleave with b's decodes in one step.
    got = _logits(runner, [ScheduledSeq(rb, 0, 20)])
    assert (got - ref_b[:20]).abs().max() <= TOL
    got = _logits(runner, [ScheduledSeq(rb, 20, 1), ScheduledSeq(ra, 0, 16)])
    assert (got[0] - ref_b[20]).abs().max() <= TOL
    assert (got[1:] - ref_a[:16]).abs().max() <= TOL
    got = _logits(runner, [ScheduledSeq(ra, 16, 21)])
    assert (got - ref_a[16:]).abs().max() <= TOL


def test_sharded_checkpoint_loads(tmp_path):
    path = save_tiny(tmp_path, "llama")
    assert (path / "model.safetensors.index.json").is_file()
    model = load_model(path, torch.float32, "cpu")
    assert model.cfg.num_layers == 3
