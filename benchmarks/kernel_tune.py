"""Kernel timing sweep on a CUDA device: `python benchmarks/kernel_tune.py [--sweep decode
prefill bgmv seg] [--unfused] [--rank R] [--only] [--out tune.json]`.

Measures the device-to-device copy bandwidth, then the paged-attention, BGMV and segmented
LoRA kernels over a few configs each at Llama-3-8B shapes (bf16, 16-token pages, rank-16
adapters, or `--rank`), reporting each as achieved bytes/s over the copy bandwidth; last, a
decode step of a 4-layer 8B-shaped model under CUDA graphs, base and multi-LoRA
(`--unfused`: also with torch's elementwise ops). Families not named in `--sweep` run their
default configs only (`--only`: not at all).

These sweeps time one launch at a time (`do_bench`), which at decode's sizes includes the
host's launch; `benchmarks/attention_graphs.py --sweep` times the attention configurations
inside CUDA graphs, as the decode graphs run them, for bf16 and FP8 caches.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from functools import partial

import torch
import triton
from lora_pools import side_by_side
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench

from kernels import attention_configs as ac
from kernels import bgmv, fused, seg_lora
from kernels import paged_attention as pa

H, KVH, D, PAGE, HIDDEN, INTER, RANK = 32, 8, 128, 16, 4096, 14336, 16
BF16 = torch.bfloat16
FUSED_OPS = ("rms_norm", "add_rms_norm", "rope_cache", "silu_mul")  # `--unfused`: torch's


def bench(fn) -> float:
    """Median seconds of `fn` (L2 flushed between runs by do_bench)."""
    return do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e-3


def copy_bandwidth() -> float:
    x = torch.randn(2**29, device="cuda", dtype=BF16)  # 1 GiB
    y = torch.empty_like(x)
    return 2 * x.nbytes / bench(lambda: y.copy_(x))


def paged_inputs(ctx_lens: list[int]):
    pages = [math.ceil(n / PAGE) for n in ctx_lens]
    order = torch.randperm(sum(pages)).tolist()
    width, tables, i = max(pages), [], 0
    for n in pages:
        tables.append(order[i : i + n] + [0] * (width - n))
        i += n
    shape = (sum(pages) * PAGE, KVH, D)
    k = torch.randn(shape, device="cuda", dtype=BF16)
    v = torch.randn(shape, device="cuda", dtype=BF16)
    tables_t = torch.tensor(tables, dtype=torch.int32, device="cuda")
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
    return k, v, tables_t, lens


def bench_decode(q, k, v, tables, lens, out, cfg) -> float:
    return bench(partial(pa.paged_decode_triton, q, k, v, tables, lens, PAGE, D**-0.5, out,
                         config=cfg))


def sweep_decode(copy_bw: float, quick: bool) -> dict:
    results = {}
    configs = list(itertools.product([32, 64], [2, 4, 8], [2, 3, 4], [4]))
    if quick:
        configs = [ac.DECODE_CONFIG, ac.DECODE_CONFIG_LARGE]
    for batch in (1, 16, 64, 128):
        k, v, tables, lens = paged_inputs([1024] * batch)
        q = torch.randn(batch, H, D, device="cuda", dtype=BF16)
        out = torch.empty_like(q)
        nbytes = 2 * batch * 1024 * KVH * D * 2 + 2 * q.nbytes

        run = partial(bench_decode, q, k, v, tables, lens, out)

        times = {cfg: run(cfg) for cfg in configs}
        best = min(times, key=times.get)
        for waves in ([] if quick else [1, 2, 8, 16]):
            cfg = (*best[:3], waves)
            times[cfg] = run(cfg)
        best = min(times, key=times.get)
        default = run(None)
        results[batch] = dict(
            best=best, us=times[best] * 1e6, default_us=default * 1e6,
            bw_fraction=nbytes / times[best] / copy_bw,
            default_bw_fraction=nbytes / default / copy_bw,
        )
        print(f"decode b={batch:4d} ctx=1024  best {best}  {times[best] * 1e6:8.1f} us  "
              f"{nbytes / times[best] / 1e12:5.2f} TB/s = {results[batch]['bw_fraction']:.2f}"
              f" of copy", flush=True)
    return results


def sweep_prefill(quick: bool) -> dict:
    results = {}
    configs = list(itertools.product([32, 64, 128], [32, 64], [4, 8], [2, 3], [1, 2, 4]))
    if quick:
        configs = [ac.PREFILL_CONFIG]
    cases = {"2048 new": ([2048], [2048]), "8x512 new on 512 cached": ([1024] * 8, [512] * 8),
             "65 new on 4096 cached": ([4161], [65])}
    for name, (ctx_lens, q_lens) in cases.items():
        k, v, tables, lens = paged_inputs(ctx_lens)
        q = torch.randn(sum(q_lens), H, D, device="cuda", dtype=BF16)
        out = torch.empty_like(q)
        starts = torch.tensor([0, *q_lens], device="cuda").cumsum(0).to(torch.int32)
        # causal pairs (query, visible key), 2 matmuls of 2 * D flops each
        pairs = sum(n * (c - n) + n * (n + 1) // 2 for c, n in zip(ctx_lens, q_lens, strict=True))
        flops = 4 * D * H * pairs
        times = {}
        for cfg in configs:
            try:
                times[cfg] = bench(partial(pa.paged_prefill_triton, q, k, v, tables, starts, lens,
                                           max(q_lens), PAGE, D**-0.5, out, config=cfg))
            except OutOfResources:
                continue
        best = min(times, key=times.get)
        results[name] = dict(best=best, us=times[best] * 1e6, tflops=flops / times[best] / 1e12)
        print(f"prefill {name:26s} best {best}  {times[best] * 1e6:8.1f} us  "
              f"{flops / times[best] / 1e12:6.1f} TFLOP/s", flush=True)
    return results


def sweep_verify(copy_bw: float, quick: bool) -> dict:
    """A speculative step's attention: 1 + 4 queries per sequence on its cached context (the
    prefill kernel), against one decode query per sequence on the same context."""
    results = {}
    configs = list(itertools.product([32], [32, 64, 128], [4, 8], [2, 3, 4], [2, 4, 8]))
    if quick:
        configs = [ac.VERIFY_CONFIG]
    for batch, ctx in itertools.product((1, 4, 16), (1024, 4096)):
        n = 5
        k, v, tables, lens = paged_inputs([ctx] * batch)
        q = torch.randn(batch * n, H, D, device="cuda", dtype=BF16)
        out = torch.empty_like(q)
        starts = torch.arange(0, (batch + 1) * n, n, device="cuda", dtype=torch.int32)
        times = {}
        for cfg in configs:
            try:
                times[cfg] = bench(partial(pa.paged_prefill_triton, q, k, v, tables, starts, lens,
                                           n, PAGE, D**-0.5, out, config=cfg))
            except OutOfResources:
                continue
        best = min(times, key=times.get)
        dq = q[:batch].contiguous()
        decode = bench_decode(dq, k, v, tables, lens, torch.empty_like(dq), None)
        default = bench(partial(pa.paged_prefill_triton, q, k, v, tables, starts, lens, n, PAGE,
                                D**-0.5, out))
        nbytes = 2 * batch * ctx * KVH * D * 2
        results[f"{batch}x{ctx}"] = dict(
            best=best, us=times[best] * 1e6, default_us=default * 1e6, decode_us=decode * 1e6,
            bw_fraction=nbytes / times[best] / copy_bw)
        print(f"verify b={batch:3d} ctx={ctx:5d}  best {best}  {times[best] * 1e6:7.1f} us  "
              f"default {default * 1e6:7.1f} us  decode {decode * 1e6:7.1f} us  "
              f"{nbytes / times[best] / copy_bw:.2f} of copy", flush=True)
    return results


def sweep_bgmv(copy_bw: float, quick: bool) -> dict:
    """Batch 64, one distinct adapter per token (64 slots): each projection's shrink and expand
    timed as the decode graphs run them, a CUDA graph of 8 layers (each its own weights, so
    they come from HBM). Timed alone with L2 flushed, the configs ranked differently."""
    tokens, slots, layers = 64, 64, 8
    idx = torch.randperm(slots, device="cuda").to(torch.int32)
    scales = torch.ones(slots, device="cuda")
    starts = torch.arange(slots, device="cuda", dtype=torch.int32) * RANK  # side by side
    ranks = torch.full_like(starts, RANK)
    shrinks = {"qkv": (3 * RANK, HIDDEN), "gate_up": (2 * RANK, HIDDEN), "o": (RANK, HIDDEN),
               "down": (RANK, INTER)}
    expands = {"o": (HIDDEN,), "down": (HIDDEN,), "qkv": (HIDDEN, KVH * D, KVH * D),
               "gate_up": (INTER, INTER)}
    shrink_cfgs = list(itertools.product([1, 2, 4, 8], [1024, 4096], [4, 8], [1, 2, 3]))
    expand_cfgs = list(itertools.product([128, 256, 512], [16, 32, 64], [1, 2, 4], [1]))
    expand_cfgs = [c for c in expand_cfgs if c[1] <= max(16, RANK)]  # wider K tiles: same
    if quick:
        shrink_cfgs, expand_cfgs = [bgmv.SHRINK_CONFIG], [bgmv.EXPAND_CONFIG]

    def in_graph(launch) -> float:
        launch()  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launch()
        return bench(graph.replay)

    def sweep(name, configs, launch, nbytes, default):
        times = {c: in_graph(partial(launch, c)) for c in configs}
        best = min(times, key=times.get)
        if default not in times:
            times[default] = in_graph(partial(launch, default))
        results[name] = dict(best=best, us=times[best] * 1e6, bytes=nbytes,
                             default_us=times[default] * 1e6,
                             configs={str(c): round(t * 1e6, 2) for c, t in times.items()})

    def randn(*shape):
        return [torch.randn(*shape, device="cuda", dtype=BF16) for _ in range(layers)]

    results = {}
    for name, (n, k) in shrinks.items():  # a_pool [U, S, K]
        a, x, t = randn(slots * RANK, n // RANK, k), randn(tokens, k), randn(tokens, n)
        sweep(f"shrink {name}", shrink_cfgs,
              lambda c, a=a, x=x, t=t: [bgmv._launch(x[i], a[i], t[i], starts, ranks, RANK,
                                                     idx, None, c) for i in range(layers)],
              sum(u.nbytes for u in a + x + t), bgmv.SHRINK_CONFIG)
    for name, sizes in expands.items():  # b_pool [U, N]
        n, sliced = sum(sizes), sizes if len(sizes) > 1 else ()
        b, t, y = randn(slots * RANK, n), randn(tokens, RANK * len(sizes)), randn(tokens, n)
        sweep(f"expand {name}", expand_cfgs,
              lambda c, b=b, t=t, y=y, sliced=sliced: [
                  bgmv._launch(t[i], b[i], y[i], starts, ranks, RANK, idx, scales, c, sliced)
                  for i in range(layers)],
              sum(u.nbytes for u in b + t) + 2 * sum(u.nbytes for u in y), bgmv.EXPAND_CONFIG)
    for name, r in results.items():
        r["bw_fraction"] = r["bytes"] / (r["us"] * 1e-6) / copy_bw
        print(f"bgmv {name:16s} best {r['best']}  {r['us']:7.1f} us (default "
              f"{r['default_us']:7.1f})  {r['bw_fraction']:.2f} of copy", flush=True)
    # 8 layers' 4 shrinks + 4 expands, each at its best config and at the defaults.
    kernels = list(results.values())  # each: 8 layers of one projection's shrink or expand
    nbytes = sum(r["bytes"] for r in kernels)
    for key in ("us", "default_us"):
        us = sum(r[key] for r in kernels)
        results[f"8 layers {key}"] = dict(us=us, bw_fraction=nbytes / (us * 1e-6) / copy_bw)
        print(f"bgmv 8 layers (64 launches, {key}) {us:7.1f} us, "
              f"{nbytes / (us * 1e-6) / copy_bw:.2f} of copy", flush=True)
    return results


def sweep_seg(copy_bw: float, quick: bool) -> dict:
    """Segmented LoRA vs BGMV as the decode graphs run them: one CUDA graph of 8 layers x 4
    fused projections (shrink + expand each), batch 64, 64 resident adapters, rows sorted by
    adapter, with 1 to 64 distinct adapters. Shrink configs are swept at the default expand,
    then expand configs at the best shrink; a config's score is its time over BGMV's, summed
    over 8 and 64 adapters. `crossover`: the most distinct adapters (at 16 rows a segment,
    the most segments) at which the best config still beats BGMV."""
    from engine.config import ModelConfig
    from lora.slots import LoraSlots

    layers, batch = 8, 64
    cfg = ModelConfig(vocab_size=1, hidden_size=HIDDEN, intermediate_size=INTER,
                      num_layers=layers, num_heads=H, num_kv_heads=KVH, head_dim=D,
                      max_position=1)
    # `batch` rank-RANK adapters side by side in the pools, which both kernels read.
    slots = side_by_side(LoraSlots(cfg, batch, batch * RANK, RANK, BF16, "cuda"), RANK)
    shapes = {"qkv_proj": (HIDDEN, (H * D, KVH * D, KVH * D)), "o_proj": (H * D, (HIDDEN,)),
              "gate_up_proj": (HIDDEN, (INTER, INTER)), "down_proj": (INTER, (HIDDEN,))}
    as_int = dict(dtype=torch.int32, device="cuda")
    xs = {f: torch.randn(batch, k, device="cuda", dtype=BF16) for f, (k, _) in shapes.items()}
    ys = {f: torch.randn(batch, sum(sizes), device="cuda", dtype=BF16)
          for f, (_, sizes) in shapes.items()}
    io_bytes = layers * sum(xs[f].nbytes + 2 * ys[f].nbytes for f in xs)
    slot_bytes = sum(p.a.nbytes + p.b.nbytes for layer in slots.layers
                     for p in layer.values()) // batch

    def graph_time(apply) -> float:
        def one_pass():
            for i in range(layers):
                for f in shapes:
                    apply(ys[f], xs[f], i, f)
        one_pass()  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            one_pass()
        return bench(graph.replay)

    mixes = {}
    for d in (1, 8, 16, 32, 64):
        rows = [i * d // batch for i in range(batch)]
        indptr, seg_slots = seg_lora.segment_table(rows, batch)
        mixes[d] = (torch.tensor(rows, **as_int), torch.tensor(indptr, **as_int),
                    torch.tensor(seg_slots, **as_int))

    def times(shrink_cfg=None, expand_cfg=None) -> dict[int, float]:
        out = {}
        for d, (rows, indptr, seg_slots) in mixes.items():
            if shrink_cfg is None:  # BGMV over the per-token slots
                out[d] = graph_time(partial(_bgmv_apply, slots=slots, token_slots=rows))
            else:
                out[d] = graph_time(partial(
                    _seg_apply, slots=slots, indptr=indptr, seg_slots=seg_slots,
                    configs=(shrink_cfg, expand_cfg)))
        return out

    results = {"bgmv": times()}
    ref = results["bgmv"]
    print("lora bgmv: " + " ".join(f"{d}:{t * 1e6:.0f}us" for d, t in ref.items()), flush=True)

    def score(t: dict[int, float]) -> float:
        return t[8] / ref[8] + t[64] / ref[64]

    shrink_cfgs = list(itertools.product([64], [128, 256], [512, 1024, 2048], [4], [3]))
    expand_cfgs = list(itertools.product([64, 128, 256], [2, 4]))
    if quick:
        shrink_cfgs, expand_cfgs = [seg_lora.SHRINK_CONFIG], [seg_lora.EXPAND_CONFIG]
    best_shrink, best_expand = seg_lora.SHRINK_CONFIG, seg_lora.EXPAND_CONFIG
    for stage, cfgs in (("shrink", shrink_cfgs), ("expand", expand_cfgs)):
        for c in cfgs:
            pair = (c, best_expand) if stage == "shrink" else (best_shrink, c)
            results[pair] = times(*pair)
            print(f"lora {stage} {pair}: " + " ".join(
                f"{d}:{t * 1e6:.0f}us" for d, t in results[pair].items()), flush=True)
        best = min((p for p in results if p != "bgmv"), key=lambda p: score(results[p]))
        best_shrink, best_expand = best
    report = {}
    for key, t in results.items():
        report[str(key)] = {d: dict(us_per_layer=t[d] / layers * 1e6,
                                    bw_fraction=(d * slot_bytes + io_bytes) / t[d] / copy_bw)
                            for d in t}
    report["best"] = str(best)
    report["crossover"] = max([0] + [d for d in mixes if results[best][d] <= ref[d]])
    for key in ("bgmv", str((seg_lora.SHRINK_CONFIG, seg_lora.EXPAND_CONFIG)), str(best)):
        if key in report:
            print(f"lora pass {key}: " + ", ".join(
                f"{d} adapters {r['us_per_layer']:6.1f} us/layer ({r['bw_fraction']:.2f} of copy)"
                for d, r in report[key].items()), flush=True)
    return report


def _bgmv_apply(y, x, layer, fused, slots, token_slots) -> None:
    pool, table = slots.layers[layer][fused], slots.tables[fused]
    t = bgmv.bgmv_shrink_triton(x, pool.a, table.starts, table.ranks, RANK, token_slots)
    bgmv.bgmv_expand_slices_triton(y, t, pool.b, pool.sizes, table.starts, table.ranks,
                                   token_slots, slots.scales)


def _seg_apply(y, x, layer, fused, slots, indptr, seg_slots, configs) -> None:
    pool, table = slots.layers[layer][fused], slots.tables[fused]
    seg_lora.seg_lora_triton(y, x, pool.a, pool.b, pool.sizes, table.starts, table.ranks, RANK,
                             indptr, seg_slots, slots.scales, seg_lora.MAX_ROWS, *configs)


def step_profile(copy_bw: float, unfused: bool, configs: list[str] = ()) -> dict:
    """Decode steps of a 4-layer Llama-3-8B-shaped model with CUDA graphs, ctx 1024: with this
    tree's BGMV configs, then with each of `configs` ("shrink/expand", each
    "BLOCK_N,BLOCK_K,warps,stages"), the graphs captured anew for each."""
    from engine.config import ModelConfig
    from engine.runner.model_runner import ModelRunner
    from engine.runner.models.llama import LlamaForCausalLM
    from engine.runner.step_inputs import StepInputs
    from lora.layers import wrap_model
    from lora.slots import LoraSlots

    cfg = ModelConfig(vocab_size=128256, hidden_size=HIDDEN, intermediate_size=INTER,
                      num_layers=4, num_heads=H, num_kv_heads=KVH, head_dim=D,
                      max_position=4096, rope_theta=500000.0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(BF16)
    for p in model.parameters():
        torch.nn.init.normal_(p, 0, 0.02)
    model.init_rope()
    slots = side_by_side(LoraSlots(cfg, 64, 64 * RANK, RANK, BF16, "cuda"), RANK, scale=1.0,
                         a_std=0.02)
    lora = wrap_model(model, slots)
    weight_bytes = sum(p.nbytes for p in model.parameters()) - model.embed_tokens.weight.nbytes
    results = {}
    tree = (bgmv.SHRINK_CONFIG, bgmv.EXPAND_CONFIG)
    variants = [("tree", tree)] + [(c, tuple(tuple(int(v) for v in half.split(","))
                                             for half in c.split("/"))) for c in configs]
    for (label, (bgmv.SHRINK_CONFIG, bgmv.EXPAND_CONFIG)), fused_ops in itertools.product(
            variants, (True, False) if unfused else (True,)):
        saved = {name: getattr(fused, name) for name in FUSED_OPS}
        if not fused_ops:
            for name in FUSED_OPS:
                setattr(fused, name, getattr(fused, f"{name}_torch"))
        runner = ModelRunner(model, num_pages=128 * 66, page_size=PAGE, lora=lora,
                             cuda_graph_max_batch=128, max_model_len=2048)
        for batch in (1, 64, 128):
            tables = [list(range(i * 66, i * 66 + 65)) for i in range(batch)]
            ids, pos = [5] * batch, [1024] * batch
            slots_ = [t[64] * PAGE for t in tables]
            kv_bytes = batch * 1025 * 4 * 2 * KVH * D * 2
            roofline = (weight_bytes + kv_bytes) / copy_bw
            row = {}
            for name, lora_slots in (("base", None), ("lora64", list(range(batch))[:64] * 2),
                                     ("lora8", [i % 8 for i in range(batch)])):
                lora_slots = lora_slots[:batch] if lora_slots else None
                inputs = StepInputs(ids, pos, slots_, tables, [p + 1 for p in pos],
                                    lora_slots or [-1] * batch, sample_rows=list(range(batch)),
                                    num_decodes=batch)
                t = bench(partial(runner.graphs.run, inputs))
                row[name] = dict(ms=t * 1e3, roofline_fraction=roofline / t)
            kind = f"{'fused' if fused_ops else 'torch'} b={batch}"
            results[kind if label == "tree" else f"{label} {kind}"] = row
            print(f"step 4 layers [{label}] {kind}: base "
                  f"{row['base']['ms']:.3f} ms ({row['base']['roofline_fraction']:.2f} of "
                  f"roofline {roofline * 1e3:.3f}), lora8 {row['lora8']['ms']:.3f}, lora64 "
                  f"{row['lora64']['ms']:.3f} ms", flush=True)
        for name, fn in saved.items():
            setattr(fused, name, fn)
        del runner
        torch.cuda.empty_cache()
    bgmv.SHRINK_CONFIG, bgmv.EXPAND_CONFIG = tree
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", nargs="*", default=["decode", "prefill", "bgmv", "seg"])
    parser.add_argument("--unfused", action="store_true")
    parser.add_argument("--rank", type=int, default=RANK, help="the adapters' rank")
    parser.add_argument("--only", action="store_true",
                        help="run the --sweep families alone (and 'step': the decode step)")
    parser.add_argument("--step-configs", nargs="*", default=[], help="BGMV configs the "
                        "decode step runs with too: 'shrink/expand', each 'n,k,warps,stages'")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    globals()["RANK"] = args.rank
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    report = dict(device=props.name, torch=torch.__version__, triton=triton.__version__,
                  rank=args.rank)
    print(report, flush=True)
    bw = report["copy_bw"] = copy_bandwidth()
    print(f"device-to-device copy: {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    families = {"decode": partial(sweep_decode, bw), "bgmv": partial(sweep_bgmv, bw),
                "seg": partial(sweep_seg, bw), "prefill": sweep_prefill,
                "verify": partial(sweep_verify, bw)}
    for name, sweep in families.items():
        if name in args.sweep or not args.only:
            report[name] = sweep(name not in args.sweep)
    if "step" in args.sweep or not args.only:
        report["step"] = step_profile(bw, args.unfused, args.step_configs)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
