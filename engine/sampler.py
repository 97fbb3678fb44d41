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


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}  # request_id -> seeded generator

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> list[SampleResult]:
        """logits: [N, V] fp32 (modified in place), on any device; reqs: the N requests, row
        order."""
        dev = logits.device
        for i, req in enumerate(reqs):
            p = req.params
            if p.logit_bias:
                bias = {t: b for t, b in p.logit_bias.items() if int(t) < logits.shape[1]}
                ids = torch.tensor([int(t) for t in bias], dtype=torch.long, device=dev)
                logits[i, ids] += torch.tensor(list(bias.values()), device=dev)
            if p.needs_penalties and req.num_output_tokens:
                _apply_penalties(logits[i], req)

        want_logprobs = [r.params.logprobs is not None for r in reqs]
        logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=dev)
            probs = _filtered_probs(logits[rows], [reqs[i] for i in random_rows])
            tokens[rows] = self._draw(probs, [reqs[i] for i in random_rows])

        out = []
        token_list = tokens.tolist()
        for i, req in enumerate(reqs):
            lp = None
            if logprobs is not None and want_logprobs[i]:
                k = req.params.logprobs or 0
                row = logprobs[i]
                top = []
                if k:
                    vals, ids = row.topk(k)
                    top = list(zip(ids.tolist(), vals.tolist(), strict=True))
                lp = TokenLogprob(token_list[i], float(row[token_list[i]]), top)
            out.append(SampleResult(token_list[i], lp))
        return out

    def _draw(self, probs: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Exponential race: argmax(p / E) with E ~ Exp(1) draws a token with probability p.

        The noise is drawn on the CPU, so a seeded request gives the same tokens on any device.
        """
        noise = torch.empty(probs.shape, dtype=probs.dtype)
        for i, req in enumerate(reqs):
            seed = req.params.seed
            if seed is None:
                noise[i].exponential_(generator=self.generator)
                continue
            g = self._generators.get(req.request_id)
            if g is None:
                g = self._generators[req.request_id] = torch.Generator().manual_seed(seed)
            noise[i].exponential_(generator=g)
        return (probs / noise.to(probs.device)).argmax(dim=-1)


def _apply_penalties(row: torch.Tensor, req: Request) -> None:
    """OpenAI presence/frequency penalties and the multiplicative repetition penalty."""
    p = req.params
    out = torch.tensor(req.output_token_ids, dtype=torch.long, device=row.device)
    counts = torch.bincount(out, minlength=row.shape[0])[: row.shape[0]].to(row.dtype)
    if p.repetition_penalty != 1.0:
        seen = torch.zeros_like(row, dtype=torch.bool)
        seen[torch.tensor(req.token_ids, dtype=torch.long, device=row.device)] = True
        penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        row.copy_(torch.where(seen, penalized, row))
    row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def _filtered_probs(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Temperature, then top-k / top-p / min-p masks; returns probabilities [N, V]."""
    dev = logits.device
    temps = torch.tensor([r.params.temperature for r in reqs], dtype=logits.dtype, device=dev)
    logits = logits / temps.unsqueeze(1)
    top_k = [r.params.top_k for r in reqs]
    top_p = [r.params.top_p for r in reqs]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[1]
        k = torch.tensor([k if k > 0 else vocab for k in top_k], device=dev).unsqueeze(1)
        ranks = torch.arange(vocab, device=dev).unsqueeze(0)
        drop = ranks >= k
        sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p; the first stays.
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= before >= torch.tensor(top_p, dtype=logits.dtype, device=dev).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    min_p = torch.tensor([r.params.min_p for r in reqs], dtype=probs.dtype, device=dev)
    min_p = min_p.unsqueeze(1)
    if (min_p > 0).any():
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs
