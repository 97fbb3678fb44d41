"""FP8 linear layers (kernels/fp8.py) against their references: the Triton activation
quantization against torch's, byte for byte (CPU interpreter); an `Fp8Linear` against the
dequantize-then-matmul formula and against the full-precision layer; FP8 checkpoints
(compressed-tensors, per-tensor and per-channel scales) loading to the same layers as
quantizing at load; LoRA over an FP8 base; and the real SmolLM2 quantized at load, within the
tolerance docs/quantization.md states of its float32 self."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from engine.config import ModelConfig, ModelLoadError
from engine.core.request import Request
from engine.core.scheduler import ScheduledSeq
from engine.runner.loader import PROJECTIONS, load_model
from engine.runner.model_runner import ModelRunner
from engine.runner.step_inputs import StepInputs
from engine.sampling.params import SamplingParams
from kernels.fp8 import (
    FP8,
    Fp8Linear,
    fp8_linear,
    quantize_rows_torch,
    quantize_rows_triton,
    quantize_weight,
)
from kernels.linear import Linear
from tests.tiny_models import save_tiny


def _fake_quant_rows(x: torch.Tensor) -> torch.Tensor:
    """x's rows through FP8 and back, written out independently of kernels/fp8.py."""
    amax = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    q = (x.float() * (448.0 / amax)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.float() * (amax / 448.0)


@pytest.mark.parametrize("shape", [(1, 64), (5, 100), (3, 4100)])  # 4100: two blocks a row
def test_triton_row_quantization_matches_torch(shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[0])[:, None]
    x[0, :3] = torch.tensor([0.0, 1e-9, -5e4])  # a zero, a subnormal after scaling, the max
    x = x.to("cuda" if torch.cuda.is_available() else "cpu")
    q, s = quantize_rows_triton(x)
    ref_q, ref_s = quantize_rows_torch(x)
    assert q.dtype == FP8 and s.shape == (shape[0], 1)
    assert torch.equal(s, ref_s)
    differ = q.view(torch.uint8) != ref_q.view(torch.uint8)
    if torch.cuda.is_available():
        assert not differ.any()
        return
    # Triton's CPU interpreter drops the carry when round-to-nearest-even rounds a value up
    # into the next power of two (31.1 -> 16 instead of 32); GPUs convert in hardware (the
    # assert above). Any other difference fails.
    want, got = ref_q.float()[differ], q.float()[differ]
    assert (got * 2 == want).all() and (torch.frexp(want).mantissa.abs() == 0.5).all()


@pytest.mark.parametrize("m, k, n, split_k", [(1, 256, 96, 1), (5, 300, 64, 3), (64, 512, 64, 2)])
def test_triton_gemm_matches_the_reference(m: int, k: int, n: int, split_k: int) -> None:
    """The decode-sized FP8 product (ragged K and N, split K summed atomically) against the
    fp32 formula."""
    from kernels.fp8 import fp8_gemm_triton, fp8_matmul_reference

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(m + k)
    qx, sx = quantize_rows_torch(torch.randn(m, k, generator=g).to(dev))
    qw, sw = quantize_weight(torch.randn(n, k, generator=g).to(dev))
    got = fp8_gemm_triton(qx, sx, qw, sw, torch.float32, block_n=32, block_k=64,
                          split_k=split_k)
    ref = fp8_matmul_reference(qx, sx, qw, sw, torch.float32)
    # Hopper's FP8 tensor cores keep fewer accumulator bits than fp32 (measured: 3e-4 of the
    # largest value); the CPU interpreter sums in fp32.
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-3 * float(ref.abs().max()))


@pytest.mark.parametrize("tokens, width", [(1, 96), (5, 300), (4, 1100)])
def test_fused_kernels_quantize_their_rows_as_quantize_rows(tokens: int, width: int) -> None:
    """`add_rms_norm` and `silu_mul` with the rows of their output quantized in the same
    kernel (the input of an FP8 projection): the same output as without, and the same bytes
    and scales as `quantize_rows_triton` of it (Triton on either device; the interpreter on
    CPU)."""
    from kernels import fused

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(tokens * width)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dev, torch.bfloat16)

    x, r, w = randn(tokens, width, scale=3.0), randn(tokens, width), randn(width) + 1
    want_normed, want_sum = fused.add_rms_norm_triton(x.clone(), r.clone(), w, 1e-5)
    normed, summed, rows = fused.add_rms_norm_fp8_triton(x.clone(), r.clone(), w, 1e-5)
    assert torch.equal(normed, want_normed) and torch.equal(summed, want_sum)
    want_q, want_scale = quantize_rows_triton(normed)
    assert torch.equal(rows.q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(rows.scale, want_scale)

    gate_up = randn(tokens, 2 * width, scale=4.0)
    out, rows = fused.silu_mul_fp8_triton(gate_up)
    assert torch.equal(out, fused.silu_mul_triton(gate_up))
    want_q, want_scale = quantize_rows_triton(out)
    assert torch.equal(rows.q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(rows.scale, want_scale)


def test_all_zero_rows_quantize_to_zeros() -> None:
    q, s = quantize_rows_torch(torch.zeros(2, 32))
    assert (q.float() == 0).all() and (s > 0).all()
    qw, sw = quantize_weight(torch.zeros(3, 16))
    assert (qw.float() == 0).all() and torch.isfinite(sw).all()


def test_weight_quantization_error_is_within_e4m3_rounding() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 80, generator=g) * torch.logspace(-2, 1, 48)[:, None]
    q, s = quantize_weight(w)
    deq = q.float() * s[:, None]
    # E4M3 keeps 3 mantissa bits: a rounding error of at most 2^-4 of the value (normals), or
    # 2^-10 of the scale (subnormals, below 2^-6 * scale).
    bound = torch.maximum(w.abs() * 2.0**-4, s[:, None] * 2.0**-10) * (1 + 1e-6)
    assert ((deq - w).abs() <= bound).all()
    assert torch.allclose(deq.abs().amax(dim=1), w.abs().amax(dim=1))  # the max is exact


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_is_the_dequantized_product(bias: bool) -> None:
    g = torch.Generator().manual_seed(1)
    lin = Linear(96, 64, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(64, 96, generator=g) / 10)
        if bias:
            lin.bias.copy_(torch.randn(64, generator=g))
    fp8 = Fp8Linear.quantize(lin)
    assert fp8.weight.dtype == FP8 and fp8.weight_scale.shape == (64,)
    x = torch.randn(2, 7, 96, generator=g)
    with torch.no_grad():
        got, full = fp8(x), lin(x)
    ref = F.linear(_fake_quant_rows(x), fp8.dequantized(), lin.bias)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # ... and close to the full-precision layer: two E4M3 roundings per product.
    rel = float((got - full).norm() / full.norm())
    assert rel < 0.05, rel


BLOCK = 48  # a block-wise checkpoint's blocks: ragged over the tiny model's 64 and 160


def _tiny_fp8_checkpoint(src: Path, dst: Path, strategy: str) -> None:
    """`src`'s checkpoint as the FP8 tools write one, every q/k/v/o/gate/up/down weight FP8:
    "channel" and "tensor" as llm-compressor (compressed-tensors; a `weight_scale` of [out, 1]
    or []), "fbgemm" as fbgemm_fp8 (per channel), "block" as transformers' block-wise FP8
    (`weight_scale_inv`, one per BLOCK x BLOCK block)."""
    state = {k: t for f in sorted(src.glob("*.safetensors")) for k, t in load_file(f).items()}
    for name in list(state):
        if not name.endswith("_proj.weight"):
            continue
        w = state[name].float()
        if strategy in ("channel", "fbgemm"):
            q, s = quantize_weight(w)
            state[name + "_scale"] = s[:, None]
        elif strategy == "block":
            rows, cols = -(-w.shape[0] // BLOCK), -(-w.shape[1] // BLOCK)
            s = torch.empty(rows, cols)
            q = torch.empty(w.shape, dtype=FP8)
            for i in range(rows):
                for j in range(cols):
                    b = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
                    s[i, j] = b.abs().max() / 448.0
                    q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (
                        b / s[i, j]).clamp(-448, 448).to(FP8)
            state[name + "_scale_inv"] = s
        else:
            s = w.abs().max() / 448.0
            q = (w / s).clamp(-448, 448).to(FP8)
            state[name + "_scale"] = s.reshape(())
        state[name] = q
    dst.mkdir()
    save_file(state, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    if strategy == "block":
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "weight_block_size": [BLOCK, BLOCK]}
    elif strategy == "fbgemm":
        cfg["quantization_config"] = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                                      "modules_to_not_convert": ["lm_head"]}
    else:
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                            "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                      "dynamic": True}}},
            "ignore": ["lm_head"]}
    (dst / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny"), "qwen2")  # q/k/v biases too


def _prefill_logits(model, ids: list[int], kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    runner = ModelRunner(model, num_pages=(len(ids) + 15) // 16 + 1, page_size=16,
                         kv_dtype=kv_dtype)
    req = Request("r", ids, SamplingParams())
    req.pages = list(range((len(ids) + 15) // 16))
    seqs = [ScheduledSeq(req, 0, len(ids))]
    ids_t, pos, meta, _ = runner._prepare(StepInputs.build(seqs, runner.page_size))
    with torch.inference_mode():
        return runner.model.compute_logits(runner.model(ids_t, pos, runner.kv_caches, meta))


@pytest.mark.parametrize("strategy", ["channel", "fbgemm"])
def test_channel_checkpoint_loads_as_quantizing_at_load(tiny: Path, tmp_path: Path,
                                                        strategy: str) -> None:
    _tiny_fp8_checkpoint(tiny, tmp_path / "fp8", strategy)
    assert ModelConfig.from_dir(tmp_path / "fp8").quantization == "fp8"
    loaded = load_model(tmp_path / "fp8", torch.float32, "cpu")
    quantized = load_model(tiny, torch.float32, "cpu", quantization="fp8")
    for a, b in zip(loaded.layers, quantized.layers, strict=True):
        for owner, name in PROJECTIONS:
            la, lb = (m.get_submodule(owner).get_submodule(name) for m in (a, b))
            assert isinstance(la, Fp8Linear) and isinstance(lb, Fp8Linear)
            assert torch.equal(la.weight.view(torch.uint8), lb.weight.view(torch.uint8))
            assert torch.equal(la.weight_scale, lb.weight_scale)
    ids = list(range(3, 40))
    torch.testing.assert_close(_prefill_logits(loaded, ids), _prefill_logits(quantized, ids))


def test_tensor_scales_become_row_scales(tiny: Path, tmp_path: Path) -> None:
    _tiny_fp8_checkpoint(tiny, tmp_path / "fp8", "tensor")
    model = load_model(tmp_path / "fp8", torch.float32, "cpu")
    state = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    qkv = model.layers[1].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear)
    parts = [f"model.layers.1.self_attn.{x}_proj.weight" for x in "qkv"]
    want = torch.cat([state[p].float() * state[p + "_scale"] for p in parts])
    torch.testing.assert_close(qkv.dequantized(), want, rtol=0, atol=0)
    full = load_model(tiny, torch.float32, "cpu")
    ids = list(range(5, 45))
    ref, got = _prefill_logits(full, ids), _prefill_logits(model, ids)
    rel = float((got - ref).norm() / ref.norm())
    # 0.12 measured on this random model (weights scaled up); per channel it is smaller.
    channel = load_model(tiny, torch.float32, "cpu", quantization="fp8")
    rel_channel = float((_prefill_logits(channel, ids) - ref).norm() / ref.norm())
    assert rel_channel < rel < 0.25, (rel_channel, rel)


def test_block_checkpoint_is_requantized_per_row(tiny: Path, tmp_path: Path) -> None:
    """Block-wise scales become row scales: the block-dequantized weight quantized again, one
    more E4M3 rounding (docs/quantization.md)."""
    _tiny_fp8_checkpoint(tiny, tmp_path / "fp8", "block")
    model = load_model(tmp_path / "fp8", torch.float32, "cpu")
    state = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    down = model.layers[2].mlp.down_proj
    assert isinstance(down, Fp8Linear)
    key = "model.layers.2.mlp.down_proj.weight"
    s = state[key + "_scale_inv"].repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    w = state[key].float() * s[: down.out_features, : down.in_features]
    bound = torch.maximum(w.abs() * 2.0**-4, down.weight_scale[:, None] * 2.0**-10) * 1.000001
    assert ((down.dequantized() - w).abs() <= bound).all()
    full = load_model(tiny, torch.float32, "cpu")
    ids = list(range(5, 45))
    ref, got = _prefill_logits(full, ids), _prefill_logits(model, ids)
    assert float((got - ref).norm() / ref.norm()) < 0.25


def test_fp8_checkpoint_without_scales_is_refused(tiny: Path, tmp_path: Path) -> None:
    _tiny_fp8_checkpoint(tiny, tmp_path / "fp8", "channel")
    state = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    del state["model.layers.0.mlp.down_proj.weight_scale"]
    save_file(state, str(tmp_path / "fp8" / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="down_proj.weight_scale"):
        load_model(tmp_path / "fp8", torch.float32, "cpu")


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "awq", "bits": 4}, "awq"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group"}}}}, "compressed-tensors"),
])
def test_unsupported_quantization_is_named(qc: dict, match: str, tiny: Path) -> None:
    cfg = json.loads((tiny / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=match):
        ModelConfig.from_hf({**cfg, "quantization_config": qc})


class _FakeQuantLinear(torch.nn.Module):
    """The FP8 layer written out: rows of x through FP8 and back, times the dequantized
    weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_fake_quant_rows(x), self.weight, self.bias)


def test_lora_over_an_fp8_base_equals_peft_over_the_dequantized_base(
        tmp_path: Path, smollm2_dir: Path) -> None:
    """peft's LoRA over an HF model whose projections are the FP8 formula: the engine's FP8
    base with the adapter gives the same logits (fp32), prefill and decode."""
    import shutil

    from transformers import AutoModelForCausalLM

    from engine import LLM

    peft = pytest.importorskip("peft")
    base = save_tiny(tmp_path / "base", "llama")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / f, base / f)
    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft.get_peft_model(hf, peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets,
                                            init_lora_weights=False)).save_pretrained(
        tmp_path / "lora")
    llm = LLM(model=str(base), quantization="fp8", max_loras=2, max_lora_rank=8,
              num_pages=64, page_size=4)
    llm.load_adapter("a", tmp_path / "lora")
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    ref = peft.PeftModel.from_pretrained(hf, tmp_path / "lora").eval()
    ours = llm.engine.model
    attn = ours.layers[0].self_attn
    sizes = {"self_attn": [attn.q_size, attn.kv_size, attn.kv_size],
             "mlp": [ours.cfg.intermediate_size] * 2}
    for i, layer in enumerate(ref.base_model.model.model.layers):
        for owner, name in PROJECTIONS:
            mine = ours.layers[i].get_submodule(owner).get_submodule(name).base
            assert isinstance(mine, Fp8Linear)
            w = mine.dequantized()
            fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                     "gate_up_proj": ("gate_proj", "up_proj")}.get(name, (name,))
            pieces = w.split(sizes[owner]) if len(fused) > 1 else (w,)
            for part, piece in zip(fused, pieces, strict=True):
                lora = layer.get_submodule(owner).get_submodule(part)
                lora.base_layer = _FakeQuantLinear(piece, None)
    ids = [5, 9, 33, 2, 71, 40, 8, 19, 27, 3, 11]
    out = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                             adapter="a", logprobs=0))[0]
    with torch.no_grad():
        logits = ref(torch.tensor([ids + out.token_ids])).logits[0]
    want = logits.log_softmax(-1)
    for k, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = want[len(ids) - 1 + k]
        assert tok == int(row.argmax()), f"token {k}"
        assert abs(lp.logprob - float(row[tok])) <= 1e-3, f"token {k}"
    plain = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, logprobs=0))[0]
    assert plain.logprobs[0].logprob != out.logprobs[0].logprob  # the adapter did something


def test_fp8_linear_takes_any_leading_shape() -> None:
    q, s = quantize_weight(torch.randn(16, 32))
    x = torch.randn(2, 3, 32)
    assert fp8_linear(x, q, s).shape == (2, 3, 16)


TEXT = ("<|im_start|>user\nWrite a short Python function that returns the n-th Fibonacci number, "
        "and explain how it works.<|im_end|>\n<|im_start|>assistant\nHere is a simple iterative "
        "version:\n\ndef fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n"
        "        a, b = b, a + b\n"
        "    return a\n\nIt keeps the last two numbers and adds them n times, so it runs in linear "
        "time and constant memory.<|im_end|>\n<|im_start|>user\nWhat is the capital of France, and "
        "what river runs through it?<|im_end|>\n<|im_start|>assistant\nThe capital of France is "
        "Paris, and the Seine runs through it.<|im_end|>\n")


@pytest.mark.parametrize("kv", [None, FP8], ids=["fp8_weights", "fp8_weights_and_kv"])
def test_smollm2_fp8_stays_close_to_float32(smollm2_dir: Path, kv: torch.dtype | None) -> None:
    """The real SmolLM2 quantized at load (and with an FP8 KV cache, scales 1) against its
    float32 self, teacher-forced on a chat: greedy agreement and the mean distance of the
    text's token log-probs (the figures are in docs/quantization.md)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(smollm2_dir)(TEXT)["input_ids"]
    full = load_model(smollm2_dir, torch.float32, "cpu")
    ref = _prefill_logits(full, ids).log_softmax(-1)
    del full
    fp8 = load_model(smollm2_dir, torch.float32, "cpu", quantization="fp8")
    got = _prefill_logits(fp8, ids, kv).log_softmax(-1)
    target = torch.tensor(ids[1:])
    agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    lp_ref = ref[:-1].gather(1, target[:, None])[:, 0]
    lp_got = got[:-1].gather(1, target[:, None])[:, 0]
    dist = float((lp_got - lp_ref).abs().mean())
    kl = float((ref.exp() * (ref - got)).sum(-1).mean())
    print(f"SMOLLM2 kv={kv} tokens={len(ids)} agree={agree:.4f} dlogp={dist:.4f} kl={kl:.4f}")
    # Measured (141 tokens): weights 0.90 agreement, mean |d log p| 0.139, KL 0.027 nats;
    # weights and KV 0.91, 0.169, 0.035.
    assert agree >= 0.8 and dist <= 0.25 and kl <= 0.08, (agree, dist, kl)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 37, 256])
def test_scaled_mm_matches_the_reference_on_the_gpu(rows: int) -> None:
    """The FP8 tensor-core product (row-wise scales, bf16 out) against the fp32 formula."""
    from kernels.fp8 import fp8_matmul_reference

    torch.manual_seed(rows)
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16) / 64
    q, s = quantize_weight(w)
    got = fp8_linear(x, q, s)
    qx, sx = quantize_rows_torch(x)
    ref = fp8_matmul_reference(qx, sx, q, s, torch.float32)
    assert got.dtype == torch.bfloat16
    # bf16's rounding, and the tensor cores' shorter FP8 accumulator (see above).
    torch.testing.assert_close(got.float(), ref, rtol=2**-7, atol=1e-3 * float(ref.abs().max()))


def test_weight_values_follow_the_weight() -> None:
    """Off FP8 tensor cores, `Fp8Linear` converts its weight to fp32 once and keeps it; a new
    weight, assigned or written in place, is converted again."""
    gen = torch.Generator().manual_seed(5)
    layer = Fp8Linear.quantize(torch.nn.Linear(32, 16, bias=False))
    x = torch.randn(3, 32, generator=gen)
    assert torch.equal(layer(x), fp8_linear(x, layer.weight, layer.weight_scale))
    assert layer.weight_values() is layer.weight_values()
    q, s = quantize_weight(torch.randn(16, 32, generator=gen))
    layer.weight.data, layer.weight_scale.data = q, s
    assert torch.equal(layer(x), fp8_linear(x, q, s))
    q2, _ = quantize_weight(torch.randn(16, 32, generator=gen))
    with torch.no_grad():
        layer.weight.copy_(q2)
    assert torch.equal(layer(x), fp8_linear(x, q2, s))
