"""Upload-ready PEFT LoRA files for SmolLM2-135M, made in memory (no peft, no disk), and raw
safetensors framing for broken ones."""

from __future__ import annotations

import json
import struct

import numpy as np
from safetensors.numpy import save

LAYERS, HIDDEN, KV = 30, 576, 192  # SmolLM2-135M
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
Files = list[tuple[str, bytes]]


def tensors(r: int = 4, hidden: int = HIDDEN, poison: float | None = None, seed: int = 0):
    """q_proj/v_proj LoRA weights with non-zero B; `poison` goes into one element of Q_A."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(LAYERS):
        for proj, width in (("q_proj", hidden), ("v_proj", KV * hidden // HIDDEN)):
            key = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            out[f"{key}.lora_A.weight"] = rng.standard_normal((r, hidden), dtype=np.float32)
            out[f"{key}.lora_B.weight"] = rng.standard_normal((width, r), dtype=np.float32)
    if poison is not None:
        out[Q_A][0, 0] = poison
    return out


def config(**fields) -> bytes:
    return json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                       "target_modules": ["q_proj", "v_proj"], **fields}).encode()


def adapter(weights: bytes | None = None, **fields) -> Files:
    """The two files of an adapter: `weights` (default: a sound r=4 one) and the config."""
    return [(CONFIG, config(**fields)), (WEIGHTS, save(tensors()) if weights is None else weights)]


def safetensors(header: object, data: bytes = b"", claimed_len: int | None = None) -> bytes:
    """A safetensors file from a header (JSON-able or raw bytes) and data; `claimed_len`
    overrides the length prefix."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if claimed_len is None else claimed_len) + raw + data
