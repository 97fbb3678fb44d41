"""Multi-LoRA through the whole engine equals peft's `PeftModel`, run per adapter.

A small random Llama with four peft adapters (different ranks, target modules, layers, rsLoRA
and rank patterns): one batch mixing requests for all of them with base requests gives the
logits peft gives (fp32, <= 1e-4) at every prefill and decode step, also with fewer device
slots than adapters (eviction) and chunked prefill. On SmolLM2, greedy tokens with two adapters
equal peft's `generate`.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from lora.adapter import AdapterError
from lora.manager import AdapterExists
from tests.tiny_models import random_peft_adapter, save_tiny

peft = pytest.importorskip("peft")

TOL = 1e-4
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "all8": dict(r=8, lora_alpha=16, target_modules=ALL),
    "qv4": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    "mlp16": dict(
        r=16, lora_alpha=32, target_modules=["gate_proj", "up_proj", "down_proj"],
        layers_to_transform=[0, 2], rank_pattern={"down_proj": 2}, alpha_pattern={"up_proj": 4},
    ),
    "ko2": dict(r=2, lora_alpha=2, target_modules=["k_proj", "o_proj"]),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_dir):
    """The tiny base (with SmolLM2's tokenizer files), its adapters, and peft holding them all."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora-engine")
    base = save_tiny(root / "base", "llama")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / f, base / f)
    paths = {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        torch.manual_seed(10 + i)
        hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        peft.get_peft_model(hf, peft.LoraConfig(init_lora_weights=False, **kw)).save_pretrained(
            root / name
        )
        paths[name] = root / name
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    ref = peft.PeftModel.from_pretrained(hf, paths["all8"], adapter_name="all8").eval()
    for name in list(ADAPTERS)[1:]:
        ref.load_adapter(paths[name], adapter_name=name)
    return base, paths, ref


class RecordingSampler:
    """Wraps the engine's sampler: keeps each sampled row's logits, keyed by request and the
    position it predicts."""

    def __init__(self, sampler) -> None:
        self.sampler, self.logits = sampler, {}

    def launch(self, logits, reqs, ok=None, offsets=None, positions=None):
        for row, req in zip(logits, reqs, strict=True):
            self.logits[(req.request_id, req.num_tokens - 1)] = row.clone()
        return self.sampler.launch(logits, reqs, ok, offsets, positions)

    def __getattr__(self, name):
        return getattr(self.sampler, name)


def _reference(ref, adapter: str | None, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        if adapter is None:
            with ref.disable_adapter():
                return ref(torch.tensor([ids])).logits[0]
        ref.set_adapter(adapter)
        return ref(torch.tensor([ids])).logits[0]


def _run_and_compare(llm: LLM, ref, requests: list[str | None], max_tokens: int = 5) -> None:
    torch.manual_seed(0)
    lengths = torch.randint(3, 40, (len(requests),)).tolist()
    prompts = [torch.randint(0, 320, (n,)).tolist() for n in lengths]
    params = [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, adapter=a)
              for a in requests]
    rec = llm.engine.runner.sampler = RecordingSampler(llm.engine.runner.sampler)
    try:
        outs = llm.generate(prompts, params)
    finally:
        llm.engine.runner.sampler = rec.sampler
    worst = 0.0
    for out, adapter in zip(outs, requests, strict=True):
        assert out.finish_reason == "length" and len(out.token_ids) == max_tokens
        ids = out.prompt_token_ids + out.token_ids
        expected = _reference(ref, adapter, ids)
        for pos in range(len(out.prompt_token_ids) - 1, len(ids) - 1):
            err = (rec.logits[(out.request_id, pos)] - expected[pos]).abs().max().item()
            worst = max(worst, err)
            assert err <= TOL, f"{adapter} at position {pos}: {err}"
    assert worst > 0 or all(a is None for a in requests)  # the check really compared numbers


def test_mixed_batch_equals_peft(tiny):
    base, paths, ref = tiny
    llm = LLM(model=str(base), max_loras=4, max_lora_rank=16, num_pages=128, page_size=4)
    for name, path in paths.items():
        llm.load_adapter(name, path)
    # All four adapters and the base model in one batch, two requests each; base-only rows in
    # between must stay exactly the base model.
    requests = [None, "all8", "qv4", "mlp16", "ko2"] * 2
    _run_and_compare(llm, ref, requests)
    # The adapters change the output (random non-zero B), so the comparison above is not vacuous.
    probe = [[5, 6, 7, 8]] * 2
    plain, tuned = llm.generate(probe, [SamplingParams(max_tokens=1, temperature=0, logprobs=0),
                                        SamplingParams(max_tokens=1, temperature=0, logprobs=0,
                                                       adapter="all8")])
    assert plain.logprobs[0].logprob != tuned.logprobs[0].logprob


def test_deferred_lora_output_equals_peft(tiny, monkeypatch):
    """The small decode graphs' deferred LoRA (`lora.layers.LoraLinear.deferred`: the base
    output, and the adapters' output as an fp32 delta that RoPE, the residual adds' RMSNorms and
    SiLU-and-mul add as they read it) gives peft's logits. On a CPU, which captures no graphs,
    every LoRA projection is made to defer, so the model's plumbing of each delta to its
    consumer runs here."""
    import engine.runner.models.llama as llama
    from lora.layers import LoraLinear

    deferred: set[str] = set()

    def always(proj, x, x_rows=None, max_rows=0):
        info = getattr(proj, "ctx", None) and proj.ctx.info
        if not isinstance(proj, LoraLinear) or info is None or not info.has_lora:
            return proj(x, x_rows), None
        deferred.add(proj.fused)
        return proj.base(x, x_rows), proj.ctx.slots.delta(x, proj.layer, proj.fused, info)

    monkeypatch.setattr(llama, "deferred_projection", always)
    base, paths, ref = tiny
    llm = LLM(model=str(base), max_loras=4, max_lora_rank=16, num_pages=128, page_size=4)
    for name, path in paths.items():
        llm.load_adapter(name, path)
    _run_and_compare(llm, ref, [None, "all8", "qv4", "mlp16", "ko2"])
    assert deferred == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}


def test_laptop_defaults_serve_rank_64_beside_rank_8(tiny, tmp_path):
    """With the CPU's default LoRA settings (4 adapters, rank up to 128, 128 pool rows), a
    rank-64 adapter runs in one batch with rank-8, rank-4 and base requests, each at its own
    rows of the pool, with peft's logits."""
    from transformers import AutoModelForCausalLM

    base, paths, ref = tiny
    torch.manual_seed(20)
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    wide = dict(r=64, lora_alpha=32, target_modules=["q_proj", "v_proj", "o_proj", "up_proj"])
    peft.get_peft_model(hf, peft.LoraConfig(init_lora_weights=False, **wide)).save_pretrained(
        tmp_path / "wide64")
    ref.load_adapter(tmp_path / "wide64", adapter_name="wide64")
    llm = LLM(model=str(base), num_pages=128, page_size=4)
    cfg = llm.engine.cfg
    assert (cfg.max_loras, cfg.max_lora_rank, cfg.lora_pool_rows) == (4, 128, 128)
    for name in ("all8", "qv4"):
        llm.load_adapter(name, paths[name])
    llm.load_adapter("wide64", tmp_path / "wide64")
    _run_and_compare(llm, ref, ["wide64", "all8", None, "qv4", "wide64", "all8"])
    slots = llm.engine.adapters.slots
    assert sorted(slots.ranks[0].tolist()) == [0, 4, 8, 64]  # q/k/v rows of each adapter
    ref.delete_adapter("wide64")


def test_fewer_slots_than_adapters_and_chunked_prefill(tiny):
    base, paths, ref = tiny
    llm = LLM(model=str(base), max_loras=2, max_cpu_loras=2, max_lora_rank=16, num_pages=128,
              page_size=4, max_num_batched_tokens=24)
    for name, path in paths.items():
        llm.load_adapter(name, path)
    # Four adapters, two slots: requests wait for a slot without blocking the base requests;
    # the host cache holds two, so the others are read from disk again (off the step loop).
    _run_and_compare(llm, ref, ["ko2", None, "all8", "qv4", None, "mlp16", "all8"], max_tokens=4)
    stats = llm.engine.adapters.stats
    assert stats.evictions["device"] >= 2 and stats.evictions["host"] >= 2
    assert stats.loads["host"] > len(paths)  # some were read from disk again


def test_load_unload_and_bad_input(tiny, tmp_path):
    base, paths, _ = tiny
    llm = LLM(model=str(base), max_loras=2, max_lora_rank=8, num_pages=64, page_size=4)
    llm.load_adapter("a", paths["all8"])
    with pytest.raises(AdapterExists):
        llm.load_adapter("a", paths["qv4"])
    with pytest.raises(AdapterError) as e:  # rank 16 > --max-lora-rank 8
        llm.load_adapter("big", paths["mlp16"])
    assert any("exceeds the max LoRA rank 8" in p for p in e.value.problems)
    with pytest.raises(AdapterError):
        llm.load_adapter("bad name!", paths["qv4"])
    assert llm.engine.adapters.get("default", "big") is None  # nothing half-registered
    with pytest.raises(ValueError, match="unknown adapter 'nope'"):
        llm.generate([1, 2, 3], SamplingParams(adapter="nope"))
    out = llm.generate([1, 2, 3], SamplingParams(max_tokens=2, adapter="a"))[0]
    assert len(out.token_ids) == 2
    assert llm.unload_adapter("a") and not llm.unload_adapter("a")
    with pytest.raises(ValueError, match="unknown adapter"):
        llm.generate([1, 2, 3], SamplingParams(adapter="a"))
    # A registered folder that became unreadable fails its requests; the others still run.
    broken = Path(shutil.copytree(paths["qv4"], tmp_path / "qv4"))
    llm = LLM(model=str(base), max_loras=1, max_cpu_loras=1, max_lora_rank=8, num_pages=64,
              page_size=4)
    llm.load_adapter("gone", broken)
    llm.load_adapter("other", paths["ko2"])  # evicts "gone" from the host cache
    (broken / "adapter_model.safetensors").write_bytes(b"\0" * 10)
    outs = llm.generate([[1, 2, 3]] * 2, [SamplingParams(max_tokens=2, adapter="gone"),
                                           SamplingParams(max_tokens=2)])
    assert outs[0].finish_reason == "error" and outs[1].finish_reason == "length"


# -- SmolLM2 ---------------------------------------------------------------------------------

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def test_smollm2_greedy_equals_peft_generate(smollm2, hf_smollm2, tmp_path):
    random_peft_adapter(hf_smollm2, tmp_path / "poet", 1, r=8, lora_alpha=16,
                     target_modules=["q_proj", "v_proj"])
    random_peft_adapter(hf_smollm2, tmp_path / "coder", 2, r=16, lora_alpha=16, target_modules=ALL)
    names = ["poet", "coder"]
    for name in names:
        smollm2.load_adapter(name, tmp_path / name)
    try:
        jobs = [(p, a) for p in PROMPTS for a in (None, *names)]
        params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, adapter=a)
                  for _, a in jobs]
        outs = smollm2.generate([p for p, _ in jobs], params)
    finally:
        for name in names:
            smollm2.unload_adapter(name)

    ref = peft.PeftModel.from_pretrained(copy.deepcopy(hf_smollm2), tmp_path / "poet",
                                         adapter_name="poet").eval()
    ref.load_adapter(tmp_path / "coder", adapter_name="coder")
    texts = {}
    for (prompt, adapter), out in zip(jobs, outs, strict=True):
        ids = smollm2.tokenizer(prompt, return_tensors="pt").input_ids
        kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                  do_sample=False)
        with torch.no_grad():
            if adapter is None:
                with ref.disable_adapter():
                    expected = ref.generate(input_ids=ids, **kw)
            else:
                ref.set_adapter(adapter)
                expected = ref.generate(input_ids=ids, **kw)
        assert out.token_ids == expected[0, ids.shape[1]:].tolist(), (prompt, adapter)
        texts[(prompt, adapter)] = out.text
    # The adapters change some continuations (else the test would not test them).
    assert any(texts[(p, a)] != texts[(p, None)] for p in PROMPTS for a in names), texts


def test_manager_pins_slots_and_loads_in_background(tiny):
    base, paths, _ = tiny
    llm = LLM(model=str(base), max_loras=1, max_cpu_loras=1, max_lora_rank=16, num_pages=32,
              page_size=4)
    m = llm.engine.adapters
    m.add("t", "a", paths["all8"])
    m.add("t", "b", paths["qv4"])  # the host cache holds one: "a" goes back to disk only
    assert [i.tier for i in m.list("t")] == ["disk", "host"]
    ra, rb = m.attach("t", "a"), m.attach("t", "b")  # two requests' leases
    assert ra.uid != rb.uid and ra.slot == rb.slot == -1
    assert not m.admit(ra)  # starts the disk read in the loader thread
    m.wait_for_loads(30)
    assert m.admit(ra) and ra.slot == 0 and m.get("t", "a").tier == "device"
    assert not m.admit(rb)  # the only slot is pinned by ra
    m.release(ra)
    assert not m.admit(rb)  # reading "a" evicted "b" from the one-adapter host cache
    m.wait_for_loads(30)
    assert m.admit(rb) and rb.slot == 0 and ra.slot == -1
    assert m.stats.evictions["device"] == 1 and m.num_resident == {"device": 1, "host": 1}
    assert m.get("other-tenant", "a") is None and m.list("other-tenant") == []


def test_speculative_loop_with_adapters(tiny):
    """The overlapped speculative loop (engine/spec/loop.py) verifies the drafts of base and
    adapter rows in one forward, each sequence a segment of 1 + k tokens: the greedy tokens of
    plain decoding. Every step verifies (min_acceptance 0), whatever the lookup found."""
    from engine.spec.speculative import Speculator

    base, paths, _ = tiny
    llm = LLM(model=str(base), max_loras=4, max_lora_rank=16, num_pages=128, page_size=4)
    for name, path in paths.items():
        llm.load_adapter(name, path)
    requests = [None, "all8", "qv4", None, "mlp16", "all8"]
    gen = torch.Generator().manual_seed(1)
    prompts = [(torch.randint(0, 320, (n,), generator=gen).tolist() * 3)[: 3 * n]
               for n in (3, 6, 10, 4, 8, 5)]  # repeats: the lookup finds matches
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, adapter=a)
              for a in requests]
    plain = [o.token_ids for o in llm.generate(prompts, params)]
    eng = llm.engine
    eng.speculator, eng.overlap = Speculator(3, max_batch=8, min_acceptance=0.0), True
    try:
        got = [o.token_ids for o in llm.generate(prompts, params)]
        stats = eng.speculator.stats
    finally:
        eng.speculator, eng.overlap = None, False
    assert got == plain
    assert stats.forwards >= 2 * len(prompts)
