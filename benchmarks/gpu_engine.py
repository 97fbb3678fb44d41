"""The GPU suite's engine worker: decode throughput (base and multi-LoRA), roofline fractions,
the LoRA kernels' bandwidth, constrained decoding and session TTFT, on one engine.

Run by benchmarks/gpu_suite.py; it appends one JSON line per section to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from gpu_common import (
    Recorder,
    Section,
    adapter_bytes,
    copy_bandwidth,
    decode_round,
    first_token,
    greedy,
    kv_bytes_per_token,
    profile,
    random_prompts,
    weight_bytes,
    write_adapter,
)
from lora_pools import side_by_side

from engine import LLM
from engine.spec.speculative import Speculator
from kernels.seg_lora import segment_table
from lora.batch import LoraBatchInfo, graph_kernel
from lora.slots import FUSED, LoraSlots

RANK = 16
PROMPT_LEN = 1024  # "1k-token contexts"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "notes": {"type": "string"}},
          "required": ["name", "notes"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="synthetic:llama3-8b")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget", type=float, default=240.0, help="seconds for the whole worker")
    ap.add_argument("--adapter-dir", type=Path, required=True)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128])
    ap.add_argument("--distinct", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--big", type=int, default=256, help="batch of the last, largest config "
                    "(as many distinct adapters; 0 skips it)")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per config")
    ap.add_argument("--qwen3-model", default="synthetic:qwen3-8b", help="the Qwen3 model of "
                    "qwen3_roofline_fraction_b64, loaded last, in the first one's place "
                    "('' skips it)")
    ap.add_argument("--sections", nargs="+", default=None, help="run only these sections "
                    "(e.g. speculative; the model is loaded in any case)")
    args = ap.parse_args()
    rec = Recorder(args.out, args.budget)

    def want(name: str) -> bool:
        return args.sections is None or name in args.sections

    most = max([*args.distinct, 8, args.big, 64])
    seqs = max([*args.batches, args.big])

    with rec.section("setup", 90) as s:
        t = time.monotonic()
        pages_per_seq = -(-(PROMPT_LEN + args.steps + 8) // 16)
        # Built to speculate (so its verify graphs are captured), but it speculates only in
        # the speculative section, which sets its speculator.
        llm = LLM(args.model, dtype="bfloat16", device="cuda", max_num_seqs=seqs,
                  max_num_batched_tokens=16384, num_pages=seqs * pages_per_seq + 1200,
                  max_loras=most, max_cpu_loras=most, max_lora_rank=RANK,
                  num_speculative_tokens=4)
        llm.engine.speculator = None
        torch.cuda.synchronize()
        cfg = llm.engine.model_config
        s.result.update(load_s=round(time.monotonic() - t, 1), copy_bw=copy_bandwidth(),
                        weight_bytes=weight_bytes(llm.engine.model),
                        kv_bytes_per_token=kv_bytes_per_token(cfg, 2),
                        adapter_bytes=adapter_bytes(cfg, RANK, 2),
                        device=torch.cuda.get_device_name())
        bw = s.result["copy_bw"]
        setup = s.result

    if want("decode") or want("decode_big"):  # the sections that run adapters
        with rec.section("adapters", 60) as s:
            t = time.monotonic()
            files = [args.adapter_dir / f"f{k}" for k in range(16)]
            for k, f in enumerate(files):
                write_adapter(f, cfg, RANK, seed=k, device="cuda")
            # Each name is its own adapter with its own device slot; names share 16 weight
            # files only to keep disk writes small.
            with ThreadPoolExecutor(16) as pool:  # reads and checks release the GIL
                list(pool.map(lambda k: llm.load_adapter(f"a{k}", files[k % 16]), range(most)))
            s.result.update(adapters=most, files=len(files),
                            seconds=round(time.monotonic() - t, 1))

    vocab = cfg.vocab_size
    prompts = random_prompts(seqs, PROMPT_LEN, seed=1, vocab=vocab)
    grid = [(b, 0) for b in args.batches] + [(b, 8) for b in args.batches if b == 64]
    grid += [(b, d) for d in args.distinct for b in args.batches if d <= b]
    grid.sort(key=lambda c: (c[0] != 64, c))  # the batch-64 ratios first
    if want("decode"):
        with rec.section("decode", 150) as s:
            decode_grid(llm, s, grid, prompts, args.steps, setup)
            derive(s, setup)
            lora_vs_base(llm, s, prompts[:64], 2 * args.steps)
    if want("lora_kernel"):
        with rec.section("lora_kernel", 20) as s:
            lora_kernel(s, cfg, bw)
    if want("constrained"):
        with rec.section("constrained", 40) as s:
            constrained(llm, s, prompts[:64], args.steps * 2)
    if want("session"):
        with rec.section("session", 30) as s:
            session_ttft(llm, s, vocab)
    if want("speculative"):
        with rec.section("speculative", 55) as s:
            speculative(llm, s, prompts, args.steps)
    if args.big and want("decode_big"):
        with rec.section("decode_big", 90) as s:
            decode_grid(llm, s, [(args.big, args.big), (args.big, 0)], prompts, args.steps,
                        setup, warm=False)
    if args.qwen3_model and want("qwen3"):
        del llm  # its weights and KV pool make room for the next model's
        gc.collect()
        torch.cuda.empty_cache()
        with rec.section("qwen3", 60) as s:
            qwen3_roofline(args.qwen3_model, s, prompts[:64], args.steps, bw)


def decode_grid(llm: LLM, s: Section, grid, prompts, steps: int, setup, warm=True) -> None:
    """tokens/s for each (batch, distinct adapters) config; adapters round-robin, so a batch
    of b with d <= b distinct adapters has every adapter on b / d sequences."""
    if warm:  # CUDA graphs, Triton autotuning, cuBLAS handles: a short round of each kind
        decode_round(llm, prompts[:64], lambda i, n: greedy(n, f"a{i % 64}"), 2)
        decode_round(llm, prompts[:64], lambda i, n: greedy(n), 2)
    tok_s = s.result.setdefault("decode_tok_s", {})
    detail = s.result.setdefault("detail", {})
    for b, d in grid:
        if s.left() < 10:
            s.notes.append(f"skipped batch {b} with {d} adapters: section out of time")
            continue
        t = time.monotonic()
        r = decode_round(llm, prompts[:b], lambda i, n, d=d: greedy(n, f"a{i % d}"
                                                                     if d else None), steps)
        key = "base" if d == 0 else f"lora_{d}"
        tok_s.setdefault(key, {})[str(b)] = round(r.tok_s, 1)
        nbytes = setup["weight_bytes"] + b * r.mean_context * setup["kv_bytes_per_token"]
        nbytes += min(d, b) * setup["adapter_bytes"]
        detail[f"{key}_b{b}"] = {"step_ms": round(r.step_s * 1e3, 2),
                                 "mean_context": round(r.mean_context, 1),
                                 "mean_running": round(r.mean_running, 1),
                                 "bytes_per_step": int(nbytes),
                                 "roofline_fraction": round(nbytes / setup["copy_bw"] / r.step_s,
                                                            3),
                                 "wall_s": round(time.monotonic() - t, 1)}


def derive(s: Section, setup) -> None:
    d = s.result.get("detail", {})
    if "base_b64" in d:
        s.result["roofline_fraction_b64"] = d["base_b64"]["roofline_fraction"]
    if "lora_64_b64" in d:
        s.result["lora64_roofline_fraction_b64"] = d["lora_64_b64"]["roofline_fraction"]
    if "base_b1" in d:
        s.result["roofline_fraction_b1"] = d["base_b1"]["roofline_fraction"]
        if "lora_1_b1" in d:  # one adapter at batch 1: step time, base ÷ LoRA
            s.result["lora_b1_vs_base_b1"] = round(
                d["base_b1"]["step_ms"] / d["lora_1_b1"]["step_ms"], 3)


def qwen3_roofline(model: str, s: Section, prompts, steps: int, bw: float) -> None:
    """`qwen3_roofline_fraction_b64`: batch-64 greedy decode of a Qwen3 model (its per-head
    q/k norms in every layer), its bytes per step (weights + the batch's KV) over the step time
    against the copy bandwidth measured in setup: the same figure as `roofline_fraction_b64`
    for the Llama preset, on an engine of its own without LoRA slots."""
    pages_per_seq = -(-(PROMPT_LEN + steps + 80) // 16)
    llm = LLM(model, dtype="bfloat16", device="cuda", max_num_seqs=len(prompts),
              max_num_batched_tokens=16384, num_pages=len(prompts) * pages_per_seq + 64,
              max_loras=0)
    cfg = llm.engine.model_config
    wbytes, kv = weight_bytes(llm.engine.model), kv_bytes_per_token(cfg, 2)
    decode_round(llm, prompts, lambda i, n: greedy(n), 2)  # CUDA graphs, autotuning
    rounds = [decode_round(llm, prompts, lambda i, n: greedy(n), steps) for _ in range(2)]
    r = min(rounds, key=lambda r: r.step_s)
    nbytes = wbytes + len(prompts) * r.mean_context * kv
    s.result.update(model=model, architecture=cfg.architecture, weight_bytes=wbytes,
                    step_ms=round(r.step_s * 1e3, 2), mean_context=round(r.mean_context, 1),
                    mean_running=round(r.mean_running, 1), bytes_per_step=int(nbytes),
                    decode_tok_s=round(r.tok_s, 1),
                    qwen3_roofline_fraction_b64=round(nbytes / bw / r.step_s, 3))


def lora_vs_base(llm: LLM, s: Section, prompts, steps: int, rounds: int = 3) -> None:
    """`lora_vs_base_b64` from its own interleaved rounds, the best of each side: one short round
    per config (the grid above) is a few hundred ms, and varies by 1-2% from round to round."""
    tok_s: dict[str, list[float]] = {"base": [], "lora_8": []}
    for _ in range(rounds):
        for key, adapters in (("base", 0), ("lora_8", 8)):
            r = decode_round(llm, prompts, lambda i, n, d=adapters: greedy(n, f"a{i % d}"
                                                                          if d else None), steps)
            tok_s[key].append(round(r.tok_s, 1))
    s.result["lora_vs_base_rounds_tok_s"] = tok_s
    s.result["lora_vs_base_b64"] = round(max(tok_s["lora_8"]) / max(tok_s["base"]), 3)


def lora_kernel(s: Section, cfg, bw: float, batch: int = 64) -> None:
    """Bytes/s of shrink + expand over all four fused projections of 8 layers, every token its
    own adapter, with the kernel the decode graphs replay for such a step (`graph_kernel`):
    each slot's weights read once per pass (1 GB+, far past L2)."""
    small = dataclasses.replace(cfg, num_layers=8)
    slots = side_by_side(LoraSlots(small, batch, batch * RANK, RANK, torch.bfloat16, "cuda"),
                         RANK)
    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device="cuda")

    indptr, seg_slots = segment_table(list(range(batch)), batch)
    info = (LoraBatchInfo.segmented(ints(indptr), ints(seg_slots)) if graph_kernel(batch)
            == "segmented" else LoraBatchInfo.per_token(ints(list(range(batch)))))
    s.result["lora_kernel_graph_kernel"] = info.kernel
    xs = {f: torch.randn(batch, slots.layers[0][f].a.shape[2], device="cuda",
                         dtype=torch.bfloat16) for f in FUSED}
    ys = {f: torch.randn(batch, slots.layers[0][f].b.shape[1], device="cuda",
                         dtype=torch.bfloat16) for f in FUSED}
    nbytes = sum(t.numel() * t.element_size() for layer in slots.layers
                 for stack in layer.values() for t in (stack.a, stack.b))
    nbytes += small.num_layers * sum(x.numel() * 2 + 2 * y.numel() * 2
                                     for x, y in zip(xs.values(), ys.values(), strict=True))

    def one_pass() -> None:
        for layer in range(small.num_layers):
            for f in FUSED:
                slots.apply(ys[f], xs[f], layer, f, info)

    def timed(run) -> float:
        times = []
        for _ in range(10):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return statistics.median(times)

    for _ in range(3):  # compiles and autotunes, outside the capture
        one_pass()
    eager = timed(one_pass)
    s.result.update(lora_kernel_eager_bw_fraction=round(nbytes / eager / bw, 3),
                    lora_kernel_eager_pass_ms=round(eager * 1e3, 3))
    # The engine runs these kernels inside its decode graphs, so the pass is timed as a graph
    # replay too: that is the kernels' own bandwidth, without Python's per-launch cost.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        one_pass()
    t = timed(graph.replay)
    s.result.update(lora_kernel_bw_fraction=round(nbytes / t / bw, 3),
                    lora_kernel_bytes_per_pass=nbytes, lora_kernel_pass_ms=round(t * 1e3, 3),
                    lora_kernel_launches_per_pass=small.num_layers * len(FUSED))


class RepeatLast:
    """A host drafter that always proposes k drafts (the last token again), for the
    synchronous speculative step (it has no `propose_on_device`, so it never loops): every
    decode then verifies k + 1 positions, whatever is accepted, which is the cost measured."""

    def propose(self, tokens: list[int], k: int, namespace: object = None) -> list[int]:
        return [tokens[-1]] * k


def speculative(llm: LLM, s: Section, prompts, steps: int, k: int = 4) -> None:
    """The step time of verifying k drafts per decode ÷ a plain decode step (CUDA graph) at
    batch 1 and 16, in the overlapped speculative loop (prompt lookup on the device, every step
    verifying k drafts per sequence whatever it found); the synchronous speculative step
    beside it for reference; and batch-64 decode throughput with speculation enabled ÷ without
    (it stays off there: more than `MAX_BATCH` decodes). Two interleaved rounds each, best of
    each."""
    eng = llm.engine
    for b in (1, 16, 64):
        kinds = ("off", "on", "sync") if b < 64 else ("off", "on")
        runs: dict[str, list] = {kind: [] for kind in kinds}
        drafted = 0  # sequence-steps that carried drafts, in the "on" rounds
        for _ in range(2):
            for kind in runs:
                # Random weights reject the drafts: without min_acceptance=0 a request would
                # stop drafting after its first PROBATION drafts, and the steps timed would be
                # plain ones.
                spec = None if kind == "off" else Speculator(
                    k, RepeatLast() if kind == "sync" else None, min_acceptance=0.0)
                eng.speculator = spec
                try:
                    runs[kind].append(decode_round(llm, prompts[:b], lambda i, n: greedy(n),
                                                   steps))
                finally:
                    eng.speculator = None
                drafted += spec.stats.forwards if spec and kind == "on" else 0
        best = {kind: min(r.step_s for r in runs[kind]) for kind in kinds}
        off, on = best["off"], best["on"]
        s.result[f"step_ms_b{b}"] = {kind: round(t * 1e3, 2) for kind, t in best.items()}
        # of the on rounds' sequence-steps past prefill
        s.result[f"step_ms_b{b}"]["drafted_fraction"] = round(drafted / (2 * b * (steps + 2)), 3)
        if b == 64:
            s.result["spec_on_vs_off_b64"] = round(off / on, 3)
        else:
            s.result[f"spec_verify_cost_b{b}"] = round(on / off, 3)
            s.result[f"spec_sync_verify_cost_b{b}"] = round(best["sync"] / off, 3)


def constrained(llm: LLM, s: Section, prompts, steps: int) -> None:
    """Decode tokens/s per running sequence at batch 64 with a JSON schema on every request ÷
    without; two interleaved rounds each, best of each (the contexts come from the decode
    section's cache). Per running sequence: a constrained request may complete its document
    and leave the batch inside the timed steps (an unconstrained one runs on, ignoring EOS),
    and a smaller batch is not the masks' cost."""
    rf = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}
    runs: dict[str, list] = {"constrained": [], "unconstrained": []}
    forced = llm.engine.grammar.jump_forward_tokens
    for _ in range(2):
        for kind in runs:
            kw = {"response_format": rf} if kind == "constrained" else {}
            r = decode_round(llm, prompts, lambda i, n, kw=kw: greedy(n, **kw), steps)
            runs[kind].append(r)
    best = {k: max(v, key=lambda r: r.tok_s) for k, v in runs.items()}
    s.result.update({f"{k}_tok_s": round(r.tok_s, 1) for k, r in best.items()})
    s.result.update({f"{k}_mean_running": round(r.mean_running, 1) for k, r in best.items()})
    # Steps with a jump-forward chunk in the batch run eagerly (no decode graph fits them).
    s.result.update({f"{k}_chunk_steps": f"{r.chunk_steps}/{r.steps}" for k, r in best.items()})
    s.result["jump_forward_tokens"] = llm.engine.grammar.jump_forward_tokens - forced
    c, u = best["constrained"], best["unconstrained"]
    s.result["constrained_vs_unconstrained_raw_b64"] = round(c.tok_s / u.tok_s, 3)
    s.result["constrained_vs_unconstrained_b64"] = round(
        (c.tok_s / c.mean_running) / (u.tok_s / u.mean_running), 3)


def session_ttft(llm: LLM, s: Section, vocab: int, history: int = 4096, turn: int = 64) -> None:
    """Time to first token of a turn after `history` tokens: a cold request (nothing cached)
    ÷ the next turn of the same session (its history pinned in the prefix cache)."""
    eng = llm.engine

    def ttft(rid: str, prompt: list[int], session: str) -> tuple[float, int]:
        return first_token(eng, rid, prompt, session)[:2]

    cold, warm = [], []
    for k in range(4):  # the first pair is a warm-up
        hist, t1, t2 = random_prompts(3, [history, turn, turn], seed=100 + k, vocab=vocab)
        c, tok = ttft(f"cold-{k}", hist + t1, f"sess-{k}")
        w, _ = ttft(f"warm-{k}", hist + t1 + [tok] + t2, f"sess-{k}")
        eng.release_session(f"sess-{k}")
        if k:
            cold.append(c)
            warm.append(w)
    c, w = statistics.median(cold), statistics.median(warm)
    s.result.update(cold_ttft_ms=round(c * 1e3, 1), session_ttft_ms=round(w * 1e3, 1),
                    session_ttft_speedup_4k=round(c / w, 2))
    # Where a cached turn's time goes: GPU kernels vs host (one more session, profiled).
    hist, t1, t2 = random_prompts(3, [history, turn, turn], seed=99, vocab=vocab)
    _, tok = ttft("cold-p", hist + t1, "sess-p")
    s.result["session_profile"] = profile(lambda: ttft("warm-p", hist + t1 + [tok] + t2,
                                                       "sess-p"))
    eng.release_session("sess-p")


if __name__ == "__main__":
    main()
