"""Batch info, SGMV/BGMV dispatch, and the fused adapter pools against peft's per-module LoRA."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.seg_lora import segment_table
from lora.adapter import load_adapter
from lora.batch import LoraBatchInfo, SlotTable, lora_expand_slices, lora_shrink
from lora.slots import LoraSlots

peft = pytest.importorskip("peft")


def test_build_merges_runs():
    info = LoraBatchInfo.build([2, 2, -1, 0, 0, 5], [1, 3, 2, 0, 4, 1])
    assert info.token_slots.tolist() == [2, 2, 2, 2, -1, -1, 0, 0, 0, 0, 5]
    assert info.seg_indptr.tolist() == [0, 4, 6, 10, 11]
    assert info.seg_slots.tolist() == [2, -1, 0, 5]
    assert info.max_seg_len == 4 and info.kernel == "sgmv" and info.has_lora
    assert info.token_slots.dtype == torch.int32


def test_interleaved_decodes_use_bgmv_and_base_only_has_no_lora():
    info = LoraBatchInfo.build([0, 1, 0, 1], [1, 1, 1, 1])
    assert info.kernel == "bgmv" and info.seg_slots.tolist() == [0, 1, 0, 1]
    assert not LoraBatchInfo.build([-1, -1], [1, 7]).has_lora
    empty = LoraBatchInfo.build([], [])
    assert empty.token_slots.numel() == 0 and not empty.has_lora


def test_sgmv_and_bgmv_paths_agree():
    """Both kernels over one pool of adapters at ranks 2 and 5 and an empty slot, with garbage
    in the rows no adapter owns."""
    gen = torch.Generator().manual_seed(0)
    info = LoraBatchInfo.build([1, -1, 2, 1, 3], [4, 2, 1, 3, 5])
    x = torch.randn(15, 32, generator=gen)
    a, b = torch.randn(40, 3, 32, generator=gen), torch.randn(40, 60, generator=gen)
    table = SlotTable(torch.tensor([30, 0, 9, 20], dtype=torch.int32),
                      torch.tensor([8, 2, 0, 5], dtype=torch.int32),
                      torch.tensor([0.5, 1.0, 2.0, 4.0]), max_rank=8)
    results = []
    for kernel in ("sgmv", "bgmv"):
        i = dataclasses.replace(info, kernel=kernel)
        t = lora_shrink(x, a, table, i)  # (15, 3 slices x max rank 8)
        assert t.shape == (15, 24) and not t[4:6].any()  # base-only rows
        assert not t[[0, 1, 2, 3, 7, 8, 9], 2:8].any()  # slot 1 is rank 2: zeros past it
        y = torch.zeros(15, 60)
        lora_expand_slices(y, t, b, (20, 12, 28), table, i)
        results.append(y)
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=1e-5)
    assert results[0][4:6].abs().sum() == 0  # base-only rows untouched
    assert results[0][6].abs().sum() == 0  # slot 2 is empty (rank 0)
    u, r = 20, 5  # slot 3's adapter, token 14: slice 1 is columns 20:32 of y
    expect = 4.0 * (x[14] @ a[u : u + r, 1].T) @ b[u : u + r, 20:32]
    torch.testing.assert_close(results[0][14, 20:32], expect, atol=1e-4, rtol=1e-4)


def _peft_model(tmp_path, name, seed, **kwargs):
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.config import ModelConfig

    torch.manual_seed(0)  # same base weights for every adapter
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    base = ModelConfig.from_hf({**cfg.to_dict(), "architectures": ["LlamaForCausalLM"]})
    model = LlamaForCausalLM(cfg).eval()
    torch.manual_seed(seed)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **kwargs))
    wrapped.save_pretrained(tmp_path / name)
    return wrapped.eval(), load_adapter(tmp_path / name, base, max_rank=64), base


FUSED = {  # the engine's fused projection -> (HF block, HF projections in row order)
    "qkv_proj": ("self_attn", ["q_proj", "k_proj", "v_proj"]),
    "o_proj": ("self_attn", ["o_proj"]),
    "gate_up_proj": ("mlp", ["gate_proj", "up_proj"]),
    "down_proj": ("mlp", ["down_proj"]),
}


@torch.no_grad()
def _hf_fused(model, layer, fused, x, lora=True):
    """peft's output of the HF projections making up `fused`, concatenated like the engine."""
    block_name, parts = FUSED[fused]
    block = getattr(model.base_model.model.model.layers[layer], block_name)
    mods = [getattr(block, p) for p in parts]
    if not lora:  # untargeted projections are plain nn.Linear
        mods = [getattr(m, "base_layer", m) for m in mods]
    return torch.cat([m(x) for m in mods], dim=-1)


def segmented_info(token_slots: list[int], capacity: int) -> LoraBatchInfo:
    """What a CUDA graph's LoRA layers see: a fixed-capacity segment table."""
    indptr, slots = segment_table(token_slots, capacity)
    as_int = dict(dtype=torch.int32)
    return LoraBatchInfo.segmented(torch.tensor(indptr, **as_int), torch.tensor(slots, **as_int))


@pytest.mark.parametrize("kernel", ["sgmv", "bgmv", "segmented"])
def test_fused_slots_match_peft(tmp_path, kernel):
    """One mixed batch through fused qkv / gate_up slot buffers equals peft per adapter."""
    peft_a, ad_a, base = _peft_model(
        tmp_path, "a", 1, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj"]
    )
    peft_b, ad_b, _ = _peft_model(
        tmp_path,
        "b",
        2,
        r=4,
        lora_alpha=4,
        use_rslora=True,
        target_modules=["k_proj", "up_proj", "down_proj", "o_proj"],
        rank_pattern={"o_proj": 2},
        alpha_pattern={"down_proj": 2.0},  # per-module scales
    )
    peft_c, ad_c, _ = _peft_model(tmp_path, "c", 3, r=64, lora_alpha=32,
                                  target_modules=["q_proj", "o_proj", "up_proj"])
    slots = LoraSlots(base, num_slots=4, pool_rows=80, max_rank=64)
    slots.load(2, ad_a)
    slots.load(0, ad_b)
    slots.load(3, ad_c)  # rank 64 beside ranks 8 and 4, each at its own rows
    # tokens: 3 of adapter a, 2 base-only, 4 of adapter b, 1 of a, 3 of c
    info = dataclasses.replace(LoraBatchInfo.build([2, -1, 0, 2, 3], [3, 2, 4, 1, 3]),
                               kernel=kernel)
    if kernel == "segmented":  # capacity beyond the 13 rows: unused trailing segments
        info = segmented_info(info.token_slots.tolist(), 16)
    rows_a, rows_base, rows_b, rows_c = [0, 1, 2, 9], [3, 4], [5, 6, 7, 8], [10, 11, 12]
    gen = torch.Generator().manual_seed(0)
    for layer in range(base.num_layers):
        for fused in FUSED:
            in_features = 96 if fused == "down_proj" else 64
            x = torch.randn(13, in_features, generator=gen)
            y = _hf_fused(peft_a, layer, fused, x, lora=False)  # the engine's base projection
            slots.apply(y, x, layer, fused, info)
            expected = torch.empty_like(y)
            expected[rows_a] = _hf_fused(peft_a, layer, fused, x[rows_a])
            expected[rows_b] = _hf_fused(peft_b, layer, fused, x[rows_b])
            expected[rows_c] = _hf_fused(peft_c, layer, fused, x[rows_c])
            expected[rows_base] = _hf_fused(peft_a, layer, fused, x[rows_base], lora=False)
            torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


def test_slot_load_replaces_and_rejects_too_wide(tmp_path):
    _, ad, base = _peft_model(tmp_path, "c", 3, r=8, lora_alpha=8, target_modules=["q_proj"])
    slots = LoraSlots(base, num_slots=2, pool_rows=8, max_rank=8)
    slots.load(1, ad)
    assert slots.scales.tolist() == [0.0, 1.0] and slots.ranks[:, 1].tolist() == [8, 0, 0, 0]
    with pytest.raises(ValueError, match="no 8 free rows"):
        slots.load(0, ad)  # the pool is full
    slots.load(1, ad)  # loading over a slot frees its rows first
    slots.clear(1)
    assert slots.ranks.sum() == 0 and slots.scales.sum() == 0
    with pytest.raises(ValueError, match="exceeds the max LoRA rank 4"):
        LoraSlots(base, num_slots=1, pool_rows=8, max_rank=4).load(0, ad)
