"""LoRA on every projection of a Qwen3 (q/k norms, heads wider than hidden / heads) through
the engine equals peft's `PeftModel`: each generated token's logprob and top-5 (fp32,
<= 1e-4), greedy, for two adapters and the base in one batch."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from tests.tiny_models import save_tiny

peft = pytest.importorskip("peft")

TOL = 1e-4
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, smollm2_dir):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("qwen3-lora")
    base = save_tiny(root / "base", "qwen3")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / f, base / f)
    for i, (name, r) in enumerate((("all8", 8), ("all4", 4))):
        torch.manual_seed(20 + i)
        hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        cfg = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=ALL, init_lora_weights=False)
        peft.get_peft_model(hf, cfg).save_pretrained(root / name)
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    ref = peft.PeftModel.from_pretrained(hf, root / "all8", adapter_name="all8").eval()
    ref.load_adapter(root / "all4", adapter_name="all4")
    return base, root, ref


def test_lora_on_all_projections_equals_peft(qwen3):
    base, root, ref = qwen3
    llm = LLM(model=str(base), max_loras=2, max_lora_rank=8, num_pages=64, page_size=4)
    for name in ("all8", "all4"):
        llm.load_adapter(name, root / name)
    torch.manual_seed(0)
    prompts = [torch.randint(0, 320, (n,)).tolist() for n in (9, 23, 14)]
    adapters = ["all8", None, "all4"]
    params = [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=5,
                             adapter=a) for a in adapters]
    worst = 0.0
    for out, adapter in zip(llm.generate(prompts, params), adapters, strict=True):
        ids = out.prompt_token_ids + out.token_ids
        with torch.no_grad():
            if adapter is None:
                with ref.disable_adapter():
                    logits = ref(torch.tensor([ids])).logits[0]
            else:
                ref.set_adapter(adapter)
                logits = ref(torch.tensor([ids])).logits[0]
        expected = torch.log_softmax(logits.float(), -1)
        assert out.logprobs is not None and len(out.logprobs) == 4
        for k, lp in enumerate(out.logprobs):
            row = expected[len(out.prompt_token_ids) - 1 + k]
            assert lp.token_id == int(row.argmax())
            for token, value in [(lp.token_id, lp.logprob), *lp.top]:
                err = abs(value - row[token].item())
                worst = max(worst, err)
                assert err <= TOL, f"{adapter} token {k}: {err}"
    assert worst > 0  # the check really compared numbers
