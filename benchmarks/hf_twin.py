"""transformers' model (Llama, Qwen3, ...) over the very tensors of an engine's model (no
copies), so a baseline runs the same weights on the same GPU."""

from __future__ import annotations

import torch

from engine import LLM


def transformers_twin(llm: LLM) -> torch.nn.Module:
    """The HF model for `llm`'s model folder (a synthetic one too), its parameters views of
    the engine's fused ones (q/k/v and gate/up are row slices)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = llm.engine.model
    cfg = model.cfg
    embed = model.embed_tokens.weight
    config = AutoConfig.from_pretrained(llm.engine.model_dir)
    with torch.device(embed.device):
        hf = AutoModelForCausalLM.from_config(config, dtype=embed.dtype)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    state = {"model.embed_tokens.weight": embed, "model.norm.weight": model.norm.weight,
             "lm_head.weight": model.lm_head.weight}
    for i, layer in enumerate(model.layers):
        p, attn, mlp = f"model.layers.{i}.", layer.self_attn, layer.mlp
        parts = _weight(attn.qkv_proj).split([q, kv, kv])
        for name, t in zip("qkv", parts, strict=True):
            state[f"{p}self_attn.{name}_proj.weight"] = t
        state[f"{p}self_attn.o_proj.weight"] = _weight(attn.o_proj)
        if attn.qk_norm is not None:  # Qwen3
            state[f"{p}self_attn.q_norm.weight"] = attn.qk_norm.q_norm.weight
            state[f"{p}self_attn.k_norm.weight"] = attn.qk_norm.k_norm.weight
        gate, up = _weight(mlp.gate_up_proj).split(cfg.intermediate_size)
        state[f"{p}mlp.gate_proj.weight"], state[f"{p}mlp.up_proj.weight"] = gate, up
        state[f"{p}mlp.down_proj.weight"] = _weight(mlp.down_proj)
        state[f"{p}input_layernorm.weight"] = layer.input_layernorm.weight
        state[f"{p}post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
    hf.load_state_dict({k: t.detach() for k, t in state.items()}, strict=True, assign=True)
    return hf.eval()


def _weight(proj: torch.nn.Module) -> torch.Tensor:
    """A projection's weight, through the LoRA wrapper if there is one."""
    return getattr(proj, "base", proj).weight
