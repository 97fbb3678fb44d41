"""Synthetic models for benchmarks: real Llama-3 and Qwen3 shapes, random weights made on the
device.

`model="synthetic:llama3-8b"` (or `llama3-70b`, `llama3-1b`, `qwen3-8b`, or `tiny` /
`qwen3-tiny` / `tiny-mqa` for tests) needs no download: the preset becomes an HF-style folder
in the cache (config.json, the SmolLM2 tokenizer shipped in `engine/assets`, and
`synthetic.json` in place of weights), and
`engine.runner.loader.load_model` fills the weights where the model lives. The vocabulary is the
SmolLM2 tokenizer's (49152 tokens), not Llama 3's 128256 or Qwen3's 151936, so the embedding
table and lm_head are smaller than the real model's; every other tensor has the real shape.

Weights come from a counter-based hash of each element's index, not from torch's generators,
so the same preset gives bit-identical weights on the CPU and on a GPU (integer arithmetic is
exact everywhere): a GPU run can be checked token for token against the CPU path.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import tempfile
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.config import ModelConfig, ModelLoadError, publish_dir
from engine.parallel.partition import Partition, cut_fused
from engine.runner.models.llama import LlamaForCausalLM
from engine.sampling.counter_rng import hash32

if TYPE_CHECKING:
    from engine.parallel.collectives import TPGroup

PREFIX = "synthetic:"
MARKER = "synthetic.json"  # in a synthetic folder, stands where the weights would be
VOCAB_SIZE = 49152  # the SmolLM2 tokenizer's
BOS, EOS = 1, 2  # <|im_start|>, <|im_end|>

_LLAMA3_ROPE = {"rope_type": "default", "rope_theta": 500000.0}
_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", rms_norm_eps=1e-6,
              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
PRESETS: dict[str, dict[str, Any]] = {
    # Meta-Llama-3-8B
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      max_position_embeddings=8192, rope_parameters=_LLAMA3_ROPE,
                      tie_word_embeddings=False),
    # Meta-Llama-3-70B: tensor-parallel benchmarks (140 GB in bf16: 2 or more GPUs)
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=8192, rope_parameters=_LLAMA3_ROPE,
                       tie_word_embeddings=False),
    # Llama-3.2-1B
    "llama3-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                      max_position_embeddings=131072, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                       "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192}),
    # Qwen3-8B: per-head q/k RMSNorm, 36 layers
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=40960, tie_word_embeddings=False),
    # A few MB: CPU tests
    "qwen3-tiny": dict(_QWEN3, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                       max_position_embeddings=4096, tie_word_embeddings=False),
    # One KV head: tensor-parallel tests replicate it over the ranks
    "tiny-mqa": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                     max_position_embeddings=4096, rope_parameters=_LLAMA3_ROPE,
                     tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 max_position_embeddings=4096, rope_parameters=_LLAMA3_ROPE,
                 tie_word_embeddings=False),
}


def is_synthetic(model: str | None) -> bool:
    return model is not None and model.startswith(PREFIX)


def hf_config(preset: str) -> dict[str, Any]:
    """The preset as an HF `config.json` (transformers can build the same model from it)."""
    shape = PRESETS.get(preset)
    if shape is None:
        raise ModelLoadError(
            f"unknown synthetic preset {preset!r}; presets: {', '.join(PRESETS)}"
        )
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": VOCAB_SIZE, "bos_token_id": BOS, "eos_token_id": EOS,
            "pad_token_id": EOS, "rms_norm_eps": 1e-5, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, **shape}  # a preset may override any


def synthetic_dir(model: str, cache_dir: Path, seed: int = 0) -> Path:
    """Write the folder for `model` ("synthetic:<preset>") into the cache once; return it."""
    preset = model.removeprefix(PREFIX)
    config = json.dumps(hf_config(preset), indent=2, sort_keys=True)
    key = hashlib.sha256(f"{config}:{seed}".encode()).hexdigest()[:12]
    out = cache_dir / "models" / f"synthetic-{preset}-{key}"
    if (out / MARKER).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".synthetic-", dir=out.parent))
    try:
        (tmp / "config.json").write_text(config)
        assets = files("engine") / "assets" / "smollm2_tokenizer"
        for f in assets.iterdir():
            if f.name == "tokenizer.json.gz":
                (tmp / "tokenizer.json").write_bytes(gzip.decompress(f.read_bytes()))
            else:
                (tmp / f.name).write_bytes(f.read_bytes())
        (tmp / MARKER).write_text(json.dumps({"preset": preset, "seed": seed}))
        publish_dir(tmp, out, MARKER)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def synthetic_model(folder: Path, dtype: torch.dtype, device: str | torch.device,
                    part: Partition | None = None, tp: TPGroup | None = None) -> LlamaForCausalLM:
    """The model of a synthetic folder, its weights made directly on `device` in `dtype`
    (with `tp`: each whole tensor in turn, then cut to this rank's `part`).

    Matrices are uniform with unit gain (bound sqrt(3 / fan_in)); norm weights are ones.
    """
    cfg = ModelConfig.from_dir(folder)
    seed = json.loads((folder / MARKER).read_text())["seed"]
    with torch.device("meta"):
        whole = LlamaForCausalLM(cfg)  # names and shapes; a parameter's salt is its index
        model = LlamaForCausalLM(cfg, part, tp).to(dtype)
    model = model.to_empty(device=device)
    if cfg.tie_embeddings:  # to_empty gave lm_head a tensor of its own
        model.lm_head.weight = model.embed_tokens.weight
    mine = dict(model.named_parameters())
    with torch.no_grad():
        for i, (name, w) in enumerate(sorted(whole.named_parameters())):
            p = mine[name]
            if p.dim() == 1:
                p.fill_(1.0)
            elif part is None:
                fill_uniform_(p, (3.0 / p.shape[1]) ** 0.5, salt=seed * 1_000_003 + i)
            else:
                t = torch.empty(w.shape, dtype=dtype, device=device)
                fill_uniform_(t, (3.0 / w.shape[1]) ** 0.5, salt=seed * 1_000_003 + i)
                p.copy_(cut_fused(name, t, part, cfg))
    model.init_rope()
    return model.eval()


_CHUNK = 1 << 24  # elements per pass: bounds the int64 temporaries to ~130 MB


def fill_uniform_(t: torch.Tensor, bound: float, salt: int) -> None:
    """t[i] = bound * (2 u_i - 1), u_i in (0, 1) from a hash of (salt, i), identical on
    every device."""
    flat = t.view(-1)
    salt = hash32(torch.tensor(salt & 0x7FFFFFFF, dtype=torch.int64)).item()
    for start in range(0, flat.numel(), _CHUNK):
        end = min(start + _CHUNK, flat.numel())
        idx = torch.arange(start, end, dtype=torch.int64, device=t.device)
        bits = hash32(hash32(idx) ^ salt) >> 8  # 24 uniform bits, exact in fp32
        u = (bits.to(torch.float32) + 0.5) * 2.0**-24
        flat[start:end] = ((u * 2.0 - 1.0) * bound).to(t.dtype)
