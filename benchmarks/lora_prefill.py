"""LoRA prefill against the base model on a CUDA device (issue #37 item 4):
`python benchmarks/lora_prefill.py --out sections.jsonl [--sweep] [--sections engine kernels]`
(`benchmarks/gpu_suite.py --parts lora_prefill` runs it into the card's results file,
`h100.json` or `h200.json`).

engine   64 prompts of 2,048 tokens, one output token each, through the offline engine at
         the GPU defaults: prompt tokens/s with 8 adapters (rank 16 on all 7 projections, one
         per request in turn) ÷ the same prompts on the base model, rounds interleaved, the
         best of each (`lora_prefill_vs_base`). Its steps of 8,192 tokens run eagerly.
engine_piecewise  the same with steps of 2,048 tokens, which the piecewise CUDA graphs run
         (`lora_prefill_2k_steps_vs_base`): a server's prefills beside its decodes.
kernels  one prefill step's LoRA at Llama-3-8B shapes (8,192 tokens in four 2,048-token
         segments, each its own adapter) per fused projection: the base GEMM, the LoRA shrink
         and expand, and the bytes the expand must move (it reads and writes `y`), as a
         fraction of the copy bandwidth. `--sweep` times other block configs of the SGMV
         kernels too.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
from pathlib import Path

import torch
from gpu_common import Recorder, random_prompts, timed_generate, write_adapter
from triton.testing import do_bench

from engine import LLM, SamplingParams
from kernels import seg_lora, sgmv
from kernels.seg_lora import segment_table
from lora.batch import LoraBatchInfo, SlotTable, lora_expand_slices, lora_shrink

HIDDEN, INTER, Q, KV = 4096, 14336, 4096, 1024
PROJECTIONS = {"qkv_proj": (HIDDEN, [Q, KV, KV]), "o_proj": (Q, [HIDDEN]),
               "gate_up_proj": (HIDDEN, [INTER, INTER]), "down_proj": (INTER, [HIDDEN])}
BF16 = torch.bfloat16


def bench(fn) -> float:
    return do_bench(fn, warmup=5, rep=30, return_mode="median") * 1e-3


def copy_bandwidth() -> float:
    x = torch.randn(2**28, device="cuda", dtype=BF16)
    y = torch.empty_like(x)
    return 2 * x.nbytes / bench(lambda: y.copy_(x))


def kernels(rank: int, max_rank: int, tokens: int, segments: int, sweep: bool) -> dict:
    """Per projection: base GEMM, shrink and expand times (µs) for one prefill step."""
    bw = copy_bandwidth()
    out: dict = {"copy_bw": round(bw), "rank": rank, "max_rank": max_rank, "tokens": tokens,
                 "segments": segments}
    info = LoraBatchInfo.build(list(range(segments)), [tokens // segments] * segments, "cuda")
    for name, (k, sizes) in PROJECTIONS.items():
        row = _projection(k, sizes, rank, max_rank, tokens, segments, info, bw, sweep)
        out[name] = {key: (round(v, 1) if isinstance(v, float) else v) for key, v in row.items()}
        print(name, json.dumps(out[name])[:400], flush=True)
    return out


def _projection(k: int, sizes: list[int], rank: int, max_rank: int, tokens: int,
                segments: int, info: LoraBatchInfo, bw: float, sweep: bool) -> dict:
    n = sum(sizes)
    rows = segments * max_rank
    a_pool = torch.randn(rows, len(sizes), k, device="cuda", dtype=BF16) / k**0.5
    b_pool = torch.randn(rows, n, device="cuda", dtype=BF16) * 0.02
    starts = torch.arange(segments, device="cuda", dtype=torch.int32) * max_rank
    ranks = torch.full((segments,), rank, device="cuda", dtype=torch.int32)
    table = SlotTable(starts, ranks, torch.ones(segments, device="cuda"), max_rank)
    x = torch.randn(tokens, k, device="cuda", dtype=BF16)
    w = torch.randn(n, k, device="cuda", dtype=BF16) / k**0.5
    y = torch.empty(tokens, n, device="cuda", dtype=BF16)
    t = lora_shrink(x, a_pool, table, info)

    def shrink() -> None:
        lora_shrink(x, a_pool, table, info)

    def expand() -> None:
        lora_expand_slices(y, t, b_pool, sizes, table, info)

    row: dict = {"base_us": bench(lambda: torch.matmul(x, w.t(), out=y)) * 1e6,
                 "shrink_us": bench(shrink) * 1e6, "expand_us": bench(expand) * 1e6}
    # The expand reads and writes y; the shrink reads x: their floor at the copy bandwidth.
    row["expand_floor_us"] = 2 * y.nbytes / bw * 1e6
    row["shrink_floor_us"] = x.nbytes / bw * 1e6
    row["lora_vs_base"] = row["base_us"] / (row["base_us"] + row["shrink_us"] + row["expand_us"])
    if sweep:
        row["shrink_sweep"] = _sweep("_SHRINK_BLOCKS", shrink, list(itertools.product(
            (16, 32, 64, 128), (32, 64), (64, 128, 256), (3, 4))))
        row["expand_sweep"] = _sweep("_EXPAND_BLOCKS", expand, [
            (m, nn, 16, s) for m, nn, s in itertools.product((32, 64, 128), (64, 128, 256),
                                                              (1, 2, 3))])
    # torch's grouped path (one cuBLAS product per segment and slice), for reference
    row["torch_us"] = bench(lambda: _torch_lora(y, x, a_pool, b_pool, sizes, table, info)) * 1e6
    return row


def piecewise(rank: int, max_rank: int, cases: dict[str, list[int]], max_seqs: int = 256) -> dict:
    """Per projection, a step of the piecewise graphs' sizes (each case: its sequences' token
    counts, each sequence its own adapter): the base GEMM; `seg_lora` over the static segment
    table as the graphs run it (16-row segments, `max_rows` 64 too); SGMV as eager steps run."""
    out: dict = {"rank": rank, "max_rank": max_rank}
    for case, lens in cases.items():
        slots = [i % 16 for i in range(len(lens))]
        info = LoraBatchInfo.build(slots, lens, "cuda")
        token_slots = [s for s, n in zip(slots, lens, strict=True) for _ in range(n)]
        rows = {name: _piecewise_projection(k, sizes, rank, max_rank, info, token_slots,
                                            max_seqs) for name, (k, sizes) in PROJECTIONS.items()}
        out[case] = rows
        print(case, json.dumps(rows), flush=True)
    return out


def _piecewise_projection(k: int, sizes: list[int], rank: int, max_rank: int,
                          info: LoraBatchInfo, token_slots: list[int], max_seqs: int) -> dict:
    tokens, n = len(token_slots), sum(sizes)
    a_pool = torch.randn(16 * max_rank, len(sizes), k, device="cuda", dtype=BF16) / k**0.5
    b_pool = torch.randn(16 * max_rank, n, device="cuda", dtype=BF16) * 0.02
    starts = torch.arange(16, device="cuda", dtype=torch.int32) * max_rank
    ranks = torch.full((16,), rank, device="cuda", dtype=torch.int32)
    scales = torch.ones(16, device="cuda")
    table = SlotTable(starts, ranks, scales, max_rank)
    x = torch.randn(tokens, k, device="cuda", dtype=BF16)
    w = torch.randn(n, k, device="cuda", dtype=BF16) / k**0.5
    y = torch.empty(tokens, n, device="cuda", dtype=BF16)

    def sgmv_path() -> None:
        lora_expand_slices(y, lora_shrink(x, a_pool, table, info), b_pool, sizes, table, info)

    row = {"base_us": bench(lambda: torch.matmul(x, w.t(), out=y)) * 1e6,
           "sgmv_us": bench(sgmv_path) * 1e6}
    for max_rows in (16, 64):
        cap = -(-tokens // max_rows) + max_seqs
        indptr, seg_slots = (torch.tensor(v, dtype=torch.int32, device="cuda") for v in
                             segment_table(token_slots, cap, max_rows))

        def seg_path(indptr=indptr, seg_slots=seg_slots, max_rows=max_rows) -> None:
            seg_lora.seg_lora_triton(y, x, a_pool, b_pool, sizes, starts, ranks, max_rank,
                                     indptr, seg_slots, scales, max_rows)

        row[f"seg{max_rows}_us"] = bench(seg_path) * 1e6
        # SGMV over the same static table (segments of at most max_rows rows): the grid
        # depends on the table's capacity only, as a graph needs
        static = LoraBatchInfo(info.token_slots, indptr, seg_slots, max_rows, "sgmv", True)

        def static_sgmv(static=static) -> None:
            lora_expand_slices(y, lora_shrink(x, a_pool, table, static), b_pool, sizes, table,
                               static)

        row[f"sgmv_static{max_rows}_us"] = bench(static_sgmv) * 1e6
    return {key: round(v, 1) for key, v in row.items()}


def _torch_lora(y, x, a_pool, b_pool, sizes, table, info) -> None:
    t = sgmv.sgmv_shrink_torch(x, a_pool, table.starts, table.ranks, table.max_rank,
                               info.seg_indptr, info.seg_slots, info.max_seg_len)
    sgmv.sgmv_expand_slices_torch(y, t, b_pool, sizes, table.starts, table.ranks,
                                  info.seg_indptr, info.seg_slots, table.scales)


def _sweep(attr: str, fn, configs) -> list:
    """(config, µs) for every prefill config that runs, fastest first; the module's default
    restored."""
    blocks = getattr(sgmv, attr)
    default = blocks["prefill"]
    times = []
    try:
        for cfg in configs:
            blocks["prefill"] = cfg
            try:
                times.append((cfg, round(bench(fn) * 1e6, 1)))
            except Exception as e:  # noqa: BLE001 - out of resources: skip the config
                times.append((cfg, str(e)[:60]))
    finally:
        blocks["prefill"] = default
    ok = sorted((c for c in times if isinstance(c[1], float)), key=lambda c: c[1])
    return [[list(c), us] for c, us in ok[:8]] + [["default", dict(times).get(default)]]


def engine(model: str, adapter_dir: Path, prompts_n: int, length: int, adapters: int,
           rank: int, rounds: int, **flags) -> dict:
    """Prompt tokens/s of `prompts_n` prompts of `length` tokens, base vs LoRA."""
    llm = LLM(model, **flags)  # the GPU defaults (`EngineConfig.resolve`) but `flags`
    cfg = llm.engine.model_config
    for k in range(adapters):
        folder = adapter_dir / f"p{k}-r{rank}"
        write_adapter(folder, cfg, rank, seed=k, device="cuda")
        llm.load_adapter(f"p{k}", folder)
    prompts = random_prompts(prompts_n, length, seed=3, vocab=cfg.vocab_size)

    def one(llm: LLM, adapter_of) -> float:
        params = [SamplingParams(max_tokens=1, temperature=0, adapter=adapter_of(i))
                  for i in range(prompts_n)]
        return prompts_n * length / timed_generate(llm, prompts, params, "cuda")[1]

    runs: dict[str, list[float]] = {"base": [], "lora": []}
    one(llm, lambda i: None)
    one(llm, lambda i: f"p{i % adapters}")  # compiles, loads the slots
    for _ in range(rounds):
        runs["base"].append(round(one(llm, lambda i: None)))
        runs["lora"].append(round(one(llm, lambda i: f"p{i % adapters}")))
    tokens = llm.engine.cfg.max_num_batched_tokens
    del llm  # its weights and KV pool make room for the next section's engine
    gc.collect()
    torch.cuda.empty_cache()
    return {"prompt_tok_s": runs, "adapters": adapters, "rank": rank, "prompts": prompts_n,
            "length": length, "max_num_batched_tokens": tokens,
            "lora_prefill_vs_base": round(max(runs["lora"]) / max(runs["base"]), 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="synthetic:llama3-8b")
    ap.add_argument("--out", type=Path, required=True, help="JSON lines, one per section")
    ap.add_argument("--adapter-dir", type=Path, default=Path("/tmp/lora_prefill"))
    ap.add_argument("--budget", type=float, default=300.0, help="seconds for the whole worker")
    ap.add_argument("--sections", nargs="+", default=["kernels", "engine", "engine_piecewise"],
                    help="also: piecewise (the kernels at a piecewise graph's step sizes)")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rec = Recorder(args.out, args.budget)
    if "kernels" in args.sections:
        with rec.section("lora_prefill_kernels", 150) as s:
            s.result["device"] = torch.cuda.get_device_name()
            for rank in (16, 64):
                s.result[f"r{rank}"] = kernels(rank, 128, 8192, 4, args.sweep and rank == 16)
    if "piecewise" in args.sections:
        with rec.section("lora_prefill_piecewise", 150) as s:
            s.result.update(piecewise(16, 128, {"prefill_2x1024": [1024, 1024],
                                                "mixed_1024_64": [1024] + [1] * 64}))
    if "engine" in args.sections:
        with rec.section("lora_prefill", 120) as s:
            s.result.update(engine(args.model, args.adapter_dir / "prefill", 64, 2048, 8, 16,
                                   args.rounds))
            print(json.dumps(s.result), flush=True)
    if "engine_piecewise" in args.sections:  # steps of 2,048 tokens: the piecewise graphs
        with rec.section("lora_prefill_2k_steps", 120) as s:
            s.result.update(engine(args.model, args.adapter_dir / "prefill", 64, 2048, 8, 16,
                                   args.rounds, max_num_batched_tokens=2048))
            s.result["lora_prefill_2k_steps_vs_base"] = s.result.pop("lora_prefill_vs_base")
            print(json.dumps(s.result), flush=True)


if __name__ == "__main__":
    main()
