"""Small random Llama-family checkpoints written with transformers' save_pretrained, and PEFT
LoRA adapters for a given base."""

from __future__ import annotations

from pathlib import Path

import torch


def save_tiny(path: Path, kind: str = "llama", **overrides) -> Path:
    """Write a random checkpoint of `kind` ("llama", "llama3", "qwen2", "mistral") to `path`."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(0)
    common = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "llama3":
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        }
        model = LlamaForCausalLM(LlamaConfig(**common, rope_parameters=rope))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=None))
    else:
        raise ValueError(kind)
    # Random init leaves small weights; scale up so logits are not all near zero.
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.1)
    model.save_pretrained(path, max_shard_size="300KB")
    return path


def save_peft_adapter(base_dir: Path, out: Path, seed: int, fill: float | None = None) -> Path:
    """A real PEFT LoRA (r=4 on q_proj and v_proj of layers 0-1) for the model at `base_dir`;
    `fill` sets every LoRA weight to that value (1e30: finite, but the forward overflows)."""
    import peft
    from transformers import AutoConfig, LlamaForCausalLM

    cfg = AutoConfig.from_pretrained(base_dir)
    cfg.num_hidden_layers = 2  # the adapter only targets layers 0-1: quick to make
    cfg.vocab_size = 64  # and holds no embedding
    torch.manual_seed(seed)
    model = peft.get_peft_model(
        LlamaForCausalLM(cfg),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                        init_lora_weights=False),
    )
    if fill is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.fill_(fill)
    model.save_pretrained(out, save_embedding_layers=False)
    return out
