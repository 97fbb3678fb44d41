"""The engine's settings, each declared once with its default, bounds and help text.

`EngineConfig` is what a user sets (offline as `LLM(**kwargs)`, or through `switchboard serve`,
whose flags and TOML keys are generated from these fields); `EngineConfig.resolve` settles the
defaults that depend on the loaded model and the device. Nothing here imports torch: the
gateway builds its config from this module.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticUndefined

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"  # what `model=None` loads

Dtype = Literal["float32", "bfloat16", "float16"]
DtypeSetting = Literal["auto", "float32", "bfloat16", "float16"]
ReasoningParser = Literal["auto", "none", "qwen3", "deepseek_r1"]  # engine/core/reasoning.py
DTYPE_BYTES: dict[Dtype, int] = {"float32": 4, "bfloat16": 2, "float16": 2}  # KV pool sizing


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
    qk_norm: bool = False  # Qwen3: per-head RMSNorm of q and k before RoPE
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"
    dtype: str | None = None  # the checkpoint's (`torch_dtype`), when config.json says
    quantization: str | None = None  # "fp8": the checkpoint's linear weights are FP8 E4M3
    fp8_block: tuple[int, int] | None = None  # their scales' block shape, if block-wise

    SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in cls.SUPPORTED:
            raise ModelLoadError(f"unsupported architecture {arch!r}; supported: {cls.SUPPORTED}")
        if cfg.get("use_sliding_window"):
            raise ModelLoadError("sliding-window attention (use_sliding_window) is not supported")
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
                qk_norm=arch == "Qwen3ForCausalLM",
                eos_token_ids=eos_ids,
                architecture=arch,
                dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
                quantization=_quantization(cfg.get("quantization_config")),
                fp8_block=_fp8_block(cfg.get("quantization_config")),
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


def _quantization(q: dict[str, Any] | None) -> str | None:
    """"fp8" for FP8 (E4M3) checkpoints: `quant_method` "fp8" (AutoFP8, transformers; scales
    per tensor, or per 128 x 128 block: `weight_block_size`), "fbgemm_fp8" (per channel), or
    "compressed-tensors" whose weights are 8-bit floats scaled per tensor or per channel
    (llm-compressor's FP8 recipes); None without a `quantization_config`. Other methods are
    refused by name."""
    if not q:
        return None
    method = q.get("quant_method")
    if method in ("fp8", "fbgemm_fp8"):
        block = q.get("weight_block_size")
        if block is not None and not (isinstance(block, list) and len(block) == 2
                                      and all(isinstance(b, int) and b > 0 for b in block)):
            raise ModelLoadError(f"weight_block_size must be two positive integers, got {block}")
        return "fp8"
    if method == "compressed-tensors":
        for group in (q.get("config_groups") or {}).values():
            w = group.get("weights") or {}
            if not (w.get("type") == "float" and w.get("num_bits") == 8
                    and w.get("strategy") in ("tensor", "channel")):
                raise ModelLoadError(f"unsupported compressed-tensors weights {w}: FP8 with "
                                     "per-tensor or per-channel scales is supported")
        return "fp8"
    raise ModelLoadError(f"unsupported quantization method {method!r}: fp8, fbgemm_fp8 and "
                         "compressed-tensors FP8 checkpoints are supported")


def _fp8_block(q: dict[str, Any] | None) -> tuple[int, int] | None:
    """A block-wise FP8 checkpoint's block shape (rows, columns of a weight per scale)."""
    block = (q or {}).get("weight_block_size")
    return (block[0], block[1]) if block else None


def _rope_theta(cfg: dict[str, Any]) -> float:
    if "rope_theta" in cfg:
        return float(cfg["rope_theta"])
    params = cfg.get("rope_parameters") or {}
    return float(params.get("rope_theta", 10000.0))


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "switchboard"


def host_available_bytes() -> int:
    """Host memory available to a new allocation now: Linux's MemAvailable (what can be had
    without swapping, reclaimable caches included), else the free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def publish_dir(tmp: Path, out: Path, done: str) -> None:
    """Move the finished folder `tmp` to `out` in one rename, so a half-written folder is never
    picked up. Processes that build the same cache entry at once (servers and test workers
    starting together) all succeed: whoever renames first publishes, and the others keep that
    folder (it holds the file `done`) and drop theirs."""
    try:
        tmp.rename(out)
    except OSError:  # ENOTEMPTY or EEXIST, as the platform reports an existing folder
        if not (out / done).is_file():
            raise


def setting(default: Any = PydanticUndefined, *, help: str, metavar: str | None = None,
            **field_args: Any) -> Any:
    """A config field: its default, bounds (`ge`, `gt`, `le`: pydantic `Field` arguments, as
    is `alias`) and help text, in one place.

    `switchboard serve` turns each such field into the flag `--<key>` and the TOML key `<key>`,
    where the key is the field's alias if it has one, else its name; `metavar` names the value
    in `--help`.
    """
    extra: dict[str, Any] | None = {"metavar": metavar} if metavar else None
    return Field(default, description=help, json_schema_extra=extra, **field_args)


class EngineConfig(BaseModel):
    """Everything the engine needs, fixed at start-up and validated when built.

    Settings left as None ("auto") are settled by `resolve` once the model is loaded.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    model: str | None = setting(
        None, metavar="PATH",
        help="HF checkpoint folder or .gguf file (default: embedded SmolLM2)")
    max_num_seqs: int | None = setting(
        None, ge=1, help="most sequences in the running batch (default: 64 on a CPU, 256 on a "
        "GPU)")
    max_num_batched_tokens: int | None = setting(
        None, ge=1, help="token budget per engine step (default: 512 on a CPU, 8192 on a GPU)")
    page_size: int = setting(16, ge=1, help="tokens per KV page")
    num_pages: int | None = setting(
        None, ge=1, alias="kv_pages", help="KV cache pages (default: sized from --kv-cache-gb)")
    kv_cache_gb: float | None = setting(
        None, gt=0, metavar="GB", help="KV cache budget when --kv-pages is not given, per rank "
        "under tensor parallelism (default: 2 on a CPU; on a GPU what --gpu-memory-utilization "
        "leaves after the weights, the activations and the adapter pool)")
    gpu_memory_utilization: float = setting(
        0.9, gt=0, le=1, help="the fraction of the GPU's memory this engine may use: the "
        "weights, activations, adapter pool and KV cache are fitted in it")
    max_model_len: int | None = setting(
        None, ge=1, help="context length cap (default: the model's, within the KV pool)")
    dtype: DtypeSetting = setting(
        "auto", help="weights and KV cache dtype (auto: float32 on a CPU; on a GPU the "
        "checkpoint's, bfloat16 where that is float32)")
    quantization: Literal["auto", "fp8"] = setting(
        "auto", help="weights of the linear layers: fp8 (E4M3 with a scale per output "
        "channel, activations scaled per token; a bf16 or float32 checkpoint is quantized as "
        "it loads); auto: as the checkpoint is (FP8 when its quantization_config says so)")
    kv_cache_dtype: Literal["auto", "fp8"] = setting(
        "auto", help="KV cache dtype: auto (--dtype) or fp8 (E4M3 with a scale per KV head: "
        "twice the tokens in the same memory)")
    device: str = setting("auto", metavar="DEVICE",
                          help="auto | cpu | cuda (auto: cuda when a GPU is present)")
    seed: int = setting(0, help="engine seed for unseeded sampling")
    cuda_graphs: bool | None = setting(
        None, help="replay captured CUDA graphs for decode steps (default: on CUDA)")
    piecewise_graphs: bool = setting(
        True, help="with CUDA graphs, replay steps that prefill as graphs of the layers "
        "between attentions, which run eagerly (off: such steps run eagerly)")
    overlap_schedule: bool | None = setting(
        None, help="queue each decode step's forward before postprocessing the previous one "
        "(default: on CUDA, where the host's work then hides behind the device's)")
    threads: int | None = setting(
        None, ge=1, help="torch CPU threads (default: torch's choice, one per core)")
    max_loras: int | None = setting(
        None, ge=0, help="LoRA adapters resident on the device at once (0: base model only; "
        "default: 4 on a CPU, on a GPU one per 8 rows of the adapter pool, at most 512)")
    max_cpu_loras: int | None = setting(
        None, ge=0, help="LoRA adapters cached in host memory, at least --max-loras (default: "
        "16 on a CPU; on a GPU as many as --cpu-lora-cache-gb holds)")
    cpu_lora_cache_gb: float | None = setting(
        None, gt=0, metavar="GB", help="host memory the adapter cache may hold, the adapters "
        "as the device pools lay them out (pinned on a GPU) (default: on a GPU a quarter of "
        "the host memory available at start; on a CPU only --max-cpu-loras bounds it)")
    max_lora_rank: int = setting(
        128, ge=1, le=512, metavar="R", help="largest adapter rank served")
    lora_pool_rows: int | None = setting(
        None, ge=1, help="rank rows in the device adapter pool: an adapter of rank r takes r of "
        "them (in the projections it targets); default: 32 per --max-loras on a CPU; on a GPU "
        "--max-loras x --max-lora-rank when --max-loras is given, else a tenth of the memory "
        "left after the weights and activations")
    # None: no upload store offline; `switchboard serve` always has one (`engine_config`).
    adapter_dir: Path | None = setting(
        None, metavar="DIR", help="where uploaded adapters are stored (default: <cache dir>/"
        "adapters)")
    cache_dir: Path = setting(
        default_factory=default_cache_dir, metavar="DIR",
        help="where converted GGUF and synthetic models are kept (default: "
        "$XDG_CACHE_HOME/switchboard)")
    reasoning_parser: ReasoningParser = setting(
        "auto", help="the model's reasoning markers: the text between them is reasoning_content "
        "and a constraint starts after them (auto: <think>...</think> when the chat template "
        "uses them; none: the output is all answer)")
    prefix_cache: bool = setting(
        True, help="keep finished KV in the radix tree and reuse shared prefixes "
        "(--no-prefix-cache: sessions then re-prefill)")
    num_speculative_tokens: int = setting(
        0, ge=0, le=16, help="the most draft tokens per decode, verified in one forward, in "
        "batches of up to 16 decodes (the drafts: --speculative-method); 0: off")
    speculative_method: Literal["suffix", "ngram"] = setting(
        "suffix", help="where drafts come from: suffix (the sequence itself and what earlier "
        "requests of the same tenant and adapter wrote, suffix decoding) or ngram (the "
        "sequence itself only, prompt lookup)")
    suffix_cache_tokens: int = setting(
        1 << 18, ge=0, help="tokens of finished requests' outputs suffix decoding keeps to "
        "draft from, over all tenants; the least recently used go first")
    session_kv_pages: int | None = setting(
        None, ge=0, help="KV pages a tenant's sessions keep pinned between turns "
        "(default: a quarter of the pool)")
    host_kv_gb: float = setting(
        0.0, ge=0, metavar="GB", help="host-memory KV tier under the prefix cache: evicted KV "
        "moves there and is copied back on a hit instead of recomputed (0: off; with "
        "tensor parallelism, each rank's share)")
    host_kv_pages: int | None = setting(
        None, ge=0, help="host-tier KV pages (default: sized from --host-kv-gb)")
    kv_disk_dir: Path | None = setting(
        None, metavar="DIR", help="disk KV tier under the host tier: sessions' KV kept as "
        "checked page files, so a restarted server resumes them without re-prefill (needs "
        "--host-kv-gb)")
    tensor_parallel_size: int = setting(
        1, ge=1, le=64, help="split the model over this many GPUs (CPU: processes) with "
        "tensor parallelism, one worker process per extra rank (NCCL on GPUs, gloo on CPUs)")
    kv_disk_gb: float | None = setting(
        None, gt=0, metavar="GB", help="most the disk KV tier keeps; the least recently used "
        "page files go first (default: no bound)")
    kv_disk_tenant_gb: float | None = setting(
        None, gt=0, metavar="GB", help="most one tenant's sessions keep in the disk KV tier; "
        "its least recently used page files go first (default: a quarter of --kv-disk-gb, "
        "or 8 GB without it)")

    @model_validator(mode="after")
    def _check_loras(self) -> EngineConfig:
        if (self.max_cpu_loras is not None and self.max_loras is not None
                and self.max_cpu_loras < self.max_loras):
            raise ValueError("max_cpu_loras must be >= max_loras")
        if self.kv_disk_dir is not None and not (self.host_kv_gb or self.host_kv_pages):
            raise ValueError("kv_disk_dir needs a host tier (host_kv_gb or host_kv_pages)")
        return self

    def settle_device(self, cuda: bool, checkpoint_dtype: str | None) -> tuple[EngineConfig,
                                                                              str]:
        """(this config with `device` and `dtype` settled, a line saying what "auto" chose
        and why). `cuda`: a GPU is present; `checkpoint_dtype`: the model's `torch_dtype`.
        Before the model loads (the weights are read in `dtype`, on `device`)."""
        why = []
        device = self.device
        if device == "auto":
            device = "cuda" if cuda else "cpu"
            why.append(f"device {device} ({'a GPU is present' if cuda else 'no GPU'})")
        dtype = self.dtype
        if dtype == "auto":
            found = checkpoint_dtype if checkpoint_dtype in DTYPE_BYTES else None
            if device == "cpu":
                dtype, reason = "float32", "on a CPU"
            elif found in (None, "float32"):
                dtype, reason = "bfloat16", f"the checkpoint's is {found or 'not given'}"
            else:
                dtype, reason = found, "the checkpoint's"
            why.append(f"dtype {dtype} ({reason})")
        settled = self.model_copy(update={"device": device, "dtype": dtype})
        return settled, "; ".join(why)

    def resolve(self, model: ModelConfig, device: str, memory: tuple[int, int] | None = None,
                host_available: int | None = None) -> tuple[ResolvedConfig, str]:
        """This config with every "auto" setting settled for `model` on `device` (a device
        type: "cpu", "cuda"), and a line saying what the memory sizing chose ("" when none ran).
        `memory`: on a GPU, its (total, free) bytes once the weights are loaded; the adapter
        pool and the KV cache are then fitted in `gpu_memory_utilization`. `host_available`:
        the host memory available now (read from the system when None), of which the adapter
        host cache takes a quarter on a GPU. The engine calls it once, after loading the model,
        and reads only the settled config."""
        on_cuda = device == "cuda"
        seqs = self.max_num_seqs or (256 if on_cuda else 64)
        tokens = self.max_num_batched_tokens or (8192 if on_cuda else 512)
        loras, rows, kv_bytes, why = self._fit(model, memory, seqs, tokens)
        num_pages = self.num_pages or max(1, kv_bytes // self._page_bytes(model))
        cpu_loras: int | None = max(self.max_cpu_loras or 16, loras)
        cpu_lora_gb = self.cpu_lora_cache_gb
        if memory is not None:  # a GPU: the host cache is bounded by bytes, not by a count
            cpu_loras = None if self.max_cpu_loras is None else max(self.max_cpu_loras, loras)
            if cpu_lora_gb is None:
                available = host_available_bytes() if host_available is None else host_available
                cpu_lora_gb = available / 4 / 2**30
                why += (f"; adapter host cache {cpu_lora_gb:.1f} GiB (a quarter of the "
                        f"{available / 2**30:.1f} GiB of host memory available)")
        if why:
            why += (f"; KV cache {kv_bytes / 2**30:.1f} GiB ({num_pages:,} pages of "
                    f"{self.page_size} tokens)")
        return ResolvedConfig(**{
            **self.model_dump(),
            "max_num_seqs": seqs,
            "max_num_batched_tokens": tokens,
            "max_loras": loras,
            "max_cpu_loras": cpu_loras,
            "cpu_lora_cache_gb": cpu_lora_gb,
            "lora_pool_rows": rows,
            "num_pages": num_pages,
            "max_model_len": min(self.max_model_len or model.max_position,
                                 num_pages * self.page_size),
            "session_kv_pages": (num_pages // 4 if self.session_kv_pages is None
                                 else self.session_kv_pages),
            "kv_disk_tenant_gb": (self.kv_disk_tenant_gb or
                                  (self.kv_disk_gb / 4 if self.kv_disk_gb else 8.0)),
            "host_kv_pages": (int(self.host_kv_gb * 2**30) // self._page_bytes(model)
                              if self.host_kv_pages is None else self.host_kv_pages),
            "cuda_graphs": on_cuda if self.cuda_graphs is None else self.cuda_graphs,
            "overlap_schedule": on_cuda if self.overlap_schedule is None
            else self.overlap_schedule,
        }), why

    def _fit(self, model: ModelConfig, memory: tuple[int, int] | None, seqs: int,
             tokens: int) -> tuple[int, int, int, str]:
        """(max_loras, lora_pool_rows, KV cache bytes, what was chosen and why)."""
        kv_given = int(self.kv_cache_gb * 2**30) if self.kv_cache_gb else None
        r_max = self.max_lora_rank
        if memory is None:  # a CPU: the laptop's defaults; 32 rows an adapter on average
            loras = 4 if self.max_loras is None else self.max_loras
            rows = self.lora_pool_rows or min(loras * r_max, max(32 * loras, r_max))
            return loras, rows if loras else 0, kv_given or 2 * 2**30, ""
        total, free = memory
        gib = 2**30
        usable = int(self.gpu_memory_utilization * total) - (total - free)
        reserve = self._activation_bytes(model, seqs, tokens)
        left = usable - reserve
        if left <= 0:
            raise ModelLoadError(
                f"--gpu-memory-utilization {self.gpu_memory_utilization} leaves "
                f"{usable / gib:.1f} GiB after the weights ({(total - free) / gib:.1f} GiB in "
                f"use), less than the {reserve / gib:.1f} GiB the activations need: raise it, or "
                "lower --max-num-batched-tokens / --max-num-seqs")
        row_bytes = self._lora_row_bytes(model)
        if self.max_loras == 0:
            rows = 0
        elif self.lora_pool_rows:
            rows = self.lora_pool_rows
        elif self.max_loras is not None:  # room for that many adapters of the largest rank
            rows = self.max_loras * r_max
        else:
            rows = max(r_max, left // 10 // row_bytes)
        loras = (self.max_loras if self.max_loras is not None
                 else min(512, max(1, rows // 8)) if rows else 0)
        kv = kv_given or left - rows * row_bytes
        if kv <= 0:
            raise ModelLoadError(f"the adapter pool ({rows:,} rows, {rows * row_bytes / gib:.1f} "
                                 f"GiB) leaves no memory for the KV cache: lower "
                                 "--lora-pool-rows")
        why = (f"GPU memory {total / gib:.1f} GiB x {self.gpu_memory_utilization} = "
               f"{self.gpu_memory_utilization * total / gib:.1f} GiB: weights and context "
               f"{(total - free) / gib:.1f} GiB, activations {reserve / gib:.1f} GiB "
               f"({tokens:,} tokens and {seqs} sequences a step); adapter pool "
               f"{rows * row_bytes / gib:.1f} GiB ({rows:,} rank rows, up to {loras} adapters)")
        return loras, rows, kv, why

    def _activation_bytes(self, model: ModelConfig, seqs: int, tokens: int) -> int:
        """What a step's forward and sampling may hold beyond the pools, with margin: a
        layer's activations for `tokens` tokens, the sampled rows' fp32 logits (three copies:
        logits, probabilities, sorted), the CUDA graphs' pool, and 1 GiB for the rest."""
        h, i, v = model.hidden_size, model.intermediate_size, model.vocab_size
        layer = tokens * (6 * h + 3 * i) * DTYPE_BYTES[self.dtype]  # type: ignore[index]
        logits = 3 * seqs * (1 + self.num_speculative_tokens) * v * 4
        graphs = seqs * (6 * h + 3 * i) * DTYPE_BYTES[self.dtype]  # type: ignore[index]
        return layer + logits + graphs + 2**30

    def _lora_row_bytes(self, model: ModelConfig) -> int:
        """One rank row of the adapter pool in every projection of every layer
        (`lora.slots.LoraSlots`): lora_A's rows (in_features) and lora_B's (out_features)."""
        h, i = model.hidden_size, model.intermediate_size
        q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
        per_layer = (3 * h + q + 2 * kv) + (q + h) + (2 * h + 2 * i) + (i + h)
        return per_layer * model.num_layers * DTYPE_BYTES[self.dtype]  # type: ignore[index]

    def _page_bytes(self, model: ModelConfig) -> int:
        """One page's K and V over all layers (`dtype` settled: `settle_device`)."""
        assert self.dtype != "auto", "settle_device first"
        return (2 * model.num_layers * model.num_kv_heads * model.head_dim
                * self.kv_itemsize * self.page_size)

    @property
    def load_quantization(self) -> str | None:
        """What the projections are quantized to as they load ("fp8"); None: as the checkpoint
        holds them."""
        return None if self.quantization == "auto" else self.quantization

    @property
    def kv_dtype(self) -> str:
        """The KV cache's torch dtype name (`dtype` settled)."""
        return "float8_e4m3fn" if self.kv_cache_dtype == "fp8" else str(self.dtype)

    @property
    def kv_itemsize(self) -> int:
        """Bytes of one KV cache element (`dtype` settled)."""
        assert self.dtype != "auto", "settle_device first"
        return 1 if self.kv_cache_dtype == "fp8" else DTYPE_BYTES[self.dtype]  # type: ignore[index]


class ResolvedConfig(EngineConfig):
    """An `EngineConfig` after `resolve`: the settings that may be "auto" are settled (these
    types say so; their defaults, bounds and help stay with `EngineConfig`)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_loras: int
    max_cpu_loras: int | None  # None: only cpu_lora_cache_gb bounds the host cache (a GPU)
    lora_pool_rows: int
    num_pages: int
    max_model_len: int
    session_kv_pages: int
    host_kv_pages: int
    kv_disk_tenant_gb: float
    cuda_graphs: bool
    overlap_schedule: bool
