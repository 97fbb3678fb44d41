"""Turns the last-position logits of a step into tokens, for all rows at once on the device.

Order per row: logit bias, repetition penalty, presence and frequency penalties, min_tokens
bans -> (logprobs) -> greedy, or temperature, top-k, top-p, min-p and a draw. The host sends the
step's parameters in one copy (`engine.sampling.rows`, `kernels.upload`); the only sync of a
step is reading the tokens back in `collect`.

The draw is an exponential race (`engine.sampling.race`) over noise hashed on the device from the
request's seed, the index of the token being drawn and the candidates' ids: a seeded request
gets the same noise alone or in any batch, on the CPU or a GPU, and so the same tokens (up to
float rounding of its own probabilities, which only decides near-exact ties). An unseeded
request gets a seed drawn once from the engine-seeded generator, so every row takes the same
path.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.core.request import Request
from engine.messages import TokenLogprob
from engine.sampling.counter_rng import hash32
from engine.sampling.race import Race
from engine.sampling.rows import GREEDY, PLAIN, TOP_K, RowState, StepRows
from kernels.upload import to_host, upload_arrays

TIE_MARGIN = 64  # candidates past max(top_k) that settle ties at the k-th place by token id


@dataclass
class SampleResult:
    token_id: int
    logprob: TokenLogprob | None = None
    error: str | None = None  # the row could not be sampled: its request fails with this


class Logprobs(NamedTuple):
    """The logprob rows' numbers, in (pinned) host memory once `Drawn.done` has passed."""

    chosen: torch.Tensor  # (L,) fp32: the drawn token's logprob
    top_ids: torch.Tensor  # (L, k) int64, best first; k: the most any row asked for
    top_values: torch.Tensor  # (L, k) fp32


@dataclass
class Drawn:
    """Tokens drawn on the device, on their way back to the host."""

    tokens: torch.Tensor  # (N,) int64 on the device; -1 for rows that could not be sampled
    host: torch.Tensor  # (N,) the same, in (pinned) host memory once `done` has passed
    done: torch.cuda.Event | None  # None on the CPU
    reqs: list[Request]
    logprobs: Logprobs | None  # when a row asked for logprobs
    logprob_rows: list[int]  # the rows of `logprobs`, in order


class Sampler:
    def __init__(self, seed: int = 0, eos_token_ids: Iterable[int] = ()):
        """`eos_token_ids`: banned, with each request's stop_token_ids, until the request has
        `min_tokens` output tokens (unless it ignores EOS)."""
        self.rng = random.Random(seed)  # seeds of unseeded requests
        self.eos_token_ids = tuple(eos_token_ids)
        self._states: dict[str, RowState] = {}  # request_id -> what a request's steps share
        self.race = Race()

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def __call__(
        self, logits: torch.Tensor, reqs: list[Request], ok: torch.Tensor | None = None
    ) -> list[SampleResult]:
        """Draw and read back at once: `collect(launch(...))`."""
        return self.collect(self.launch(logits, reqs, ok))

    @torch.inference_mode()
    def launch(
        self,
        logits: torch.Tensor,
        reqs: list[Request],
        ok: torch.Tensor | None = None,
        offsets: list[int] | None = None,
        positions: torch.Tensor | None = None,
    ) -> Drawn:
        """Queue the draw of every row; nothing waits for the device.

        logits: [N, V] fp32, contiguous (modified in place), on any device; reqs: the N
        requests, row order. ok: [N] bool on the logits' device, or None for all; a row not ok
        comes back with token_id -1 (its request fails). offsets: per row, how far past its
        request's last token the row's position is (a request may have several rows: the
        positions of a speculative step; None: one row each). positions: [N] int64 on the
        logits' device, each row's index in its request's output, when only the device knows
        it (the overlapped speculative loop: engine/spec/loop.py); it keys the noise instead
        of the host's count and `offsets`. The tokens (with `ok` folded in) start back to the
        host at once, into pinned memory: `collect` waits for that copy only, the step's one
        sync.
        """
        rows, on = self._prepare(logits, reqs, offsets, positions is not None)
        if positions is not None and "seed_keys" in on:
            on["ints"][1] = hash32(on["seed_keys"] ^ hash32(positions))
        tokens = self._draw(logits, rows, on)
        logprobs = None
        if rows.logprob_rows:
            logprobs = _logprobs(logits, on["logprob_rows"], tokens, rows.logprob_k)
        if ok is not None:
            tokens = torch.where(ok, tokens, -1)
        if not tokens.is_cuda:
            return Drawn(tokens, tokens, None, reqs, logprobs, rows.logprob_rows)
        host = to_host(tokens)
        if logprobs is not None:
            logprobs = Logprobs(*map(to_host, logprobs))
        done = torch.cuda.Event()
        done.record()
        return Drawn(tokens, host, done, reqs, logprobs, rows.logprob_rows)

    @torch.inference_mode()
    def collect(self, drawn: Drawn) -> list[SampleResult]:
        """Wait for the drawn tokens; one `SampleResult` per row, in row order."""
        if drawn.done is not None:
            drawn.done.synchronize()
        token_list = drawn.host.tolist()
        out = [SampleResult(t) for t in token_list]
        if drawn.logprobs is None:
            return out
        chosen, top_ids, top_values = (t.tolist() for t in drawn.logprobs)
        for j, i in enumerate(drawn.logprob_rows):
            if token_list[i] < 0:
                continue
            k = drawn.reqs[i].params.logprobs or 0
            top = list(zip(top_ids[j][:k], top_values[j][:k], strict=True))
            out[i].logprob = TokenLogprob(token_list[i], chosen[j], top)
        return out

    @torch.inference_mode()
    def distribution(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """[N, V]: the probabilities each row draws from (greedy rows: one-hot), by the path
        `launch` takes (tests compare it with the definitions). `logits` stay as they are."""
        logits = logits.clone()
        rows, on = self._prepare(logits, reqs)
        greedy = torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[1])
        if rows.path == GREEDY:
            return greedy.to(logits.dtype)
        probs = self._filtered(logits, rows, on)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        if not rows.any_greedy:
            return probs
        return torch.where(on["greedy"].unsqueeze(1), greedy.to(probs.dtype), probs)

    def _state(self, req: Request, vocab: int) -> RowState:
        st = self._states.get(req.request_id)
        if st is None or st.req is not req:
            st = self._states[req.request_id] = RowState(req, self.rng, vocab, self.eos_token_ids)
        return st

    def _prepare(
        self, logits: torch.Tensor, reqs: list[Request], offsets: list[int] | None = None,
        keys_on_device: bool = False,
    ) -> tuple[StepRows, dict[str, torch.Tensor]]:
        """The step's parameters, sent in one copy, and bias, penalties and bans applied."""
        rows = StepRows(reqs, logits.shape[1], self._state, offsets, keys_on_device)
        on = upload_arrays(rows.arrays, logits.device)
        _adjust(logits, on)
        return rows, on

    def _draw(
        self, logits: torch.Tensor, rows: StepRows, on: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """(N,) int64: greedy rows' argmax, the others' draw."""
        if rows.path == GREEDY:
            return logits.argmax(dim=-1)
        drawn = self.race(self._filtered(logits, rows, on), on["ints"][1])
        if rows.any_greedy:
            drawn = torch.where(on["greedy"], logits.argmax(dim=-1), drawn)
        return drawn

    def _filtered(
        self, logits: torch.Tensor, rows: StepRows, on: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """[N, V]: each row's distribution after temperature, top-k, top-p and min-p,
        unnormalized, in vocabulary order. One path for the batch: the whole vocabulary when
        no row filters by rank or mass, the top max(k) when every sampled row has a top-k,
        else a full sort. The race after it is the same for every path, so a row's token does
        not depend on which one its batch took."""
        temperature, top_p, min_p = on["floats"].unsqueeze(2)  # each (N, 1)
        top_p = top_p if rows.any_top_p else None
        min_p = min_p if rows.any_min_p else None
        if rows.path == PLAIN:
            probs = torch.softmax(logits / temperature, dim=-1)
            if min_p is not None:
                probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
            return probs
        # Temperature keeps the order: select on the logits, scale the candidates only.
        if rows.path == TOP_K:
            vals, ids = _top_k(logits, rows.k)
            dense = torch.zeros_like(logits)
        else:
            vals, ids = logits.sort(dim=-1, descending=True, stable=True)
            dense = torch.empty_like(logits)  # every entry is written: ids is a permutation
        probs = filter_sorted(vals / temperature, on["ints"][0].unsqueeze(1), top_p, min_p)
        return dense.scatter_(1, ids, probs)


def filter_sorted(
    vals: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """Probabilities of sorted candidates after top-k, top-p and min-p; dropped ones are 0.

    Args:
        vals: [N, K] temperature-scaled logits, best first (ties: lower token id first).
        top_k, top_p, min_p: [N, 1] per row (top_k >= K: off; None: off for every row).
    Returns [N, K], proportional to the row's filtered distribution (not renormalized: the
    race does not need it). A candidate is dropped past rank top_k; when the mass strictly
    before it already reaches top_p (of the top-k renormalized mass; the first always stays);
    when its probability is below min_p times the top one.
    """
    ranks = torch.arange(vals.shape[1], device=vals.device)
    probs = torch.softmax(vals.masked_fill(ranks >= top_k, float("-inf")), dim=-1)
    if top_p is not None:
        probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= top_p, 0.0)
    if min_p is not None:
        probs = probs.masked_fill(probs < min_p * probs[:, :1], 0.0)
    return probs


def _top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best of each row, best first, ties in token id order on any device. torch.topk
    breaks ties its own way, so it takes TIE_MARGIN more and a stable sort orders those: a tie
    at the k-th place is settled by id unless it spans more than TIE_MARGIN further tokens."""
    vals, ids = logits.topk(min(k + TIE_MARGIN, logits.shape[1]), dim=-1)
    ids, order = ids.sort(dim=-1)
    vals, order = vals.gather(1, order).sort(dim=-1, descending=True, stable=True)
    return vals[:, :k], ids.gather(1, order[:, :k])


def _adjust(logits: torch.Tensor, on: dict[str, torch.Tensor]) -> None:
    """Logit bias, penalties and min_tokens bans, in place, from the step's sparse entries
    (indices into the flattened logits)."""
    flat = logits.view(-1)
    if "bias_at" in on:
        at = on["bias_at"]
        flat[at] = flat[at] + on["bias_values"]
    if "repetition_at" in on:
        at, rp = on["repetition_at"], on["repetition_values"]
        seen = flat[at]  # read before any write: repeated entries write the same value
        flat[at] = torch.where(seen > 0, seen / rp, seen * rp)
    if "penalty_at" in on:
        at = on["penalty_at"]
        flat[at] = flat[at] + on["penalty_values"]
    if "ban_at" in on:
        at = on["ban_at"]
        was = flat[at]
        flat.index_fill_(0, at, float("-inf"))
        # A row left with nothing (a grammar that may only end) keeps its banned tokens.
        dead = logits.amax(dim=-1) == float("-inf")
        flat[at] = torch.where(dead[at // logits.shape[1]], was, float("-inf"))


def _logprobs(
    logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, k: int
) -> Logprobs:
    """The model's log-softmax (after bias and penalties, before temperature) at `rows`: the
    drawn token's and the k best."""
    lp = torch.log_softmax(logits[rows], dim=-1)  # (L, V)
    chosen = lp.gather(1, tokens[rows].unsqueeze(1))[:, 0]
    top_values, top_ids = lp.topk(k, dim=-1)
    return Logprobs(chosen, top_ids, top_values)
