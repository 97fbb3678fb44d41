"""The synthetic benchmark presets: real Llama-3 shapes, the SmolLM2 tokenizer, weights that
are the same on every device, and a transformers twin that generates the same tokens."""

from __future__ import annotations

import sys

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import ModelConfig, ModelLoadError
from engine.runner.loader import resolve_model_dir
from engine.runner.models.llama import LlamaForCausalLM, rope_inv_freq
from engine.runner.synthetic import VOCAB_SIZE, fill_uniform_, hf_config, synthetic_model
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from hf_twin import transformers_twin  # noqa: E402


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return resolve_model_dir("synthetic:tiny", tmp_path_factory.mktemp("cache"))


@pytest.mark.parametrize(("preset", "non_embedding"), [
    ("llama3-8b", 8_030_261_248 - 2 * 128_256 * 4096),  # Meta-Llama-3-8B, untied
    ("llama3-1b", 1_235_814_400 - 128_256 * 2048),  # Llama-3.2-1B, tied
    ("qwen3-8b", 8_190_735_360 - 2 * 151_936 * 4096),  # Qwen3-8B, untied
])
def test_presets_have_the_real_shapes(preset, non_embedding):
    cfg = ModelConfig.from_hf(hf_config(preset))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    embed = model.embed_tokens.weight.numel() * (1 if cfg.tie_embeddings else 2)
    assert sum(p.numel() for p in model.parameters()) - embed == non_embedding
    assert cfg.vocab_size == VOCAB_SIZE and cfg.eos_token_ids == (2,)


def test_llama3_1b_rope_scaling_equals_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = hf_config("llama3-1b")
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(**cfg), "cpu")
    torch.testing.assert_close(rope_inv_freq(ModelConfig.from_hf(cfg)), ref)


def test_folder_holds_the_smollm2_tokenizer(tiny_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert len(tok) == VOCAB_SIZE and tok.eos_token_id == 2
    assert tok.decode(tok.encode("Hello, world!")) == "Hello, world!"
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert resolve_model_dir("synthetic:tiny", tiny_dir.parents[1]) == tiny_dir  # cached
    with pytest.raises(ModelLoadError, match="llama3-8b"):
        resolve_model_dir("synthetic:llama9", tmp_path)


def test_weights_are_deterministic_and_unit_gain(tiny_dir):
    a = synthetic_model(tiny_dir, torch.float32, "cpu").state_dict()
    b = synthetic_model(tiny_dir, torch.float32, "cpu").state_dict()
    assert a.keys() == b.keys()
    for name, t in a.items():
        assert torch.equal(t, b[name]), name
        if t.dim() == 2:
            bound = (3.0 / t.shape[1]) ** 0.5
            assert t.abs().max() <= bound
            assert abs(t.std().item() * 3**0.5 / bound - 1) < 0.05, name  # uniform's std
            assert abs(t.mean().item()) < 0.02 * bound, name
        else:
            assert torch.equal(t, torch.ones_like(t)), name
    layers = [a[f"layers.{i}.mlp.down_proj.weight"] for i in range(2)]
    assert not torch.equal(*layers)  # every tensor draws its own numbers


def test_hash_fill_is_uniform_and_salted():
    x, y = torch.empty(1 << 16), torch.empty(1 << 16)
    fill_uniform_(x, 1.0, salt=1)
    fill_uniform_(y, 1.0, salt=2)
    hist = torch.histc(x, bins=16, min=-1, max=1)
    assert (hist - 4096).abs().max() < 300
    assert torch.corrcoef(torch.stack([x, y]))[0, 1].abs() < 0.02
    assert torch.corrcoef(torch.stack([x[1:], x[:-1]]))[0, 1].abs() < 0.02


@pytest.mark.parametrize("preset", ["tiny", "qwen3-tiny"])
def test_engine_greedy_equals_its_transformers_twin(tiny_dir, preset):
    llm = LLM(model=f"synthetic:{preset}", cache_dir=tiny_dir.parents[1], num_pages=64,
              max_num_seqs=4)
    hf = transformers_twin(llm)
    assert hf.model.layers[0].self_attn.k_proj.weight.data_ptr() != 0
    prompts = [[5, 900, 17, 4000, 33], list(range(100, 140))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for p, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([p])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                              min_new_tokens=8, do_sample=False, pad_token_id=2)
        assert out.token_ids == ref[0, len(p):].tolist()
    assert len({t for o in outs for t in o.token_ids}) > 2  # not a degenerate model


@pytest.mark.gpu
def test_weights_are_the_same_on_cuda(tiny_dir):
    cpu = synthetic_model(tiny_dir, torch.bfloat16, "cpu").state_dict()
    gpu = synthetic_model(tiny_dir, torch.bfloat16, "cuda").state_dict()
    for name, t in cpu.items():
        assert torch.equal(t, gpu[name].cpu()), name


@pytest.mark.gpu
def test_engine_runs_on_cuda_in_bf16():
    """The 1B preset end to end on the GPU: greedy, seeded sampling, a JSON schema."""
    llm = LLM(model="synthetic:llama3-1b", dtype="bfloat16", device="cuda", num_pages=256,
              max_num_seqs=8, max_loras=0)
    assert llm.engine.model.embed_tokens.weight.is_cuda
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=50, seed=7,
                             ignore_eos=True, presence_penalty=0.5, logit_bias={5: 1.0}),
              SamplingParams(max_tokens=40, temperature=0, response_format={
                  "type": "json_schema", "json_schema": {"name": "s", "schema": schema}})]
    outs = llm.generate(["Hello there", "Once upon a time", "JSON:"], params)
    assert [len(o.token_ids) for o in outs[:2]] == [12, 12]
    again = llm.generate(["Once upon a time"], params[1])[0]
    assert again.token_ids == outs[1].token_ids  # the seed decides, on the GPU too
    assert outs[2].finish_reason in ("stop", "length")
