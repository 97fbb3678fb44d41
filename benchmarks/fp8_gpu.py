"""FP8 on the GPU: the same synthetic model in bf16, with FP8 weights, and with FP8 weights and
an FP8 KV cache, one after the other in one process (the ratios come from the same run).

Per variant: greedy decode at batch 64 over 1k-token contexts (tokens/s, ms per step, and the
roofline fraction: weight + KV bytes per step over the copy bandwidth measured here), the same
with 8 adapters (rank 16, all projections), 16 x 7.9k contexts (`long_ctx_roofline_16x8k`),
and prefill of 16 x 2k prompts (MFU against the matmul rate of the variant's weights, bf16 or
FP8, measured here). The KV pool's pages at the same memory give `fp8_kv_tokens_vs_bf16`.

    python benchmarks/fp8_gpu.py --out fp8.json [--model synthetic:llama3-8b]

Writes the JSON and a markdown table beside it (`--out` with .md).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from gpu_common import (
    adapter_bytes,
    copy_bandwidth,
    decode_round,
    greedy,
    kv_bytes_per_token,
    profile,
    random_prompts,
    weight_bytes,
    write_adapter,
)
from gpu_e2e import matmul_rate, model_flops_per_token

from engine import LLM
from engine.config import ModelConfig, default_cache_dir
from engine.runner.loader import resolve_model_dir
from kernels.fp8 import quantize_rows

RANK = 16
VARIANTS = {"bf16": {}, "fp8": {"quantization": "fp8"},
            "fp8_kv": {"quantization": "fp8", "kv_cache_dtype": "fp8"}}
KV_GB = 24.0  # the pool of every variant: the FP8 KV holds twice the pages in it


def fp8_matmul_rate(n: int = 8192) -> float:
    """FP8 matmul FLOP/s with row-wise scales and bf16 output, as the layers run it (median
    of 10 products of n x n)."""
    a, sa = quantize_rows(torch.randn(n, n, device="cuda", dtype=torch.bfloat16))
    b, sb = quantize_rows(torch.randn(n, n, device="cuda", dtype=torch.bfloat16))

    def mm() -> torch.Tensor:
        return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb.view(1, -1),
                                out_dtype=torch.bfloat16)

    for _ in range(3):
        mm()
    times = []
    for _ in range(10):
        torch.cuda.synchronize()
        t = time.perf_counter()
        mm()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times)


def run_variant(name: str, model: str, adapters: Path, bw: float, rates: dict, steps: int,
                profile_steps: int = 0) -> dict:
    kw = VARIANTS[name]
    t = time.monotonic()
    llm = LLM(model, dtype="bfloat16", device="cuda", max_num_seqs=64,
              max_num_batched_tokens=16384, kv_cache_gb=KV_GB, max_loras=8, max_cpu_loras=8,
              max_lora_rank=RANK, **kw)
    cfg = llm.engine.model_config
    kv_item = 1 if kw.get("kv_cache_dtype") == "fp8" else 2
    w = weight_bytes(llm.engine.model)
    r: dict = {"load_s": round(time.monotonic() - t, 1), "weight_bytes": w,
               "num_pages": llm.engine.cfg.num_pages}
    for k in range(8):
        llm.load_adapter(f"a{k}", adapters / f"f{k}")
    vocab = cfg.vocab_size
    prompts = random_prompts(64, 1024, seed=1, vocab=vocab)
    decode_round(llm, prompts, lambda i, n: greedy(n), 2)  # graphs, autotuning
    decode_round(llm, prompts, lambda i, n: greedy(n, f"a{i % 8}"), 2)
    for key, make in (("base", lambda i, n: greedy(n)),
                      ("lora_8", lambda i, n: greedy(n, f"a{i % 8}"))):
        d = decode_round(llm, prompts, make, steps)
        nbytes = w + 64 * d.mean_context * kv_bytes_per_token(cfg, kv_item)
        nbytes += (8 * adapter_bytes(cfg, RANK, 2)) if key == "lora_8" else 0
        r[f"{key}_b64"] = {"tok_s": round(d.tok_s, 1), "step_ms": round(d.step_s * 1e3, 3),
                           "roofline_fraction": round(nbytes / bw / d.step_s, 3)}
    if profile_steps:
        r["profile_b64"] = profile(lambda e=llm: decode_round(e, prompts, lambda i, n: greedy(n),
                                                              profile_steps), top=12)
    long = random_prompts(16, 7936, seed=11, vocab=vocab)
    d = decode_round(llm, long, lambda i, n: greedy(n), steps)
    nbytes = w + 16 * d.mean_context * kv_bytes_per_token(cfg, kv_item)
    r["long_ctx_16x8k"] = {"step_ms": round(d.step_s * 1e3, 3),
                           "roofline_fraction": round(nbytes / bw / d.step_s, 3)}
    batch = random_prompts(16, 2048, seed=5, vocab=vocab)
    llm.generate(batch[:4], [greedy(1)] * 4)
    llm.engine.reset_prefix_cache()
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(batch, [greedy(1)] * 16)
    torch.cuda.synchronize()
    tok_s = 16 * 2048 / (time.perf_counter() - t)
    rate = rates["fp8" if "quantization" in kw else "bf16"]
    r["prefill"] = {"prompt_tok_s": round(tok_s),
                    "mfu": round(tok_s * model_flops_per_token(cfg, 2048) / rate, 3)}
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return r


def derive(v: dict) -> dict:
    bf16, fp8, kv = v.get("bf16"), v.get("fp8"), v.get("fp8_kv")
    out: dict = {}
    if bf16 and fp8:
        out["fp8_weights_vs_bf16_b64"] = round(
            fp8["base_b64"]["tok_s"] / bf16["base_b64"]["tok_s"], 3)
        out["fp8_lora_vs_fp8_base_b64"] = round(
            fp8["lora_8_b64"]["tok_s"] / fp8["base_b64"]["tok_s"], 3)
        out["fp8_roofline_fraction_b64"] = fp8["base_b64"]["roofline_fraction"]
        out["fp8_prefill_mfu"] = fp8["prefill"]["mfu"]
    if bf16 and kv:
        out["fp8_vs_bf16_b64"] = round(kv["base_b64"]["tok_s"] / bf16["base_b64"]["tok_s"], 3)
        out["fp8_kv_roofline_fraction_b64"] = kv["base_b64"]["roofline_fraction"]
        out["fp8_kv_tokens_vs_bf16"] = round(kv["num_pages"] / bf16["num_pages"], 3)
        out["long_ctx_roofline_16x8k_fp8_kv"] = kv["long_ctx_16x8k"]["roofline_fraction"]
        out["fp8_kv_lora_vs_base_b64"] = round(
            kv["lora_8_b64"]["tok_s"] / kv["base_b64"]["tok_s"], 3)
    return out


def render(r: dict) -> str:
    lines = [f"# FP8 on {r['device']} ({r['model']})", "",
             f"Copy bandwidth {r['copy_bw'] / 1e12:.2f} TB/s; matmul bf16 "
             f"{r['rates']['bf16'] / 1e12:.0f} TFLOP/s, FP8 {r['rates']['fp8'] / 1e12:.0f} "
             "TFLOP/s (measured in the same process).", "",
             "| variant | weights GB | b64 tok/s | b64 ms/step | b64 roofline | 8 adapters tok/s "
             "| 16x8k ms/step | 16x8k roofline | prefill tok/s | prefill MFU | KV pages |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, v in r["variants"].items():
        if "error" in v:
            lines.append(f"| {name} | {v['error']} |")
            continue
        lines.append(
            f"| {name} | {v['weight_bytes'] / 1e9:.2f} | {v['base_b64']['tok_s']} | "
            f"{v['base_b64']['step_ms']} | {v['base_b64']['roofline_fraction']} | "
            f"{v['lora_8_b64']['tok_s']} | {v['long_ctx_16x8k']['step_ms']} | "
            f"{v['long_ctx_16x8k']['roofline_fraction']} | {v['prefill']['prompt_tok_s']} | "
            f"{v['prefill']['mfu']} | {v['num_pages']} |")
    lines += ["", "| figure | value |", "|---|---|"]
    lines += [f"| `{k}` | {v} |" for k, v in r["figures"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="synthetic:llama3-8b")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--profile-steps", type=int, default=0, help="profile this many batch-64 "
                    "decode steps of each variant (the kernels' times go to the JSON)")
    args = ap.parse_args()
    r: dict = {"model": args.model, "device": torch.cuda.get_device_name(),
               "copy_bw": copy_bandwidth(),
               "rates": {"bf16": matmul_rate("cuda"), "fp8": fp8_matmul_rate()},
               "variants": {}}
    adapters = Path(tempfile.mkdtemp(prefix="fp8-adapters-"))
    cfg = ModelConfig.from_dir(resolve_model_dir(args.model, default_cache_dir()))
    for k in range(8):
        write_adapter(adapters / f"f{k}", cfg, RANK, seed=k, device="cuda")
    for name in args.variants:
        try:
            r["variants"][name] = run_variant(name, args.model, adapters, r["copy_bw"],
                                              r["rates"], args.steps, args.profile_steps)
        except Exception as e:  # report the others
            r["variants"][name] = {"error": f"{type(e).__name__}: {e}"}
        r["figures"] = derive({k: v for k, v in r["variants"].items() if "error" not in v})
        args.out.write_text(json.dumps(r, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(render(r))
    print(render(r))


if __name__ == "__main__":
    main()
