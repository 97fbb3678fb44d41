"""One config object for the engine, built once and validated there."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ModelLoadError(RuntimeError):
    """The model path is unknown, unsupported, corrupt or truncated."""


@dataclass(frozen=True)
class ModelConfig:
    """The Llama-family shape, read from an HF `config.json`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_embeddings: bool = False
    qkv_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"

    SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in cls.SUPPORTED:
            raise ModelLoadError(f"unsupported architecture {arch!r}; supported: {cls.SUPPORTED}")
        try:
            heads = cfg["num_attention_heads"]
            hidden = cfg["hidden_size"]
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
            return cls(
                vocab_size=cfg["vocab_size"],
                hidden_size=hidden,
                intermediate_size=cfg["intermediate_size"],
                num_layers=cfg["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or hidden // heads,
                max_position=cfg.get("max_position_embeddings", 2048),
                rms_eps=cfg.get("rms_norm_eps", 1e-6),
                rope_theta=_rope_theta(cfg),
                rope_scaling=cfg.get("rope_scaling") or cfg.get("rope_parameters"),
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
                eos_token_ids=eos_ids,
                architecture=arch,
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json is missing {e.args[0]!r}") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        f = Path(path) / "config.json"
        try:
            return cls.from_hf(json.loads(f.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"cannot read {f}: {e}") from None


def _rope_theta(cfg: dict[str, Any]) -> float:
    if "rope_theta" in cfg:
        return float(cfg["rope_theta"])
    params = cfg.get("rope_parameters") or {}
    return float(params.get("rope_theta", 10000.0))


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "switchboard"


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, fixed at start-up.

    `num_pages=None` sizes the KV pool to hold `max_num_seqs` full contexts of `max_model_len`
    (capped by `kv_cache_gb`).
    """

    model: str | None = None  # None: the embedded SmolLM2; else an HF folder or a .gguf file
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    page_size: int = 16
    num_pages: int | None = None
    kv_cache_gb: float = 2.0
    max_model_len: int | None = None
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    cuda_graphs: bool = True  # on CUDA, replay captured graphs for decode-only steps
    # Queue each decode step's forward before postprocessing the previous one (None: on CUDA,
    # where the host's work then hides behind the device's; on a CPU nothing runs meanwhile).
    overlap_schedule: bool | None = None
    threads: int | None = None  # torch CPU threads; None leaves torch's default
    # Multi-LoRA: adapters resident in device slots (0: base model only), in host memory, the
    # slot width (every adapter's rank must fit), and the upload store (None: no uploads).
    max_loras: int = 4
    max_cpu_loras: int = 16
    max_lora_rank: int = 16
    adapter_dir: Path | None = None
    cache_dir: Path = field(default_factory=default_cache_dir)
    prefix_cache: bool = True  # keep finished KV in the radix tree and reuse shared prefixes
    session_kv_pages: int | None = None  # per-tenant pinned-session budget; None: a quarter

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError("num_pages must be >= 1")
        if self.threads is not None and self.threads < 1:
            raise ValueError("threads must be >= 1")
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError("max_loras must be >= 0 and max_lora_rank >= 1")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError("max_cpu_loras must be >= max_loras")
        if self.session_kv_pages is not None and self.session_kv_pages < 0:
            raise ValueError("session_kv_pages must be >= 0")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
