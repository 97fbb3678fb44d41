"""Speculative decoding without a draft model: drafts looked up in the sequence itself, all
verified in one forward. Pure Python.

A decode step may carry up to k draft tokens per sequence (`ScheduledSeq.draft`). The forward
computes the last known token and the drafts as one chunk over the paged KV, and the sampler
draws a token at every position, each with the noise key it would have had without
speculation (the request's seed and the index of the token in the output). Draft i is accepted
when it equals the token drawn at its position; the tokens emitted are the drawn ones up to and
including the first that differs from its draft. So a request's tokens are the ones it would
have drawn one step at a time, for greedy and seeded sampling alike; and since a looked-up
draft is one token with certainty, accepting it exactly when the target draws it is
speculative sampling's rule (accept d with probability p(d), else draw from p without d).

Where speculation does not pay it stays off: in batches of more than `MAX_BATCH` decodes (the
forward is no longer memory-bound, so extra positions cost compute), and for a request whose
drafts have mostly been rejected. Constrained requests (their grammar forces tokens through
jump-forward instead), penalized ones (penalties count the tokens before each position) and
requests that opt out (`SamplingParams.speculative=False`) do not speculate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from engine.request import Request
from engine.scheduler import Batch, ScheduledSeq

MAX_BATCH = 16  # decodes in a step beyond which no step speculates
MIN_ACCEPTANCE = 0.2  # a request whose drafts are accepted less often stops drafting ...
PROBATION = 16  # ... once this many of its draft tokens have been verified


class Drafter(Protocol):
    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens likely to follow `tokens` (the prompt and output so far)."""
        ...


class PromptLookup:
    """N-gram drafts: the longest suffix of the sequence (`max_ngram` tokens down to
    `min_ngram`) that also occurs earlier in it proposes the tokens that followed its latest
    earlier occurrence. Agents copy names, paths and values from their context; this finds
    them with no model."""

    def __init__(self, min_ngram: int = 2, max_ngram: int = 4, window: int = 4096):
        self.min_ngram, self.max_ngram, self.window = min_ngram, max_ngram, window

    def propose(self, tokens: list[int], k: int) -> list[int]:
        seq = tokens[-self.window :]
        last, end = seq[-1], len(seq) - 1
        best, best_len = -1, 0
        for i in range(end - 1, -1, -1):  # earlier ends of a match, latest first
            if seq[i] != last:
                continue
            n = 1
            while n < self.max_ngram and n <= i and seq[i - n] == seq[end - n]:
                n += 1
            if n > best_len:
                best, best_len = i, n
                if n == self.max_ngram:
                    break
        if best_len < self.min_ngram:
            return []
        return seq[best + 1 : best + 1 + k]


@dataclass
class SpecStats:
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of them, accepted
    forwards: int = 0  # sequence-steps that carried drafts
    emitted: int = 0  # tokens those sequence-steps produced (accepted + the one drawn)


class Speculator:
    """Attaches drafts to a batch's decodes and accounts for what was accepted."""

    def __init__(self, num_tokens: int, drafter: Drafter | None = None):
        self.k = num_tokens
        self.drafter = drafter or PromptLookup()
        self.stats = SpecStats()
        self._record: dict[str, tuple[int, int]] = {}  # request id -> (drafted, accepted)

    def wants(self, num_decodes: int) -> bool:
        """Would a step of this many decodes speculate? (The overlapped loop then hands back
        to the regular schedule, which attaches drafts.)"""
        return num_decodes <= MAX_BATCH

    def attach(
        self,
        batch: Batch,
        tokens_left: Callable[[Request], int],
        add_draft: Callable[[ScheduledSeq, list[int]], bool],
        budget: int,
    ) -> bool:
        """Give the batch's eligible decodes their drafts within `budget` extra tokens;
        whether any got one. `tokens_left`: how many tokens a request may still produce."""
        decodes = [s for s in batch.seqs if s.num_new_tokens == 1 and s.samples]
        if not decodes or len(decodes) > MAX_BATCH:
            return False
        budget -= batch.num_tokens
        any_draft = False
        for seq in decodes:
            req = seq.request
            k = min(self.k, tokens_left(req) - 1, budget)
            if k <= 0 or not self._eligible(req):
                continue
            draft = self.drafter.propose(req.token_ids, k)
            if draft and add_draft(seq, draft):
                budget -= len(draft)
                any_draft = True
        return any_draft

    def accepted(self, seq: ScheduledSeq, drawn: list[int]) -> int:
        """How many of `seq`'s drafts the tokens `drawn` at its positions accept (the leading
        drafts equal to their position's token; `drawn` may stop short); recorded."""
        n = 0
        while n < min(len(seq.draft), len(drawn)) and seq.draft[n] == drawn[n]:
            n += 1
        rid = seq.request.request_id
        drafted, accepted = self._record.get(rid, (0, 0))
        self._record[rid] = drafted + len(seq.draft), accepted + n
        s = self.stats
        s.drafted += len(seq.draft)
        s.accepted += n
        s.forwards += 1
        s.emitted += n + 1
        return n

    def release(self, request_id: str) -> None:
        self._record.pop(request_id, None)

    def _eligible(self, req: Request) -> bool:
        p = req.params
        if not p.speculative or req.matcher is not None or p.needs_penalties:
            return False
        if req.reasoning is not None:  # its budget counts tokens one by one
            return False
        drafted, accepted = self._record.get(req.request_id, (0, 0))
        return drafted < PROBATION or accepted >= MIN_ACCEPTANCE * drafted
