"""Tensor parallelism on GPUs (or CPU processes): the suite's `tp` part.

Parts (`--parts`, each in processes of its own: one tensor-parallel engine per process, and
the GPUs' memory freed between them); every figure goes into `--out` (JSON, merged over an
earlier file so that parts run in separate calls add up) and a markdown table beside it:

  decode     per size N of `--sizes`: a batch of `--batch` requests with `--context`-token
             prompts prefilled, then `--steps` greedy decode steps timed; the KV pool is sized
             for that batch. `tp{N}_decode_tok_s`, `tp{N}_step_ms`, `tp{N}_vs_tp1_b{batch}`,
             and on GPUs `tp{N}_roofline_fraction`: (one rank's weight bytes + its KV bytes of
             the batch's context) ÷ the device's copy bandwidth ÷ the step time; for N > 1
             also with the one-shot all-reduce (`tp{N}_one_shot_decode_tok_s`) and where
             rank 0's time goes over 8 steps (`tp{N}_profile_8_steps`: wall, GPU kernels).
  allreduce  per size N > 1: what one decode step's collectives cost alone (the model's
             all-reduces of [batch, hidden] and its logits' all-gather, captured in a CUDA
             graph as the decode graphs hold them), through NCCL alone and with the one-shot
             all-reduce (`TPGroup.enable_one_shot`): `tp{N}_collectives_ms_nccl`,
             `tp{N}_collectives_ms_one_shot`; and the bus bandwidth NCCL reaches on a 256 MB
             all-reduce, `tp{N}_busbw_gb_s`.
  roofline70b  `synthetic:llama3-70b` at the largest size, batch 64, 1k contexts:
             `tp{N}_roofline_70b_b64`.
  lora       at size 2: 8 adapters (rank 16, all projections) over a batch of 64, each request
             its adapter, ÷ the same batch on the base model: `tp2_lora_vs_base_b64`.
  http       at size 2: the GPU suite's HTTP workload (256 mixed requests, 128 streaming
             clients from 4 processes, `gpu_e2e.http_workload`) through `switchboard serve
             --tensor-parallel-size 2` ÷ the offline engine of size 2 on the same requests:
             `tp2_http_vs_offline_c128`.

    python benchmarks/tensor_parallel.py --model synthetic:llama3-8b --device cuda \\
        --dtype bfloat16 --sizes 1 2 4 --out benchmarks/results/h100_tp.json
    python benchmarks/tensor_parallel.py --parts decode --sizes 1 2 --batch 16 --context 256
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

PARTS = ("decode", "allreduce", "roofline70b", "lora", "http")
PAGE = 16


def engine_args(args: argparse.Namespace, size: int, batch: int, context: int) -> dict:
    """An engine of `size` ranks whose KV pool holds `batch` sequences of `context` tokens
    and their decode (and nothing much more: the pool is not what is measured)."""
    pages_per_seq = -(-(context + args.steps + 80) // PAGE)
    return dict(tensor_parallel_size=size, device=args.device, dtype=args.dtype,
                max_num_seqs=batch, max_num_batched_tokens=max(2048, context),
                num_pages=batch * pages_per_seq + 64, page_size=PAGE, max_loras=0,
                piecewise_graphs=False)  # decode is measured; they cost start-up time


def decode(args: argparse.Namespace, size: int, model: str, batch: int, context: int,
           adapters: int = 0) -> dict:
    """One size's decode round (and, with `adapters`, the same round with one adapter of
    `adapters` per request)."""
    from gpu_common import (
        copy_bandwidth,
        decode_round,
        greedy,
        kv_bytes_per_token,
        profile,
        random_prompts,
        weight_bytes,
        write_adapter,
    )

    from engine import LLM

    kw = engine_args(args, size, batch, context)
    if adapters:
        kw.update(max_loras=adapters, max_lora_rank=16)
    with LLM(model=model, **kw) as llm:
        eng = llm.engine
        prompts = random_prompts(batch, context, seed=0, vocab=eng.model_config.vocab_size)
        for k in range(adapters):
            folder = args.work / f"tp-lora{k}"
            write_adapter(folder, eng.model_config, 16, seed=70 + k, device=args.device)
            llm.load_adapter(f"a{k}", folder)
        decode_round(llm, prompts[:2], lambda i, n: greedy(n), steps=2)  # warm up
        r = decode_round(llm, prompts, lambda i, n: greedy(n), steps=args.steps)
        out = {"step_ms": round(r.step_s * 1e3, 3), "decode_tok_s": round(r.tok_s, 1),
               "batch": round(r.mean_running, 1), "context": round(r.mean_context)}
        if adapters:
            lora = decode_round(llm, prompts, lambda i, n: greedy(n, adapter=f"a{i % adapters}"),
                                steps=args.steps)
            out.update(lora_decode_tok_s=round(lora.tok_s, 1),
                       lora_vs_base=round(lora.tok_s / r.tok_s, 3))
        if args.device == "cuda" and size > 1 and not adapters:
            # Where a step's time goes on rank 0: its GPU's kernels against the wall.
            for i, p in enumerate(prompts):
                eng.add_request(f"p{i}", p, greedy(64))
            while eng.num_waiting or any(r.num_computed_tokens < r.num_tokens - 1
                                         for r in eng.scheduler.running):
                eng.step()
            out["profile_8_steps"] = profile(lambda: [eng.step() for _ in range(8)], top=8)
            for i in range(len(prompts)):
                eng.abort_request(f"p{i}")
        if args.device == "cuda":
            itemsize = eng.model.embed_tokens.weight.element_size()
            kv = kv_bytes_per_token(eng.model.local_cfg, itemsize)
            moved = weight_bytes(eng.model) + kv * r.mean_context * r.mean_running
            out["roofline_fraction"] = round(moved / copy_bandwidth() / r.step_s, 3)
    return out


def _collectives(rank: int, size: int, port: int, shape: tuple[int, int, int, int],
                 results) -> None:
    """One rank of `allreduce`: one decode step's collectives (`shape`: batch, hidden, layers,
    vocabulary) through `TPGroup`, captured in a CUDA graph as the decode graphs hold them,
    NCCL alone and with the one-shot all-reduce; and a large all-reduce's bus bandwidth."""
    import torch
    import torch.distributed as dist

    from engine.parallel.collectives import TPGroup

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    tp = TPGroup.join(rank, size, port, device)
    batch, hidden, layers, vocab = shape
    x = torch.ones(batch, hidden, dtype=torch.bfloat16, device=device)
    logits = torch.ones(batch, vocab // size, dtype=torch.float32, device=device)

    def step() -> None:
        y = tp.all_reduce(x)  # the embedding's
        for _ in range(2 * layers):  # o_proj's and down_proj's
            y = tp.all_reduce(y)
        tp.gather_columns(logits)

    out = {}
    for name in ("nccl", "one_shot"):
        if name == "one_shot":
            os.environ["SWITCHBOARD_TP_ONE_SHOT"] = "1"
            tp.enable_one_shot(torch.bfloat16, hidden)
            if tp._one_shot is None:
                continue
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(graph):
            step()
        torch.cuda.synchronize()
        out[f"collectives_ms_{name}"] = round(_time(graph.replay, 50) * 1e3, 3)
        graph.reset()
    big = torch.ones(128 * 2**20, dtype=torch.bfloat16, device=device)  # 256 MB
    t_big = _time(lambda: dist.all_reduce(big), 10)
    out["busbw_gb_s"] = round(2 * (size - 1) / size * big.numel() * 2 / t_big / 1e9, 1)
    dist.barrier()
    if rank == 0:
        results.put(out)
    tp.close()


def _time(fn, reps: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def allreduce(args: argparse.Namespace, size: int) -> dict:
    import multiprocessing as mp

    from engine.config import ModelConfig
    from engine.parallel.workers import _free_port
    from engine.runner.synthetic import hf_config

    cfg = ModelConfig.from_hf(hf_config(args.model.removeprefix("synthetic:")))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    shape = (args.batch, cfg.hidden_size, cfg.num_layers, cfg.vocab_size)
    port = _free_port()
    procs = [ctx.Process(target=_collectives, args=(r, size, port, shape, results))
             for r in range(size)]
    for p in procs:
        p.start()
    out = results.get(timeout=300)
    for p in procs:
        p.join(60)
    return out


def http(args: argparse.Namespace, size: int) -> dict:
    """The suite's HTTP workload at `size` ranks against the offline engine of that size."""
    import torch
    from gpu_common import greedy, random_prompts
    from gpu_e2e import (
        CLIENT_PROCESSES,
        Server,
        http_workload,
        mixed_workload,
        offline_tok_s,
        sizes,
        tuned_serve_flags,
    )

    from engine import LLM

    seqs, pages, step = sizes(False)
    flags = dict(max_num_seqs=seqs, max_num_batched_tokens=step, num_pages=pages,
                 tensor_parallel_size=size)
    with LLM(args.model, dtype=args.dtype, device=args.device, **flags) as llm:
        vocab = llm.engine.model_config.vocab_size
        prompts, outputs = mixed_workload(256, vocab)
        # The first round warms up (graphs, kernels); the best of the next two counts.
        rounds = [offline_tok_s(llm, prompts, outputs, lambda i, m: greedy(m), args.device)
                  for _ in range(3)]
    offline = max(rounds[1:])
    gc.collect()
    torch.cuda.empty_cache()
    serve = tuned_serve_flags(args.model, args.device, args.work / "store") + [
        "--tensor-parallel-size", str(size)]
    with Server(serve) as srv:
        warm, warm_outputs = mixed_workload(256, vocab, seed=8)
        http_workload(srv.url, warm, warm_outputs, 128, CLIENT_PROCESSES)
        fresh = random_prompts(256, [len(p) for p in prompts], seed=9, vocab=vocab)
        served = [http_workload(srv.url, ps, outputs, 128, CLIENT_PROCESSES)
                  for ps in (prompts, fresh)]
    best = max(served, key=lambda r: r["tok_s"])
    return {"offline_tok_s": round(offline), "http_tok_s": best["tok_s"],
            "ttft_p50_s": best["ttft_p50_s"], "ttft_p99_s": best["ttft_p99_s"],
            "errors": best["errors"], "http_vs_offline_c128": round(best["tok_s"] / offline, 3)}


def one(args: argparse.Namespace) -> dict:
    """This process: part `args.one` at size `args.size`."""
    size = args.size
    if args.one == "decode":
        return decode(args, size, args.model, args.batch, args.context)
    if args.one == "decode_one_shot":  # the same with the one-shot all-reduce
        os.environ["SWITCHBOARD_TP_ONE_SHOT"] = "1"
        r = decode(args, size, args.model, args.batch, args.context)
        return {"one_shot_decode_tok_s": r["decode_tok_s"], "one_shot_step_ms": r["step_ms"]}
    if args.one == "roofline70b":
        r = decode(args, size, "synthetic:llama3-70b", 64, 1024)
        return {"roofline_70b_b64": r.get("roofline_fraction"), "step_ms_70b_b64": r["step_ms"],
                "decode_tok_s_70b_b64": r["decode_tok_s"]}
    if args.one == "lora":
        r = decode(args, size, args.model, args.batch, args.context, adapters=8)
        return {f"lora_vs_base_b{args.batch}": r["lora_vs_base"],
                "lora_decode_tok_s": r["lora_decode_tok_s"], "base_decode_tok_s": r["decode_tok_s"]}
    if args.one == "allreduce":
        return allreduce(args, size)
    return http(args, size)


def runs(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(part, size) in order."""
    todo = []
    for part in args.parts.split(","):
        if part == "decode":
            todo += [("decode", s) for s in args.sizes]
            todo += [("decode_one_shot", s) for s in args.sizes if s > 1]
        elif part == "allreduce":
            todo += [("allreduce", s) for s in args.sizes if s > 1]
        elif part == "roofline70b":
            todo.append(("roofline70b", max(args.sizes)))
        elif part in ("lora", "http"):
            todo.append((part, 2))
        else:
            raise SystemExit(f"unknown part {part!r}; parts: {', '.join(PARTS)}")
    return todo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="synthetic:llama3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=300, help="seconds per part and size")
    ap.add_argument("--work", type=Path, default=Path("/tmp/switchboard-tp"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.one:
        print(json.dumps(one(args)), flush=True)
        return
    from machine import describe

    result: dict = {}
    if args.out and args.out.is_file():
        result = json.loads(args.out.read_text())
    result.update(machine=describe(), model=args.model, device=args.device, dtype=args.dtype,
                  batch=args.batch, context=args.context)
    flags = sys.argv[1:]
    for part, size in runs(args):
        t = time.monotonic()
        print(f"[{part} tp{size}] ...", flush=True)
        try:
            run = subprocess.run([sys.executable, __file__, *flags, "--one", part, "--size",
                                  str(size)], capture_output=True, text=True,
                                 timeout=args.timeout, env={**os.environ})
            figures = (json.loads(run.stdout.strip().splitlines()[-1]) if run.returncode == 0
                       else {"error": run.stderr[-1500:]})
        except subprocess.TimeoutExpired:
            figures = {"error": f"timed out after {args.timeout:.0f} s"}
        result.pop(f"tp{size}_{part}_error", None)
        for k, v in figures.items():
            result[f"tp{size}_{part}_error" if k == "error" else f"tp{size}_{k}"] = v
        print(f"[{part} tp{size}] {time.monotonic() - t:.0f} s: {json.dumps(figures)[:600]}",
              flush=True)
    base = result.get("tp1_decode_tok_s")
    for size in args.sizes:
        if size > 1 and base and f"tp{size}_decode_tok_s" in result:
            result[f"tp{size}_vs_tp1_b{args.batch}"] = round(
                result[f"tp{size}_decode_tok_s"] / base, 3)
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        rows = [f"| {k} | {v} |" for k, v in sorted(result.items())
                if k.startswith("tp") and not k.endswith("_error")]
        errors = [f"- {k}: {str(v).splitlines()[-1] if v else v}" for k, v in result.items()
                  if k.endswith("_error")]
        args.out.with_suffix(".md").write_text(
            f"# Tensor parallelism\n\n{result['machine']}\n\n{result['model']}, {args.device} "
            f"{args.dtype}, batch {args.batch}, {args.context}-token prompts\n\n"
            "| figure | value |\n|---|---|\n" + "\n".join(rows) + "\n"
            + ("\nErrors:\n" + "\n".join(errors) + "\n" if errors else ""))


if __name__ == "__main__":
    main()
