"""Multi-LoRA decode throughput: batch 16 with 0, 1, 4 and 16 distinct adapters, same run.

Every adapter is rank 16 on all seven projections (random weights, written in PEFT's layout).
One engine serves every configuration; only the decode steps are timed (after the prefill
step, once every request is decoding), in interleaved rounds; each configuration reports
its fastest round (other load on a shared machine only ever adds time, so the minimum is the
best estimate of the undisturbed speed; the median is printed beside it). Throughput is
given as a ratio to base-only, beside the bytes one step must read: the base weights plus
each distinct adapter's A and B (each read at its own rank from the adapter pool).

    .venv/bin/python benchmarks/lora_throughput.py [--steps 24] [--rounds 3] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from machine import describe  # benchmarks/machine.py
from safetensors.numpy import save_file

from engine import LLM, SamplingParams
from lora.validate import projection_dims

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BLOCK = {p: "self_attn" if p in ALL[:4] else "mlp" for p in ALL}


def write_adapter(folder: Path, base, rank: int, seed: int) -> int:
    """A random PEFT LoRA on all seven projections; returns its weight bytes."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(base.num_layers):
        for proj, (fan_in, fan_out) in projection_dims(base).items():
            key = f"base_model.model.model.layers.{i}.{BLOCK[proj]}.{proj}"
            a = rng.standard_normal((rank, fan_in)) / fan_in**0.5
            b = rng.standard_normal((fan_out, rank)) * 0.01
            tensors[f"{key}.lora_A.weight"] = a.astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = b.astype(np.float32)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(
        f'{{"peft_type": "LORA", "r": {rank}, "lora_alpha": {2 * rank}, '
        f'"target_modules": {ALL!r}}}'.replace("'", '"')
    )
    return sum(t.nbytes for t in tensors.values())


def decode_round(llm: LLM, prompts: list[list[int]], adapters: list[str | None], steps: int):
    """Seconds for `steps` decode steps of the whole batch (prefill excluded)."""
    eng = llm.engine
    for i, (p, a) in enumerate(zip(prompts, adapters, strict=True)):
        params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True, adapter=a)
        eng.add_request(f"bench-{time.monotonic_ns()}-{i}", p, params)
    while eng.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                 for r in eng.scheduler.running):
        eng.step()  # admission, adapter loads and prefill: not timed
    t = time.perf_counter()
    n = 0
    while eng.has_unfinished_requests():
        n += sum(len(o.new_token_ids) for o in eng.step())
    dt = time.perf_counter() - t
    assert n == steps * len(prompts), n
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--distinct", type=int, nargs="+", default=[0, 1, 4, 16])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=12, help="timed decode steps per round")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", type=Path, default=None, help="write a markdown table here")
    args = ap.parse_args()
    if 0 not in args.distinct:
        ap.error("--distinct must include 0 (the base-only reference)")

    most = max(args.distinct)
    llm = LLM(max_num_seqs=args.batch, max_loras=max(most, 1), max_cpu_loras=max(most, 1),
              max_lora_rank=args.rank, threads=args.threads, num_pages=args.batch * 8)
    base = llm.engine.model_config
    tmp = tempfile.TemporaryDirectory()
    adapter_bytes = 0
    for k in range(most):
        adapter_bytes = write_adapter(Path(tmp.name) / f"a{k}", base, args.rank, seed=k)
        llm.load_adapter(f"a{k}", Path(tmp.name) / f"a{k}")
    base_bytes = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1000, 9000, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.batch)]
    configs = {d: [None if d == 0 else f"a{i % d}" for i in range(args.batch)]
               for d in args.distinct}
    decode_round(llm, prompts, configs[args.distinct[-1]], 2)  # warm-up, loads every slot
    times: dict[int, list[float]] = {d: [] for d in args.distinct}
    for _ in range(args.rounds):
        for d, adapters in configs.items():
            times[d].append(decode_round(llm, prompts, adapters, args.steps))
    tmp.cleanup()

    tokens = args.steps * args.batch
    tps = {d: tokens / min(t) for d, t in times.items()}
    med = {d: tokens / statistics.median(t) for d, t in times.items()}
    header = ("| distinct adapters | decode tok/s (best) | ratio to base | median tok/s "
              "(ratio) | MB read per step (base + adapters) |\n|---|---|---|---|---|\n")
    rows = "".join(
        f"| {d} | {tps[d]:.1f} | {tps[d] / tps[0]:.2f} | {med[d]:.1f} ({med[d] / med[0]:.2f}) | "
        f"{(base_bytes + d * adapter_bytes) / 1e6:.0f} ({base_bytes / 1e6:.0f} + "
        f"{d} x {adapter_bytes / 1e6:.1f}) |\n"
        for d in args.distinct
    )
    table = (f"machine: {describe()}\n\nbatch {args.batch}, rank {args.rank} on all 7 projections, "
             f"prompt {args.prompt_len} tokens, {args.steps} timed decode steps x {args.rounds} "
             f"rounds (best and median), {time.strftime('%Y-%m-%d')}\n\n{header}{rows}")
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(f"# Multi-LoRA decode throughput\n\n{table}")


if __name__ == "__main__":
    main()
