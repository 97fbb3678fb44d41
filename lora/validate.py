"""Check a PEFT LoRA adapter against the base model; every check returns all its problems.

Two inputs are checked: `adapter_config.json` (a dict) and the safetensors header (names,
dtypes, shapes), both before any weight is read. Messages name the file, tensor or field and
say what was expected, so one 400 response tells the uploader everything to fix.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from lora.patterns import check_patterns, pattern_key
from lora.safetensors_header import FLOAT_DTYPES, TensorEntry
from lora.shape import BaseShape

# The projections LoRA is served on, and the block each lives in.
PROJECTIONS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
_SUPPORTED = ", ".join(PROJECTIONS)

# Config fields that change the forward pass in ways the kernels do not implement.
_UNSUPPORTED_FIELDS = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "LoRA bias terms (lora_bias)",
    "modules_to_save": "full module copies (modules_to_save)",
    "fan_in_fan_out": "the Conv1D weight layout (fan_in_fan_out)",
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable token embeddings (trainable_token_indices)",
    "target_parameters": "LoRA on raw parameters (target_parameters)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
}

FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32

_KEY = re.compile(
    r"(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])"
    r"(?:\.default)?\.weight"
)
_MODULE_OF_KEY = re.compile(r"([A-Za-z_][\w]*)\.lora_(?:embedding_)?[AB]\b")


def projection_dims(base: BaseShape) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection of the base model."""
    h, i = base.hidden_size, base.intermediate_size
    q, kv = base.num_heads * base.head_dim, base.num_kv_heads * base.head_dim
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


@dataclass(frozen=True)
class LoraSettings:
    """The parts of `adapter_config.json` that shape the forward pass."""

    r: int
    alpha: float
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    def rank(self, module_path: str) -> int:
        """Rank of `model.layers.{i}.{block}.{proj}`, with PEFT's `rank_pattern` rule."""
        key = pattern_key(self.rank_pattern, module_path)
        return self.rank_pattern[key] if key is not None else self.r

    def scale(self, module_path: str) -> float:
        """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA (per-module patterns)."""
        key = pattern_key(self.alpha_pattern, module_path)
        alpha = self.alpha_pattern[key] if key is not None else self.alpha
        return _scaling(alpha, self.rank(module_path), self.use_rslora)

    @property
    def default_scale(self) -> float:
        """The scaling of modules no pattern matches."""
        return _scaling(self.alpha, self.r, self.use_rslora)


def _scaling(alpha: float, r: int, use_rslora: bool) -> float:
    return alpha / math.sqrt(r) if use_rslora else alpha / r


def check_config(
    cfg: dict[str, Any], base: BaseShape, max_rank: int
) -> tuple[LoraSettings | None, list[str]]:
    """Validate `adapter_config.json`. Returns the settings (None if unusable) and problems."""
    where = "adapter_config.json"
    problems = []
    if cfg.get("peft_type", "LORA") != "LORA":
        problems.append(
            f"{where}: peft_type is {cfg['peft_type']!r}; only LORA adapters are served"
        )
    for key, what in _UNSUPPORTED_FIELDS.items():
        if cfg.get(key):
            problems.append(f"{where}: {what} is not supported ({key}={cfg[key]!r})")
    if cfg.get("bias", "none") != "none":
        problems.append(f"{where}: bias={cfg['bias']!r} trains bias terms; only 'none' is served")

    mapping = cfg.get("auto_mapping") or {}
    arch = mapping.get("base_model_class") if isinstance(mapping, dict) else None
    if arch and arch != base.architecture:
        problems.append(
            f"{where}: adapter was made for {arch}, but the base model is {base.architecture}"
        )
    problems += _check_targets(cfg.get("target_modules"), where)
    layers = cfg.get("layers_to_transform")
    for i in [layers] if isinstance(layers, int) else layers or []:
        if not isinstance(i, int) or not 0 <= i < base.num_layers:
            problems.append(
                f"{where}: layers_to_transform has {i!r}; the base model has "
                f"{base.num_layers} layers"
            )

    r, alpha = cfg.get("r", 8), cfg.get("lora_alpha", 8)
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    ok = True
    if not isinstance(rank_pattern, dict):
        problems.append(f"{where}: rank_pattern must be an object of pattern -> rank")
        rank_pattern, ok = {}, False
    if not isinstance(alpha_pattern, dict):
        problems.append(f"{where}: alpha_pattern must be an object of pattern -> alpha")
        alpha_pattern, ok = {}, False
    for key, value in [("r", r), *((f"rank_pattern[{k!r}]", v) for k, v in rank_pattern.items())]:
        if not _is_int(value) or value < 1:
            problems.append(f"{where}: {key} must be a positive integer, got {value!r}")
            ok = False
        elif value > max_rank:
            problems.append(f"{where}: {key}={value} exceeds the max LoRA rank {max_rank}")
    for key, value in [
        ("lora_alpha", alpha),
        *((f"alpha_pattern[{k!r}]", v) for k, v in alpha_pattern.items()),
    ]:
        if not _is_positive_finite(value):
            problems.append(f"{where}: {key} must be a positive number, got {value!r}")
            ok = False
    if not isinstance(cfg.get("use_rslora", False), bool):
        problems.append(f"{where}: use_rslora must be true or false")
        ok = False
    paths = [f"model.layers.{i}.{block}.{proj}"
             for i in range(base.num_layers) for proj, block in PROJECTIONS.items()]
    pattern_problems = check_patterns([*rank_pattern, *alpha_pattern], paths)
    problems += [f"{where}: {p}" for p in pattern_problems]
    ok = ok and not pattern_problems
    if not ok:
        return None, problems
    settings = LoraSettings(
        r,
        float(alpha),
        cfg.get("use_rslora", False),
        dict(rank_pattern),
        {k: float(v) for k, v in alpha_pattern.items()},
    )
    problems += [f"{where}: {p}" for p in _check_scales(settings, paths)]
    return settings, problems


def _check_scales(settings: LoraSettings, paths: list[str]) -> list[str]:
    """Every scaling the adapter gives a module must be a usable float32: a slot stores the
    default scaling as float32 and folds each module's ratio to it into B (lora/slots.py), so
    a scaling that overflows (lora_alpha=1e308) or vanishes would fail in the engine step."""
    r = f"sqrt({settings.r})" if settings.use_rslora else str(settings.r)
    default = settings.default_scale
    if not _is_float32(default):
        return [f"the scaling lora_alpha / {'sqrt(r)' if settings.use_rslora else 'r'} = "
                f"{settings.alpha:g} / {r} = {default:g} is outside float32's range "
                f"({FLOAT32_TINY:.2g} to {FLOAT32_MAX:.2g})"]
    problems: dict[float, str] = {}
    for path in paths:  # each distinct bad scaling once, named by its first module
        scale = settings.scale(path)
        if scale not in problems and not (_is_float32(scale) and _is_float32(scale / default)):
            problems[scale] = (
                f"{path}: rank_pattern / alpha_pattern give it the scaling {scale:g}, "
                f"{scale / default:g} times the default {default:g}; both must lie within "
                f"float32's range ({FLOAT32_TINY:.2g} to {FLOAT32_MAX:.2g})"
            )
    return list(problems.values())


def _check_targets(targets: object, where: str) -> list[str]:
    if targets is None or isinstance(targets, str):
        return []  # "all-linear" or a regex: the tensors present are checked instead
    if not isinstance(targets, list):
        return [f"{where}: target_modules must be a list or a string"]
    return [
        f"{where}: target module {name!r} is not supported (LoRA is served on {_SUPPORTED})"
        for name in targets
        if not isinstance(name, str) or name.rsplit(".", 1)[-1] not in PROJECTIONS
    ]


@dataclass(frozen=True)
class ModuleTensors:
    """The lora_A / lora_B header entries of one targeted projection of one layer."""

    layer: int
    module: str
    path: str  # `model.layers.{layer}.{block}.{module}`, what PEFT's patterns match
    a: TensorEntry  # (rank, in_features)
    b: TensorEntry  # (out_features, rank)


def check_tensors(
    entries: dict[str, TensorEntry],
    settings: LoraSettings | None,
    base: BaseShape,
    max_rank: int,
    where: str = "adapter_model.safetensors",
) -> tuple[list[ModuleTensors], list[str]]:
    """Match tensor names to projections and check dtypes and shapes against the base."""
    problems: list[str] = []
    found: dict[tuple[int, str], dict[str, TensorEntry]] = {}
    for key, entry in entries.items():
        m = _KEY.fullmatch(key)
        if m is None or m[3] not in PROJECTIONS or PROJECTIONS[m[3]] != m[2]:
            guess = _MODULE_OF_KEY.search(key)
            module = m[3] if m else guess[1] if guess else None
            if module and module not in PROJECTIONS:
                problems.append(
                    f"{where}: target module {module!r} is not supported "
                    f"(LoRA is served on {_SUPPORTED})"
                )
            else:
                problems.append(
                    f"{where}: unexpected tensor {key!r} (only lora_A/lora_B weights of "
                    f"{_SUPPORTED} are served)"
                )
            continue
        layer = int(m[1])
        if layer >= base.num_layers:
            problems.append(
                f"{where}: tensor {key!r} is for layer {layer}, but the base model has "
                f"{base.num_layers} layers (adapter made for another base model?)"
            )
            continue
        if entry.dtype not in FLOAT_DTYPES:
            problems.append(
                f"{where}: tensor {key!r} has dtype {entry.dtype}; expected F32, F16 or BF16"
            )
        found.setdefault((layer, m[3]), {})[m[4]] = entry
    if not entries:
        problems.append(f"{where}: contains no tensors")

    dims = projection_dims(base)
    modules = []
    for (layer, module), ab in sorted(found.items()):
        path = f"model.layers.{layer}.{PROJECTIONS[module]}.{module}"
        if len(ab) != 2:
            have, miss = ("A", "B") if "A" in ab else ("B", "A")
            problems.append(f"{where}: {path} has lora_{have} but no lora_{miss}")
            continue
        a, b = ab["A"], ab["B"]
        bad = _check_pair(path, a.shape, b.shape, dims[module], settings, max_rank)
        problems += [f"{where}: {p}" for p in bad]
        if not bad and a.dtype in FLOAT_DTYPES and b.dtype in FLOAT_DTYPES:
            modules.append(ModuleTensors(layer, module, path, a, b))
    return modules, list(dict.fromkeys(problems))


def _check_pair(
    path: str,
    a: tuple[int, ...],
    b: tuple[int, ...],
    dims: tuple[int, int],
    settings: LoraSettings | None,
    max_rank: int,
) -> list[str]:
    in_f, out_f = dims
    if len(a) != 2 or len(b) != 2:
        return [f"{path}: lora_A {list(a)} and lora_B {list(b)} must both be 2-D"]
    rank = a[0]
    problems = []
    if a[1] != in_f:
        problems.append(
            f"{path}.lora_A has shape {list(a)}, expected [{rank}, {in_f}] (in_features of the "
            f"base model's {path.rsplit('.', 1)[-1]}; adapter made for another base model?)"
        )
    if b[0] != out_f:
        problems.append(
            f"{path}.lora_B has shape {list(b)}, expected [{out_f}, {rank}] (out_features of "
            f"the base model's {path.rsplit('.', 1)[-1]}; adapter made for another base model?)"
        )
    if b[1] != rank:
        problems.append(f"{path}: lora_A has rank {rank} but lora_B has rank {b[1]}")
    if settings is not None and rank != settings.rank(path):
        problems.append(
            f"{path}: tensors have rank {rank} but adapter_config.json says r={settings.rank(path)}"
        )
    if rank > max_rank:
        problems.append(f"{path}: rank {rank} exceeds the max LoRA rank {max_rank}")
    if rank == 0:
        problems.append(f"{path}: rank 0")
    return problems


def _is_float32(x: float) -> bool:
    """A finite number whose magnitude float32 holds as a normal number (not 0, not inf)."""
    return math.isfinite(x) and FLOAT32_TINY <= abs(x) <= FLOAT32_MAX


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_positive_finite(v: object) -> bool:
    if not isinstance(v, int | float) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v) and v > 0
    except OverflowError:  # an int too large for a float
        return False
