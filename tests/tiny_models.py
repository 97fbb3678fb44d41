"""Small random Llama-family checkpoints written with transformers' save_pretrained, and PEFT
LoRA adapters for a given base."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch


def save_tiny(path: Path, kind: str = "llama", **overrides) -> Path:
    """Write a random checkpoint of `kind` ("llama", "llama3", "qwen2", "qwen3", "mistral") to
    `path`. Qwen3's heads are wider than hidden / heads (as Qwen3-0.6B's): q_size != hidden."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
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
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**{"head_dim": 32, **common}))
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


def save_word_tokenizer(path: Path, vocab: int = 320) -> None:
    """A word-level tokenizer over a tiny vocabulary ("t0".."t319"), made offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1").save_pretrained(path)


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


# -- a reasoning model's tokenizer ------------------------------------------------------------

THINK_IDS = {"<think>": 14, "</think>": 15}  # SmolLM2's <jupyter_output>, <jupyter_script>

# ChatML with reasoning and Hermes tool calls, shaped as Qwen3's template: tools listed in the
# system turn, calls as <tool_call> blocks, results as <tool_response> user turns, an
# assistant's reasoning_content in <think>, and `enable_thinking=False` closing an empty
# <think></think> in the generation prompt. (transformers renders templates with trim_blocks:
# a newline right after a block tag is written as {{ '\n' }}.)
REASONING_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

Call functions by writing, for each call:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>
The functions:
<tools>{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor
%}{{ '\n' }}</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{% if m.reasoning_content %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content or '' }}
{%- for call in m.tool_calls or [] %}{% if not loop.first or m.content
%}{{ '\n' }}{% endif %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool'
%}<|im_start|>user{% endif %}{{ '\n' }}<tool_response>
{{ m.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""


# Mistral's v11+ tool calling: tools in [AVAILABLE_TOOLS], each call as
# [TOOL_CALLS]name[ARGS]{...} (both markers special tokens), results in [TOOL_RESULTS].
MISTRAL_IDS = {"[TOOL_CALLS]": 12, "[ARGS]": 13}  # SmolLM2's <jupyter_text>, <jupyter_code>
MISTRAL_TEMPLATE = """\
{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}[SYSTEM_PROMPT]{{ m.content }}[/SYSTEM_PROMPT]
{%- elif m.role == 'user' %}[INST]{{ m.content }}[/INST]
{%- elif m.role == 'assistant' %}{{ m.content or '' }}
{%- for call in m.tool_calls or [] %}[TOOL_CALLS]{{ call.function.name }}[ARGS]
{{- call.function.arguments if call.function.arguments is string
    else call.function.arguments | tojson }}{% endfor %}{{ eos_token }}
{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]
{%- endif %}
{%- endfor %}"""


def save_tokenizer(path: Path, markers: dict[str, int], template: str) -> Path:
    """The SmolLM2 tokenizer (engine/assets) with unused special tokens renamed after
    `markers` (text -> id) and `template` as its chat template, written into `path`."""
    import gzip
    import json
    from importlib.resources import files

    assets = files("engine") / "assets" / "smollm2_tokenizer"
    tok = json.loads(gzip.decompress((assets / "tokenizer.json.gz").read_bytes()))
    vocab = tok["model"]["vocab"]
    for marker, token_id in markers.items():
        entry = next(t for t in tok["added_tokens"] if t["id"] == token_id)
        del vocab[entry["content"]]
        entry["content"] = marker
        vocab[marker] = token_id
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    config = json.loads((assets / "tokenizer_config.json").read_text())
    decoder = config.get("added_tokens_decoder", {})
    for marker, token_id in markers.items():
        if str(token_id) in decoder:
            decoder[str(token_id)]["content"] = marker
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").write_text(template)
    return path


def smollm2_with_tokenizer(path: Path, weights: Path, save: Callable[[Path], Path]) -> Path:
    """A model folder at `path`: the SmolLM2 weights and config of `weights` (linked) and the
    tokenizer `save(path)` writes."""
    path.mkdir(parents=True, exist_ok=True)
    for f in weights.iterdir():
        if f.suffix in (".json", ".safetensors") and not f.name.startswith("tokenizer"):
            (path / f.name).symlink_to(f)
    return save(path)


def save_reasoning_tokenizer(path: Path) -> Path:
    """The SmolLM2 tokenizer with `<think>` and `</think>` and `REASONING_TEMPLATE`."""
    return save_tokenizer(path, THINK_IDS, REASONING_TEMPLATE)


def save_mistral_tokenizer(path: Path) -> Path:
    """The SmolLM2 tokenizer with `[TOOL_CALLS]` and `[ARGS]` and `MISTRAL_TEMPLATE`."""
    return save_tokenizer(path, MISTRAL_IDS, MISTRAL_TEMPLATE)


def save_tiny_reasoner(path: Path) -> Path:
    """A tiny random Qwen3 over the reasoning tokenizer: `<|im_end|>` ends its output."""
    save_tiny(path, "qwen3", vocab_size=49152, tie_word_embeddings=True, bos_token_id=1,
              eos_token_id=2, max_position_embeddings=2048)
    return save_reasoning_tokenizer(path)


def random_peft_adapter(hf, path: Path, seed: int, **lora_config) -> None:
    """Save a peft LoRA of `hf` (a transformers model, left unchanged) to `path`, with random
    non-zero B (std 0.02: small enough that a real model's text stays sensible)."""
    import copy

    import peft

    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(**lora_config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    model.save_pretrained(path)
