"""The paged-attention kernels timed as the decode graphs run them, bf16 and FP8 caches:

    python benchmarks/attention_graphs.py [--tree DIR ...] [--out results.json]

Each case launches the kernel (with its merge of the splits) over 8 layers' caches, distinct
so that none is read from L2, inside one CUDA graph, and reports microseconds a layer (best of
3 timings of 20 replays) and, for decode, the cache bytes' rate. One launch at a time
(`do_bench`) would time the host's launch at these sizes. Llama-3-8B's shapes: 32 query heads,
8 KV heads, head dim 128, 16-token pages in random order. Decode at batch x context from
1 x 1k to 128 x 1k; the prefill kernel on a speculative step's 5 queries, a 256-token chunk on
an 8k context, and 16 prompts of 2k tokens.

`--tree DIR` also times another checkout's kernels (e.g. an older commit in a `git worktree`)
on the same cases, in a child process, and prints each case's time against this tree's.
`--sweep` times each case under every configuration of its kernel's grid instead (the way the
configurations in `kernels/attention_configs.py` were chosen) and prints the best three beside
the default's time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

H, KVH, D, PAGE = 32, 8, 128, 16
LAYERS = 8
SCALE = D**-0.5
DECODE = [(1, 1024), (16, 1024), (64, 1024), (128, 1024), (32, 2048), (4, 4096), (1, 8192),
          (16, 8192)]
PREFILL = {"verify 16x5 on 2k": (16, 5, 2048), "verify 1x5 on 4k": (1, 5, 4096),
           "chunk 1x256 on 8k": (1, 256, 8192), "prefill 16x2k": (16, 2048, 2048)}
# `--sweep`: decode (BLOCK_N, warps, stages, waves); prefill (tile rows, BLOCK_N, warps,
# stages, waves), its verify cases with at most 32 tile rows.
DECODE_GRID: list[tuple[int, ...]] = list(
    itertools.product([32, 64, 128], [4, 8], [2, 3, 5], [1, 2, 4]))
# ... and with registers capped (`maxnreg`): the FP8 kernel's 96 registers and 38.9 KB of shared
# memory at 2 stages hold it to 5 programs an SM (compiled for sm_90 with Triton 3.6: 1 stage
# takes 22.5 KB; 80 registers spill 8 bytes, (64, 8 warps) fits 64 with none).
DECODE_GRID += list(itertools.product([32, 64], [4, 8], [1, 2], [2], [64, 72, 80]))
VERIFY_GRID = list(itertools.product([16, 32], [32, 64, 128], [4], [2, 3, 5], [2]))
PREFILL_GRID = list(itertools.product([64, 128], [32, 64, 128], [4, 8], [2, 3], [2]))


def caches(pages: int, fp8: bool) -> list[tuple]:
    out = []
    for _ in range(LAYERS):
        k, v = (torch.randn(pages * PAGE, KVH, D, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        if fp8:
            scales = torch.full((2, KVH), 0.05, device="cuda")
            k, v = ((x.float() / 0.05).clamp(-448, 448).to(torch.float8_e4m3fn) for x in (k, v))
            out.append((k, v, scales))
        else:
            out.append((k, v, None))
    return out


def tables_for(batch: int, ctx: int) -> tuple[torch.Tensor, int]:
    per = -(-ctx // PAGE)
    order = torch.randperm(batch * per, device="cuda", dtype=torch.int32)
    return order.view(batch, per).contiguous(), batch * per


def graph_us(fn) -> float:
    """Microseconds a layer of `fn(layer)` for every layer, replayed in one CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm up (compiles) off the capture
        for i in range(LAYERS):
            fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(LAYERS):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / 20 / LAYERS)
    return best


def timed(fn, grid: list | None) -> dict:
    """{"us": the default configuration's time} and, with a grid, {"best": the three fastest
    configurations and their times}."""
    out: dict = {"us": round(graph_us(lambda i: fn(i, None)), 2)}
    if grid:
        times = {}
        for cfg in grid:
            try:
                times[cfg] = graph_us(lambda i, cfg=cfg: fn(i, cfg))
            except OutOfResources:
                continue
        out["best"] = [[list(c), round(times[c], 2)] for c in sorted(times, key=times.get)[:3]]
    return out


def measure(sweep: bool = False) -> dict:
    from kernels import paged_attention as pa

    res = {}
    for fp8 in (False, True):
        dtype = "fp8" if fp8 else "bf16"
        for batch, ctx in DECODE:
            tables, pages = tables_for(batch, ctx)
            lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
            cs = caches(pages, fp8)
            q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16)
            out = torch.empty_like(q)
            fig = timed(lambda i, cfg, cs=cs, q=q, out=out, tables=tables, lens=lens: (
                pa.paged_decode_triton(q, cs[i][0], cs[i][1], tables, lens, PAGE, SCALE, out,
                                       kv_scales=cs[i][2], config=cfg)),
                DECODE_GRID if sweep else None)
            nbytes = 2 * batch * ctx * KVH * D * cs[0][0].element_size()
            res[f"decode {dtype} {batch}x{ctx}"] = {**fig,
                                                    "TB/s": round(nbytes / fig["us"] / 1e6, 3)}
            del cs
        for name, (batch, nq, ctx) in PREFILL.items():
            tables, pages = tables_for(batch, ctx)
            lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
            starts = torch.arange(0, (batch + 1) * nq, nq, device="cuda", dtype=torch.int32)
            cs = caches(pages, fp8)
            q = torch.randn(batch * nq, H, D, device="cuda", dtype=torch.bfloat16)
            out = torch.empty_like(q)
            grid = (VERIFY_GRID if name.startswith("verify") else PREFILL_GRID) if sweep else None
            res[f"prefill {dtype} {name}"] = timed(
                lambda i, cfg, cs=cs, q=q, out=out, tables=tables, lens=lens, starts=starts,
                nq=nq: pa.paged_prefill_triton(q, cs[i][0], cs[i][1], tables, starts, lens, nq,
                                               PAGE, SCALE, out, kv_scales=cs[i][2], config=cfg),
                grid)
            del cs
        torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", type=Path, action="append", default=[],
                    help="another checkout whose kernels are timed on the same cases")
    ap.add_argument("--sweep", action="store_true", help="time every configuration of a grid")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    ap.add_argument("--emit", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.emit:
        args.emit.write_text(json.dumps(measure()))
        return
    runs = {"this tree": measure(args.sweep)}
    for tree in args.tree:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                [str(tree.resolve()), os.environ.get("PYTHONPATH", "")]))
            subprocess.run([sys.executable, __file__, "--emit", f.name], cwd=tree, env=env,
                           check=True)
            runs[str(tree)] = json.loads(Path(f.name).read_text())
    ours = runs["this tree"]
    for case, fig in ours.items():
        line = f"{case:32s} {fig['us']:9.1f} us"
        if "TB/s" in fig:
            line += f" {fig['TB/s']:5.2f} TB/s"
        if "best" in fig:
            line += " | best " + ", ".join(f"{cfg} {us:.1f}" for cfg, us in fig["best"])
        for tree, other in runs.items():
            if tree != "this tree":
                theirs = other[case]["us"]
                line += f" | {tree}: {theirs:9.1f} us, ratio {fig['us'] / theirs:.3f}"
        print(line, flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), **runs}, indent=1))


if __name__ == "__main__":
    main()
