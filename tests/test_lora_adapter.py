"""PEFT adapter folders: the loader agrees with peft, and every bad input is named."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import ModelConfig
from lora.adapter import AdapterError, LoraAdapter, load_adapter
from lora.safetensors_header import MAX_HEADER_BYTES

peft = pytest.importorskip("peft")

ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    base = ModelConfig.from_hf({**cfg.to_dict(), "architectures": ["LlamaForCausalLM"]})
    return LlamaForCausalLM(cfg).eval(), base


def peft_adapter(path: Path, **lora_kwargs):
    """Save a peft LoRA with random non-zero B on a fresh tiny Llama; return the peft model."""
    model, base = tiny_llama()
    config = peft.LoraConfig(init_lora_weights=False, **lora_kwargs)
    wrapped = peft.get_peft_model(model, config).eval()
    wrapped.save_pretrained(path)
    return wrapped, base


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = tmp_path_factory.mktemp("adapter") / "support-bot"
    wrapped, base = peft_adapter(path, r=8, lora_alpha=16, target_modules=ALL_PROJ)
    return path, base


@pytest.fixture
def bad(good, tmp_path):
    """A private copy of the good adapter folder, to break."""
    return Path(shutil.copytree(good[0], tmp_path / "bad")), good[1]


CASES = {
    "plain": dict(r=8, lora_alpha=16, target_modules=ALL_PROJ),
    "rslora_patterns": dict(
        r=8,
        lora_alpha=32,
        use_rslora=True,
        target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"v_proj": 4},
        alpha_pattern={"down_proj": 3.0},
    ),
    "some_layers": dict(
        r=16, lora_alpha=8, target_modules=["o_proj", "up_proj"], layers_to_transform=[1]
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_peft(tmp_path, case):
    wrapped, base = peft_adapter(tmp_path / case, **CASES[case])
    adapter = load_adapter(tmp_path / case, base)
    assert isinstance(adapter, LoraAdapter) and adapter.name == case
    assert adapter.target_modules == set(CASES[case]["target_modules"])
    torch.manual_seed(1)
    checked = 0
    for i, layer in enumerate(wrapped.base_model.model.model.layers):
        for block in (layer.self_attn, layer.mlp):
            for name in ALL_PROJ:
                mod = getattr(block, name, None)
                if mod is None:
                    continue
                delta = adapter.delta(i, name)
                if not hasattr(mod, "lora_A") or "default" not in mod.lora_A:
                    assert delta is None
                    continue
                x = torch.randn(5, mod.in_features)
                with torch.no_grad():
                    expected = mod(x)
                    ours = mod.base_layer(x) + x @ delta.T
                torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
                assert adapter.layers[i][name].scale == pytest.approx(mod.scaling["default"])
                checked += 1
    assert checked == sum(len(layer) for layer in adapter.layers) > 0


def test_extra_files_ignored_and_dtype(bad):
    path, base = bad
    (path / "README.md").write_text("# card")
    adapter = load_adapter(path, base, dtype=torch.bfloat16, name="x")
    assert adapter.name == "x" and adapter.rank == 8 and adapter.scale == 2.0
    assert adapter.layers[0]["q_proj"].a.dtype == torch.bfloat16
    assert adapter.num_bytes == sum(
        t.numel() * 2 for layer in adapter.layers for m in layer.values() for t in (m.a, m.b)
    )


def problems_of(path, base, **kwargs) -> list[str]:
    with pytest.raises(AdapterError) as info:
        load_adapter(path, base, **kwargs)
    assert isinstance(info.value, ValueError)
    return info.value.problems


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / CONFIG).read_text())
    (path / CONFIG).write_text(json.dumps({**cfg, **changes}))


def edit_tensors(path: Path, fn) -> None:
    tensors = load_file(path / WEIGHTS)
    fn(tensors)
    save_file(tensors, path / WEIGHTS)


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


class Boom:
    def __init__(self, canary: Path) -> None:
        self.canary = canary

    def __reduce__(self):
        return (os.mkdir, (str(self.canary),))


def test_pickle_refused_never_opened(bad, tmp_path):
    path, base = bad
    (path / WEIGHTS).unlink()
    canary = tmp_path / "unpickled"
    (path / "adapter_model.bin").write_bytes(pickle.dumps(Boom(canary)))
    (msg,) = problems_of(path, base)
    assert "adapter_model.bin" in msg and "pickle" in msg and "safetensors" in msg
    assert not canary.exists()


def test_missing_files(bad):
    path, base = bad
    (path / CONFIG).unlink()
    (path / WEIGHTS).unlink()
    assert problems_of(path, base) == [f"missing {CONFIG}", f"missing {WEIGHTS}"]


def test_config_rank_differs_from_tensors(bad):
    path, base = bad
    edit_config(path, r=4)
    with pytest.raises(AdapterError) as info:
        load_adapter(path, base)
    assert info.value.num_problems == 14  # 7 projections x 2 layers
    problems = info.value.problems  # the first ten, then the count of the rest
    assert len(problems) == 11 and problems[-1] == "... and 4 more"
    assert "tensors have rank 8 but adapter_config.json says r=4" in problems[0]


def test_rank_over_limit(bad):
    path, base = bad
    problems = problems_of(path, base, max_rank=4)
    assert "r=8 exceeds the max LoRA rank 4" in problems[0]


def test_wrong_shape_names_the_tensor(bad):
    path, base = bad
    edit_tensors(path, lambda t: t.update({Q_A: torch.randn(8, 48)}))
    (msg,) = problems_of(path, base)
    assert "layers.0.self_attn.q_proj.lora_A has shape [8, 48], expected [8, 64]" in msg


def test_nan_and_inf(bad):
    path, base = bad
    key_b = Q_A.replace("lora_A", "lora_B")

    def poison(t):
        t[Q_A][0, 0] = float("nan")
        t[key_b][1, 1] = float("inf")

    edit_tensors(path, poison)
    problems = problems_of(path, base)
    assert len(problems) == 2 and all("NaN or Inf" in p for p in problems)
    assert Q_A in problems[0] and key_b in problems[1]


def test_unsupported_target_module(bad):
    path, base = bad
    edit_config(path, target_modules=[*ALL_PROJ, "embed_tokens"])
    key = "base_model.model.model.embed_tokens.lora_embedding_A"
    edit_tensors(path, lambda t: t.update({key: torch.randn(8, 128)}))
    problems = problems_of(path, base)
    assert len(problems) == 2 and all("'embed_tokens' is not supported" in p for p in problems)


def test_unsupported_features_and_other_base(bad):
    path, base = bad
    edit_config(
        path,
        use_dora=True,
        bias="all",
        modules_to_save=["lm_head"],
        auto_mapping={"base_model_class": "Qwen2ForCausalLM"},
    )
    edit_tensors(path, lambda t: t.update({Q_A.replace("layers.0", "layers.7"): t[Q_A].clone()}))
    text = "\n".join(problems_of(path, base))
    for needle in (
        "DoRA",
        "bias='all'",
        "modules_to_save",
        "made for Qwen2ForCausalLM",
        "layer 7, but the base model has 2 layers",
    ):
        assert needle in text


def test_bad_dtype(bad):
    path, base = bad
    edit_tensors(path, lambda t: t.update({Q_A: t[Q_A].to(torch.int32)}))
    (msg,) = problems_of(path, base)
    assert "dtype I32" in msg and Q_A in msg


def test_every_problem_at_once(bad):
    path, base = bad
    edit_config(path, lora_alpha=-1, target_modules=["q_proj", "lm_head"])

    def mess(t):
        t[Q_A][0, 0] = float("nan")
        del t[Q_A.replace("lora_A", "lora_B")]

    edit_tensors(path, mess)
    problems = problems_of(path, base)
    text = "\n".join(problems)
    assert "lora_alpha must be a positive number" in text
    assert "'lm_head' is not supported" in text
    assert "q_proj has lora_A but no lora_B" in text
    assert len(problems) == 3
    assert str(len(problems)) in str(AdapterError("a", problems))


def write_raw(path: Path, header: bytes, data: bytes = b"", claimed_len: int | None = None):
    size = len(header) if claimed_len is None else claimed_len
    (path / WEIGHTS).write_bytes(struct.pack("<Q", size) + header + data)


def test_header_size_over_limit(bad):
    path, base = bad
    write_raw(path, b"{}", claimed_len=1 << 50)
    (msg,) = problems_of(path, base)
    assert f"header claims {1 << 50} bytes, over the {MAX_HEADER_BYTES}-byte limit" in msg


def test_truncated_header(bad):
    path, base = bad
    write_raw(path, b'{"a": {"dtype": "F32"', claimed_len=4096)
    (msg,) = problems_of(path, base)
    assert "truncated: header claims 4096 bytes" in msg


def test_header_claiming_huge_tensor(bad):
    path, base = bad
    huge = 1 << 40
    header = {Q_A: {"dtype": "F32", "shape": [huge, 64], "data_offsets": [0, huge * 256]}}
    write_raw(path, json.dumps(header).encode(), b"\0" * 64)
    (msg,) = problems_of(path, base)
    assert f"claims {huge * 256} bytes" in msg and "only 64 bytes of data" in msg


def test_truncated_data(bad):
    path, base = bad
    data = (path / WEIGHTS).read_bytes()
    (path / WEIGHTS).write_bytes(data[:-100])
    text = "\n".join(problems_of(path, base))
    assert "truncated or corrupt" in text


def test_garbage_file(bad):
    path, base = bad
    (path / WEIGHTS).write_bytes(b"\x03\0\0\0\0\0\0\0abc")
    (msg,) = problems_of(path, base)
    assert "not valid JSON" in msg
