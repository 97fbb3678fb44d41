"""What the GPU suite's workers share: sections that record instead of dying, the byte counts
behind the roofline figures, random prompts and adapters, and timed engine decode rounds.

Everything goes through the public engine API (`LLM`, `LLMEngine.add_request` / `step`), so
whatever CUDA path the engine has underneath is what gets measured.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.llm import CompletionOutput
from lora.validate import projection_dims

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCK = {p: "self_attn" if p in ALL[:4] else "mlp" for p in ALL}


# -- sections ---------------------------------------------------------------------------


@dataclass
class Section:
    name: str
    deadline: float  # time.monotonic() after which the section stops starting new work
    result: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def left(self) -> float:
        return self.deadline - time.monotonic()


class Recorder:
    """Each section's result (or its error) goes to `out` as one JSON line when it ends, so a
    worker killed at its hard limit loses only the section it was in."""

    def __init__(self, out: Path, budget_s: float):
        self.out, self.end = out, time.monotonic() + budget_s

    @contextmanager
    def section(self, name: str, budget_s: float) -> Iterator[Section]:
        s = Section(name, min(time.monotonic() + budget_s, self.end))
        t0 = time.monotonic()
        status = "ok"
        try:
            yield s
        except Exception as e:  # noqa: BLE001 - record every failure, go on to the next section
            status = f"error: {type(e).__name__}: {e}"[:500]
            s.notes.append(traceback.format_exc(limit=6)[-1500:])
            print(f"[{name}] FAILED {status}", flush=True)
        finally:
            line = {"section": name, "status": status, "seconds": round(time.monotonic() - t0, 1),
                    "result": s.result, "notes": s.notes}
            with self.out.open("a") as f:
                f.write(json.dumps(line) + "\n")
            print(f"[{name}] {status} in {line['seconds']} s: {json.dumps(s.result)}", flush=True)


# -- bytes --------------------------------------------------------------------------------


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every matrix once, except the embedding table,
    of which only the batch's rows are read (unless tied to lm_head, which reads it whole)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens.weight
    if model.lm_head.weight is not embed:
        total -= embed.numel() * embed.element_size()
    return total


def kv_bytes_per_token(cfg: ModelConfig, itemsize: int) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def adapter_bytes(cfg: ModelConfig, rank: int, itemsize: int) -> int:
    """One adapter's A and B on all 7 projections of every layer (a device slot's bytes)."""
    per_layer = sum((fan_in + fan_out) * rank for fan_in, fan_out in projection_dims(cfg).values())
    return per_layer * cfg.num_layers * itemsize


def copy_bandwidth(device: str = "cuda", gib: float = 2.0, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written
    (median of `reps` copies of a `gib` GiB buffer, far larger than L2)."""
    src = torch.randn(int(gib * 2**30) // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    return 2 * src.numel() * src.element_size() / times[len(times) // 2]


# -- inputs -------------------------------------------------------------------------------


def random_prompts(n: int, length: int | list[int], seed: int, vocab: int) -> list[list[int]]:
    """`n` prompts of random token ids (no special tokens: ids from 3 up)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [length] * n if isinstance(length, int) else length
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lengths]


def write_adapter(folder: Path, cfg: ModelConfig, rank: int, seed: int, device: str) -> None:
    """A random PEFT LoRA (bf16, alpha = 2 * rank) on all 7 projections, made on `device`."""
    if (folder / "adapter_config.json").is_file():
        return
    g = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for i in range(cfg.num_layers):
        for proj, (fan_in, fan_out) in projection_dims(cfg).items():
            key = f"base_model.model.model.layers.{i}.{BLOCK[proj]}.{proj}"
            a = torch.randn(rank, fan_in, generator=g, device=device) / fan_in**0.5
            b = torch.randn(fan_out, rank, generator=g, device=device) * 0.02
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16).cpu()
            tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16).cpu()
    tmp = folder.with_suffix(".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(ALL), "lora_dropout": 0.0, "bias": "none"}
    (tmp / "adapter_config.json").write_text(json.dumps(config))
    tmp.rename(folder)


# -- engine rounds ------------------------------------------------------------------------


@dataclass
class Round:
    seconds: float  # the timed decode steps
    steps: int
    tokens: int  # output tokens the timed steps produced
    mean_context: float  # tokens of context per sequence, averaged over the timed steps
    mean_running: float  # sequences decoding, averaged over the timed steps
    chunk_steps: int = 0  # timed steps with a multi-token chunk (jump-forward): no decode graph

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def step_s(self) -> float:
        return self.seconds / self.steps


def decode_round(
    llm: LLM,
    prompts: list[list[int]],
    params: Callable[[int, int], SamplingParams],
    steps: int,
    warm_steps: int = 2,
) -> Round:
    """Add one request per prompt (`params(i, max_tokens)`), run the prefill and `warm_steps`
    decode steps untimed, time `steps` steps, then abort what is left. Prefill may take
    several steps, so max_tokens leaves room: every request stays in the batch through the
    last timed step unless it stops by itself."""
    eng = llm.engine
    tag = time.monotonic_ns()
    rids = [f"r{tag}-{i}" for i in range(len(prompts))]
    for i, (rid, p) in enumerate(zip(rids, prompts, strict=True)):
        eng.add_request(rid, p, params(i, warm_steps + steps + 64))
    while eng.num_waiting or any(r.num_computed_tokens < r.num_tokens - 1
                                 for r in eng.scheduler.running):
        eng.step()  # admission, adapter loads, prefill: not timed
    for _ in range(warm_steps):
        eng.step()
    _sync()
    context = running = tokens = chunks = 0
    t = time.perf_counter()
    for _ in range(steps):
        context += sum(r.num_tokens for r in eng.scheduler.running)
        running += len(eng.scheduler.running)
        chunks += any(r.num_tokens - r.num_computed_tokens > 1 for r in eng.scheduler.running)
        tokens += sum(len(o.new_token_ids) for o in eng.step())
    _sync()
    dt = time.perf_counter() - t
    for rid in rids:
        eng.abort_request(rid)
    return Round(dt, steps, tokens, context / max(running, 1), running / steps, chunks)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile(fn: Callable[[], Any], top: int = 6) -> dict[str, Any]:
    """Run `fn` once under torch.profiler: its wall time, the GPU's summed kernel time (the
    rest of the wall is host time the GPU waited on) and the costliest kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0
               and e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: -e.device_time_total)
    return {"wall_ms": round(wall * 1e3, 2),
            "gpu_kernel_ms": round(sum(e.device_time_total for e in kernels) / 1e3, 2),
            "top": [[e.key[:60], round(e.device_time_total / 1e3, 2), e.count]
                    for e in kernels[:top]]}


def first_token(eng: Any, rid: str, prompt: list[int],
                session: str | None = None) -> tuple[float, int, int]:
    """Run one greedy request of one token on an idle engine: (seconds to its first token,
    that token, its cached prompt tokens). The clock starts with the device idle."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    eng.add_request(rid, prompt, greedy(1), session_id=session)
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.request_id == rid and o.new_token_ids:
                dt = time.perf_counter() - t
                while eng.has_unfinished_requests():
                    eng.step()
                return dt, o.new_token_ids[0], o.num_cached_tokens
    raise RuntimeError(f"request {rid} finished without a token")


def greedy(max_tokens: int, adapter: str | None = None, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, adapter=adapter,
                          **kw)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams],
                   device: str) -> tuple[list[CompletionOutput], float]:
    """`llm.generate` from an empty prefix cache (a repeated workload would otherwise skip its
    prefills): its outputs and its seconds, the device synchronized on both sides."""
    llm.engine.reset_prefix_cache()
    sync(device)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync(device)
    return outs, time.perf_counter() - t
