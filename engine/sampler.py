"""Turns the last-position logits of a step into tokens.

Order per row: logit bias and penalties -> (logprobs) -> greedy, or temperature, top-k, top-p,
min-p and a draw. Rows with a seed draw from their own generator, so a seeded request gives
the same tokens alone or in any batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.messages import TokenLogprob
from engine.request import Request


@dataclass
class SampleResult:
    token_id: int
    logprob: TokenLogprob | None = None
    error: str | None = None  # the row could not be sampled: its request fails with this


@dataclass
class Drawn:
    """Tokens drawn on the device, on their way back to the host."""

    tokens: torch.Tensor  # (N,) int64 on the device; -1 for rows that could not be sampled
    host: torch.Tensor  # (N,) the same, in (pinned) host memory once `done` has passed
    done: torch.cuda.Event | None  # None on the CPU
    reqs: list[Request]
    logprobs: torch.Tensor | None  # (N, V) log-softmax, when a row asked for logprobs
    logprob_rows: list[int]


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}  # request_id -> seeded generator

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def __call__(
        self, logits: torch.Tensor, reqs: list[Request], ok: torch.Tensor | None = None
    ) -> list[SampleResult]:
        """Draw and read back at once: `collect(launch(...))`."""
        return self.collect(self.launch(logits, reqs, ok))

    @torch.inference_mode()
    def launch(
        self, logits: torch.Tensor, reqs: list[Request], ok: torch.Tensor | None = None
    ) -> Drawn:
        """Queue the draw of every row; nothing waits for the device.

        logits: [N, V] fp32 (modified in place), on any device; reqs: the N requests, row
        order. ok: [N] bool on the logits' device, or None for all; a row not ok comes back with
        token_id -1 (its request fails). The tokens (with `ok` folded in) start back to the
        host at once, into pinned memory: `collect` waits for that copy only, the step's one
        sync for a batch without logprobs.
        """
        dev = logits.device
        random_rows: list[int] = []
        logprob_rows: list[int] = []
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
            if p.logprobs is not None:
                logprob_rows.append(i)

        logprobs = torch.log_softmax(logits, dim=-1) if logprob_rows else None

        tokens = logits.argmax(dim=-1)
        if random_rows:
            rows = _upload(random_rows, torch.long, dev)
            probs = _filtered_probs(logits[rows], [reqs[i] for i in random_rows])
            tokens[rows] = self._draw(probs, [reqs[i] for i in random_rows])
        if ok is not None:
            tokens = torch.where(ok, tokens, -1)
        if not tokens.is_cuda:
            return Drawn(tokens, tokens, None, reqs, logprobs, logprob_rows)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return Drawn(tokens, host, done, reqs, logprobs, logprob_rows)

    @torch.inference_mode()
    def collect(self, drawn: Drawn) -> list[SampleResult]:
        """Wait for the drawn tokens; one `SampleResult` per row, in row order."""
        if drawn.done is not None:
            drawn.done.synchronize()
        token_list = drawn.host.tolist()
        out = [SampleResult(t) for t in token_list]
        for i in drawn.logprob_rows:
            t = token_list[i]
            if t < 0:
                continue
            k = drawn.reqs[i].params.logprobs or 0
            row = drawn.logprobs[i]
            top = []
            if k:
                vals, ids = row.topk(k)
                top = list(zip(ids.tolist(), vals.tolist(), strict=True))
            out[i].logprob = TokenLogprob(t, float(row[t]), top)
        return out

    def _draw(self, probs: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Exponential race: argmax(p / E) with E ~ Exp(1) draws a token with probability p.

        The noise is drawn on the CPU, so a seeded request gives the same tokens on any device.
        """
        # Pinned where the rows are on a GPU, so the upload does not wait for the forward.
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
    """OpenAI presence/frequency penalties and the multiplicative repetition penalty."""
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
    """Temperature, then top-k / top-p / min-p masks; returns probabilities [N, V]."""
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
        # Drop a token when the mass strictly before it already reaches top_p; the first stays.
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
    """A small tensor from host values onto `device`, through pinned memory without waiting for
    the GPU's queued work (`torch.tensor(..., device=cuda)` waits for it)."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)
