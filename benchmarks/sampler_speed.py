"""The sampler alone: milliseconds per call (launch + collect) for the device sampler
(engine/sampling/sampler.py) against the host-noise sampler it replaced (kept below as the
baseline), in
one process, at batch 64 for Llama-3's vocabulary (128256) and SmolLM2's (49152).

Each call gets fresh logits (random, fp32) and its requests' tokens grow by the drawn one, as in
decoding; every request has a 1024-token prompt and 128 output tokens so far. Times are the
median of `--reps` calls after two warm-up calls; on CUDA each call ends with its one sync.

    .venv/bin/python benchmarks/sampler_speed.py [--device cpu|cuda] [--reps 7] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.machine import describe
from engine.core.request import Request
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import Sampler

BATCH = 64
VOCABS = {"Llama-3": 128256, "SmolLM2": 49152}
WORKLOADS: dict[str, Callable[[int], SamplingParams]] = {
    "greedy": lambda i: SamplingParams(temperature=0.0),
    "T=0.8": lambda i: SamplingParams(temperature=0.8),
    "T=0.8, top_p=0.9": lambda i: SamplingParams(temperature=0.8, top_p=0.9),
    "T=0.8, top_p=0.9, top_k=50, seed": lambda i: SamplingParams(
        temperature=0.8, top_p=0.9, top_k=50, seed=i),
    "T=0.8, penalties, logit_bias": lambda i: SamplingParams(
        temperature=0.8, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1,
        logit_bias={11: 2.0, 42: -5.0}),
}


def requests(vocab: int, params: Callable[[int], SamplingParams]) -> list[Request]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(BATCH):
        r = Request(f"r{i}", torch.randint(0, vocab, (1024,), generator=gen).tolist(), params(i))
        r.token_ids.extend(torch.randint(0, vocab, (128,), generator=gen).tolist())
        out.append(r)
    return out


def time_calls(sampler, vocab: int, params, device: torch.device, reps: int) -> float:
    """Median milliseconds per call."""
    reqs = requests(vocab, params)
    logits = torch.randn(BATCH, vocab, device=device)
    times = []
    for rep in range(reps + 2):
        x = logits.clone()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        tokens = sampler(x, reqs)
        elapsed = time.perf_counter() - start
        for r, t in zip(reqs, tokens, strict=True):
            r.token_ids.append(t.token_id if hasattr(t, "token_id") else t)
        if rep >= 2:
            times.append(elapsed * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", help="write the markdown table here too")
    args = ap.parse_args()
    device = torch.device(args.device)
    lines = [
        f"Machine: {torch.cuda.get_device_name() if device.type == 'cuda' else describe()}; "
        f"device {device.type}; batch {BATCH}; median of {args.reps} calls.",
        "",
        "| vocab | workload | baseline ms | device sampler ms | new / old |",
        "|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for name, vocab in VOCABS.items():
        for workload, params in WORKLOADS.items():
            old = time_calls(BaselineSampler(), vocab, params, device, args.reps)
            new = time_calls(Sampler(), vocab, params, device, args.reps)
            line = f"| {name} ({vocab}) | {workload} | {old:.2f} | {new:.2f} | {new / old:.3f} |"
            print(line, flush=True)
            lines.append(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


# -- BASELINE: engine/sampling/sampler.py before the device sampler (commit e925171), kept verbatim
# -- except that it returns the token ids and leaves out logprobs (no workload asks for them).
# -- Host noise: a Python loop per sampled row draws Exp(1) over the whole vocabulary on the
# -- CPU and uploads it; top-k / top-p sort the whole vocabulary; penalties loop per row.


class BaselineSampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> list[int]:
        dev = logits.device
        random_rows: list[int] = []
        for i, req in enumerate(reqs):
            p = req.params
            if p.logit_bias:
                bias = {t: b for t, b in p.logit_bias.items() if int(t) < logits.shape[1]}
                ids = _upload([int(t) for t in bias], torch.long, dev)
                logits[i, ids] += _upload(list(bias.values()), torch.float32, dev)
            if p.needs_penalties and req.num_output_tokens:
                _apply_penalties(logits[i], req)
            if not p.greedy:
                random_rows.append(i)
        tokens = logits.argmax(dim=-1)
        if random_rows:
            rows = _upload(random_rows, torch.long, dev)
            probs = _filtered_probs(logits[rows], [reqs[i] for i in random_rows])
            tokens[rows] = self._draw(probs, [reqs[i] for i in random_rows])
        if not tokens.is_cuda:
            return tokens.tolist()
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        return host.tolist()

    def _draw(self, probs: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        noise = torch.empty(probs.shape, dtype=probs.dtype, pin_memory=probs.is_cuda)
        for i, req in enumerate(reqs):
            seed = req.params.seed
            if seed is None:
                noise[i].exponential_(generator=self.generator)
                continue
            g = self._generators.get(req.request_id)
            if g is None:
                g = self._generators[req.request_id] = torch.Generator().manual_seed(seed)
            noise[i].exponential_(generator=g)
        return (probs / noise.to(probs.device, non_blocking=True)).argmax(dim=-1)


def _apply_penalties(row: torch.Tensor, req: Request) -> None:
    p = req.params
    out = _upload(req.output_token_ids, torch.long, row.device)
    counts = torch.bincount(out, minlength=row.shape[0])[: row.shape[0]].to(row.dtype)
    if p.repetition_penalty != 1.0:
        seen = torch.zeros_like(row, dtype=torch.bool)
        seen[_upload(req.token_ids, torch.long, row.device)] = True
        penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        row.copy_(torch.where(seen, penalized, row))
    row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def _filtered_probs(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    dev = logits.device
    temps = _upload([r.params.temperature for r in reqs], logits.dtype, dev)
    logits = logits / temps.unsqueeze(1)
    top_k = [r.params.top_k for r in reqs]
    top_p = [r.params.top_p for r in reqs]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[1]
        k = _upload([k if k > 0 else vocab for k in top_k], torch.long, dev).unsqueeze(1)
        ranks = torch.arange(vocab, device=dev).unsqueeze(0)
        drop = ranks >= k
        sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= before >= _upload(top_p, logits.dtype, dev).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    if any(r.params.min_p > 0 for r in reqs):
        min_p = _upload([r.params.min_p for r in reqs], probs.dtype, dev).unsqueeze(1)
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def _upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


if __name__ == "__main__":
    main()
