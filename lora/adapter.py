"""Load a PEFT LoRA adapter folder, validated against the base model.

A folder is `adapter_config.json` + `adapter_model.safetensors`; other files (README.md,
tokenizer files) are ignored. Pickled weights (`.bin`, `.pt`) are refused, never opened, also
beside a safetensors file.
Every problem found is reported at once in one `AdapterError` (the first ten listed, the rest
counted).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from lora.safetensors_header import read_header, read_tensors
from lora.shape import BaseShape
from lora.validate import ModuleTensors, check_config, check_tensors

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
MAX_LISTED = 10  # problems an error lists; the rest are counted
MAX_PROBLEM_CHARS = 600  # a problem quoting a megabyte-long tensor name is cut in its middle
FLOAT32_SQRT_MAX = math.sqrt(torch.finfo(torch.float32).max)  # ~1.8e19


class AdapterError(ValueError):
    """An adapter folder that cannot be served. `problems` lists what is wrong with it, bounded:
    the first `MAX_LISTED` (each at most `MAX_PROBLEM_CHARS`), then "... and N more" for the
    rest, `num_problems` in all; a header of 100,000 bogus tensors makes a short 400, not 22 MB."""

    def __init__(self, name: str, problems: list[str]) -> None:
        self.name = name
        self.num_problems = len(problems)
        self.problems = [_clip(p) for p in problems[:MAX_LISTED]]
        if len(problems) > MAX_LISTED:
            self.problems.append(f"... and {len(problems) - MAX_LISTED:,} more")
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(
            f"adapter {name!r} cannot be loaded ({self.num_problems:,} problems):\n{lines}")


def _clip(problem: str) -> str:
    if len(problem) <= MAX_PROBLEM_CHARS:
        return problem
    half = MAX_PROBLEM_CHARS // 2
    return f"{problem[:half]} … {problem[-half:]}"


@dataclass(frozen=True)
class LoraModule:
    """The LoRA of one projection: `delta_W = scale * b @ a`."""

    a: torch.Tensor  # (rank, in_features)
    b: torch.Tensor  # (out_features, rank)
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    def delta(self) -> torch.Tensor:
        """Dense fp32 weight delta [out_features, in_features] (for tests and merging)."""
        return self.scale * (self.b.float() @ self.a.float())


@dataclass(frozen=True)
class LoraAdapter:
    """A validated adapter, weights on the host.

    `layers[i]` maps projection names (`q_proj`, ..., `down_proj`) to that layer's LoRA;
    untargeted projections are absent. `scale` is the config's alpha / r (or alpha / sqrt(r));
    a module's own `scale` differs only under `rank_pattern` / `alpha_pattern`.
    """

    name: str
    rank: int  # the largest module rank: what the adapter needs from a slot
    scale: float
    layers: tuple[dict[str, LoraModule], ...]

    @property
    def target_modules(self) -> frozenset[str]:
        return frozenset(m for layer in self.layers for m in layer)

    @property
    def num_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for layer in self.layers
            for m in layer.values()
            for t in (m.a, m.b)
        )

    def delta(self, layer: int, module: str) -> torch.Tensor | None:
        """Dense fp32 delta [out_features, in_features] of one projection, None if untargeted."""
        m = self.layers[layer].get(module)
        return None if m is None else m.delta()


def gain_limit(dtype: torch.dtype) -> float:
    """The most a LoRA served in `dtype` may grow an input: its products must fit `dtype`, and
    what it adds to the residual stream is squared in float32 by the next RMSNorm
    (kernels/fused.py): 1.8e19 in float32 and bfloat16, 65,504 in float16."""
    return min(torch.finfo(dtype).max, FLOAT32_SQRT_MAX)


def check_gain(m: ModuleTensors, a: torch.Tensor, b: torch.Tensor, scale: float) -> str | None:
    """A problem naming the tensor to blame when `scale * b @ a`, as served (a, b in the serving
    dtype), can grow an input of elements up to 1 (RMSNorm's scale) past `gain_limit`: finite
    but huge weights (3e38) whose products overflow in every forward.

    The bound is `scale * ||B|| * ||A||` with ||.|| the largest row sum of magnitudes (it bounds
    the largest output element for inputs within [-1, 1]); the shrink alone, `||A||`, must stay
    under it too. Real adapters stay far below (PEFT random inits: 1e2 to 1e3).

    Args:
        a: [rank, in_features]; b: [out_features, rank].
    """
    limit = gain_limit(a.dtype)
    a_gain = max_row_sum(a, torch.float32)  # an fp32 sum overflows only far past the limit
    if max(a_gain, abs(scale) * max_row_sum(b, torch.float32) * a_gain) <= limit:
        return None
    a_gain = max_row_sum(a)  # the message's figure, exact
    gain = max(a_gain, abs(scale) * max_row_sum(b) * a_gain)
    if gain <= limit:
        return None
    a_max, b_max = a.abs().max().item(), b.abs().max().item()
    blame, biggest = (m.a.name, a_max) if a_gain > limit or a_max >= b_max else (m.b.name, b_max)
    return (f"tensor {blame!r} (weights up to {biggest:.3g}): {m.path}'s LoRA (scaling "
            f"{scale:g}) can grow an input {gain:.3g} times; served in {a.dtype}, at most "
            f"{limit:.3g} stays finite")


def max_row_sum(t: torch.Tensor, dtype: torch.dtype = torch.float64) -> float:
    """The largest row sum of magnitudes of a 2-D tensor (its infinity norm), summed in
    `dtype`: in float64, 3e38 weights never overflow the sum; in float32 (5x faster on a CPU)
    it is inf for sums past 3.4e38."""
    return t.abs().sum(dim=1, dtype=dtype).max().item()


def all_finite(t: torch.Tensor) -> bool:
    """Whether no element is NaN or infinite: the largest magnitude is finite (the max
    reduction propagates NaN). 2-7x faster than `torch.isfinite(t).all()` on a CPU, which
    counts in an upload of hundreds of MB of weights."""
    return t.numel() == 0 or bool(torch.isfinite(t.abs().amax()))


def load_adapter(
    path: str | Path,
    base: BaseShape,
    *,
    max_rank: int = 64,
    name: str | None = None,
    dtype: torch.dtype | None = None,
) -> LoraAdapter:
    """Read and validate a PEFT adapter folder.

    Args:
        path: the folder written by PEFT's `save_pretrained`.
        base: the served model's shape; the adapter must match it exactly.
        max_rank: the engine's `--max-lora-rank`; the slot buffers are this wide.
        name: registry name (default: the folder's name).
        dtype: convert the weights to this dtype (default: as stored).
    Raises:
        AdapterError: listing the problems found (config, tensor names, shapes, dtypes,
            NaN/Inf, weights whose products overflow the serving dtype (`check_gain`), a
            corrupt or truncated file, pickled weights).
    """
    folder = Path(path)
    name = name or folder.name
    if not folder.is_dir():
        raise AdapterError(name, [f"{folder} is not a directory"])
    problems: list[str] = []

    settings = None
    cfg_file = folder / CONFIG_FILE
    try:
        cfg = json.loads(cfg_file.read_text())
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
    except FileNotFoundError:
        problems.append(f"missing {CONFIG_FILE}")
    except (OSError, ValueError, RecursionError) as e:
        problems.append(f"{CONFIG_FILE} is not valid JSON ({e})")
    else:
        settings, found = check_config(cfg, base, max_rank)
        problems += found

    weights = folder / WEIGHTS_FILE
    # Refused even beside a sound safetensors file: the folder is the adapter, all of it.
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        problems.append(
            f"{', '.join(pickles)}: pickled weights are never loaded (unpickling runs "
            f"arbitrary code); "
            + (f"remove them, {WEIGHTS_FILE} holds the weights" if weights.is_file() else
               "save the adapter with safetensors: "
               "model.save_pretrained(path, safe_serialization=True)")
        )
    if not weights.is_file():
        if not pickles:
            problems.append(f"missing {WEIGHTS_FILE}")
        raise AdapterError(name, problems)

    entries, header_problems = read_header(weights)
    problems += header_problems
    modules: list[ModuleTensors] = []
    if entries or not header_problems:  # an unreadable header has nothing more to report
        modules, found = check_tensors(entries, settings, base, max_rank, weights.name)
        problems += found

    # Only checked entries are read: each lies inside the file, so this is bounded by its size.
    try:
        tensors = read_tensors(weights, [e for m in modules for e in (m.a, m.b)])
    except OSError as e:
        raise AdapterError(name, [*problems, str(e)]) from None
    for key, t in tensors.items():
        if not all_finite(t):
            problems.append(f"{weights.name}: tensor {key!r} contains NaN or Inf")
    if problems:
        raise AdapterError(name, problems)
    assert settings is not None  # no problems means the config parsed

    layers: list[dict[str, LoraModule]] = [{} for _ in range(base.num_layers)]
    for m in modules:
        a, b = tensors[m.a.name], tensors[m.b.name]
        if dtype is not None:
            a, b = a.to(dtype), b.to(dtype)
        scale = settings.scale(m.path)
        ratio = scale / settings.default_scale
        # A slot holds A and B times the scaling ratio (lora/slots.py), in the serving dtype.
        # |b| * ratio rounds up monotonically: only its largest element can overflow first.
        if not (all_finite(a) and all_finite(b.abs().amax() * ratio)):
            problems.append(f"{weights.name}: {m.path}: lora_A, or lora_B times its scaling "
                            f"ratio {ratio:g}, overflows {a.dtype}")
        elif (problem := check_gain(m, a, b, scale)) is not None:
            problems.append(f"{weights.name}: {problem}")
        layers[m.layer][m.module] = LoraModule(a, b, scale)
    if problems:
        raise AdapterError(name, problems)
    return LoraAdapter(
        name=name,
        rank=max(m.a.shape[0] for m in modules),
        scale=settings.default_scale,
        layers=tuple(layers),
    )
