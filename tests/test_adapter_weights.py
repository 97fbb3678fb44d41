"""Adapter weights whose products cannot stay finite in the serving dtype are refused where
they enter (lora/adapter.py `check_gain`), naming the tensor; real PEFT adapters, also with
large random inits, are accepted in every serving dtype. The upload of issue "Hardening,
round two" (one tensor scaled to 3e38: every request on it was a 500) against the shared
`gateway_server`."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.numpy import save
from safetensors.torch import load_file, save_file

from lora.adapter import AdapterError, all_finite, gain_limit, load_adapter, max_row_sum
from tests import lora_files as lf
from tests.conftest import GatewayServer
from tests.test_hostile_uploads import SMOLLM2, store_files
from tests.tiny_models import save_peft_adapter

pytest.importorskip("peft")

LAYER0_Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
LAYER1_V_B = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"


def _files(folder: Path) -> list[tuple[str, tuple[str, bytes]]]:
    return [("files", (p.name, p.read_bytes())) for p in sorted(folder.iterdir())]


def _scaled(good: Path, out: Path, tensor: str, to: float) -> Path:
    """A copy of the adapter at `good` whose `tensor` is scaled so its largest weight is `to`."""
    shutil.copytree(good, out)
    weights = out / lf.WEIGHTS
    tensors = load_file(weights)
    t = tensors[tensor]
    tensors[tensor] = (t.double() * (to / t.abs().max().item())).to(t.dtype)
    assert torch.isfinite(tensors[tensor]).all()
    save_file(tensors, weights)
    return out


@pytest.mark.parametrize("tensor", [LAYER0_Q_A, LAYER1_V_B])
def test_huge_weights_are_refused_at_upload(gateway_server: GatewayServer, smollm2_dir: Path,
                                            tmp_path: Path, tensor: str) -> None:
    """A 400 naming the tensor; nothing registered or stored; the same name then takes the
    sound adapter, which serves."""
    srv = gateway_server
    auth = {"Authorization": f"Bearer {srv.api_key}"}
    good = save_peft_adapter(smollm2_dir, tmp_path / "good", seed=4)
    huge = _scaled(good, tmp_path / "huge", tensor, 3e38)
    name = f"huge-{uuid.uuid4().hex[:8]}"
    before = store_files(srv)

    r = httpx.post(srv.base_url + "/adapters", data={"name": name}, files=_files(huge),
                   headers=auth, timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_adapter")
    assert f"tensor {tensor!r} (weights up to 3e+38)" in error["message"], error["message"]
    assert "at most 1.84e+19 stays finite" in error["message"]
    listed = httpx.get(srv.base_url + "/adapters", headers=auth, timeout=30).json()["data"]
    assert name not in [a["id"] for a in listed]
    assert httpx.get(srv.base_url + f"/adapters/{name}", headers=auth, timeout=30
                     ).status_code == 404
    assert store_files(srv) == before

    r = httpx.post(srv.base_url + "/adapters", data={"name": name}, files=_files(good),
                   headers=auth, timeout=120)
    try:
        assert r.status_code == 200, r.text
        chat = httpx.post(srv.base_url + "/chat/completions", headers=auth, timeout=120, json={
            "model": name, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": "Hi"}]})
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["finish_reason"] == "length"
    finally:
        httpx.delete(srv.base_url + f"/adapters/{name}", headers=auth, timeout=30)


def _peft_adapter(out: Path, **lora: object) -> Path:
    """A real PEFT LoRA on all seven projections of a SmolLM2-shaped model (two layers)."""
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=lf.HIDDEN, intermediate_size=SMOLLM2.intermediate_size,
                      num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3,
                      head_dim=64, vocab_size=64)
    torch.manual_seed(0)
    model = peft.get_peft_model(LlamaForCausalLM(cfg), peft.LoraConfig(
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"], **lora))
    model.save_pretrained(out, save_embedding_layers=False)
    return out


@pytest.mark.parametrize("lora", [
    dict(r=16, lora_alpha=128, init_lora_weights=False),  # random A and B, scaling 8
    dict(r=64, lora_alpha=64, use_rslora=True, init_lora_weights=False),  # scaling 8
    dict(r=8, lora_alpha=16, init_lora_weights="gaussian"),  # PEFT's init: B = 0
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_real_adapters_are_accepted(tmp_path: Path, lora: dict, dtype: torch.dtype) -> None:
    """Large but sane random inits stay two orders of magnitude under even float16's bound."""
    adapter = load_adapter(_peft_adapter(tmp_path / "a", **lora), SMOLLM2, max_rank=64,
                           dtype=dtype)
    gains = [m.scale * max_row_sum(m.b) * max_row_sum(m.a)
             for layer in adapter.layers for m in layer.values()]
    assert len(gains) == 14 and max(gains) < gain_limit(torch.float16) / 50


@pytest.mark.parametrize(("value", "refused_in"), [
    (1e3, [torch.float16]),  # ||A|| = 576 * 1e3: past float16's 65,504 only
    (1e20, [torch.float32, torch.bfloat16]),  # past 1.8e19 (in float16 1e20 is Inf: refused)
])
def test_the_bound_follows_the_serving_dtype(tmp_path: Path, value: float,
                                             refused_in: list[torch.dtype]) -> None:
    tensors = lf.tensors()
    tensors[lf.Q_A][:] = value
    for name, data in lf.adapter(save(tensors)):
        (tmp_path / name).write_bytes(data)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        if dtype not in refused_in:
            continue
        with pytest.raises(AdapterError) as e:
            load_adapter(tmp_path, SMOLLM2, max_rank=16, dtype=dtype)
        assert e.value.num_problems == 1
        stored = torch.tensor(value, dtype=dtype).item()  # as the serving dtype rounds it
        assert f"tensor {lf.Q_A!r} (weights up to {stored:.3g})" in e.value.problems[0]
        assert f"served in {dtype}, at most {gain_limit(dtype):.3g}" in e.value.problems[0]
    if value == 1e3:
        for dtype in (torch.float32, torch.bfloat16):
            load_adapter(tmp_path, SMOLLM2, max_rank=16, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_all_finite_finds_every_nan_and_inf(dtype: torch.dtype) -> None:
    """`all_finite` (the largest magnitude; the max reduction propagates NaN) agrees with
    `torch.isfinite` wherever a NaN or an infinity sits: the vectorized lanes, the tail, a
    transposed view."""
    g = torch.Generator().manual_seed(0)
    assert all_finite(torch.empty(0, 4, dtype=dtype))
    for shape in ((16, 14336), (14336, 16), (7, 33), (1, 1)):
        n = shape[0] * shape[1]
        t = torch.randn(shape, generator=g).to(dtype)
        assert all_finite(t) and all_finite(t.t())
        for pos in sorted({0, 1, 15, 16, 31, 32, 63, 64, n // 2, n - 2, n - 1} & set(range(n))):
            for v in (float("nan"), float("inf"), -float("inf")):
                bad = t.clone()
                bad.view(-1)[pos] = v
                assert not all_finite(bad) and not all_finite(bad.t()), (shape, pos, v)
