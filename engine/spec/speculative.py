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

A constrained request's draft starts with the tokens its grammar forces (a JSON key, `": "`, a
tool name: what jump-forward would append), accepted without verification, and goes on with
looked-up tokens, cut where the grammar refuses one. Each position's draw is masked by the
grammar in the state the draft tokens before it lead to (`GrammarStage.start_fill`), so the
target distribution is the constrained one at every position.

On a GPU, a batch of decodes free of grammars runs the overlapped speculative loop instead
(engine/spec/loop.py): the same drafts, verification and acceptance, on the device, each step
queued before the host has read the one before (`DeviceDrafter`, `Speculator.loops`).

Where speculation does not pay it stays off: in batches of more than `max_batch` decodes (the
forward is no longer memory-bound, so extra positions cost compute: `MAX_BATCH` on a GPU, and
`CPU_MAX_BATCH` on a CPU, whose forward is compute-bound from a few rows on), and for a request
whose looked-up drafts have mostly been rejected. Penalized requests (penalties count the tokens
before each position), reasoning ones (their budget counts tokens one by one) and requests that
opt out (`SamplingParams.speculative=False`) do not speculate.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.core.request import Request
from engine.core.scheduler import Batch, ScheduledSeq
from kernels.spec_decode import prompt_lookup

MAX_BATCH = 16  # decodes in a step beyond which no step speculates (GPUs)
# On a CPU, 4 decodes with 4 drafts each ran at 0.92x of plain decoding (5 rows cost what 1
# does, 20 rows 2-3x): only a lone decode speculates (benchmarks/results/speculative_cpu.md).
CPU_MAX_BATCH = 1
MIN_ACCEPTANCE = 0.2  # a request whose drafts are accepted less often stops drafting ...
PROBATION = 16  # ... once this many of its draft tokens have been verified


class Drafter(Protocol):
    def propose(self, tokens: list[int], k: int, namespace: Hashable = None) -> list[int]:
        """Up to `k` tokens likely to follow `tokens` (the prompt and output so far) of a
        request in `namespace` (`Request.namespace`: whose text it may draft from)."""
        ...


class DeviceDrafter(Drafter, Protocol):
    """A drafter the overlapped speculative loop can run (engine/spec/loop.py): it proposes on
    the device, from tokens the host has not seen yet."""

    def propose_on_device(self, tokens: torch.Tensor, lengths: torch.Tensor, k: int,
                          hints: list[list[int]] | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """Exactly `k` drafts per row of `tokens` (S, W) int64, whose first `lengths` (S,)
        entries are each sequence (the rest is unread): (S, k) int64, and (S,) how many of
        them lead that `propose` would give (the rest fill a step's fixed shape). `hints`:
        the host's drafts from tokens it has seen, for a drafter that makes them (`hints`)."""
        ...


class DraftGrammar(Protocol):
    """The grammar stage's side of drafting (engine/sampling/structured.py)."""

    def forced_tokens(self, req: Request, limit: int, with_last: bool = False) -> list[int]:
        """Tokens the request's grammar forces next (fewer than `limit`); the final one, which
        could merge with what follows, only `with_last`."""
        ...

    def valid_prefix(self, req: Request, tokens: list[int]) -> int:
        """How many leading `tokens` the request's grammar allows."""
        ...


class PromptLookup:
    """N-gram drafts: the longest suffix of the sequence (`max_ngram` tokens down to
    `min_ngram`) that also occurs earlier in it proposes the tokens that followed its latest
    earlier occurrence. Agents copy names, paths and values from their context; this finds
    them with no model."""

    def __init__(self, min_ngram: int = 2, max_ngram: int = 4, window: int = 4096):
        self.min_ngram, self.max_ngram, self.window = min_ngram, max_ngram, window

    def propose(self, tokens: list[int], k: int, namespace: Hashable = None) -> list[int]:
        best, best_len = -1, 0
        for i, n in earlier_matches(tokens, self.window, self.max_ngram):
            if n >= best_len:  # longer wins; among equals, the later
                best, best_len = i, n
        if best_len < self.min_ngram:
            return []
        return tokens[best + 1 : best + 1 + k]

    def propose_on_device(self, tokens: torch.Tensor, lengths: torch.Tensor, k: int,
                          hints: list[list[int]] | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """`propose` for every row at once, in one kernel (`kernels.spec_decode`). A verify
        step computes k positions whatever they hold, so a row always gets k drafts: where
        `propose` would give fewer (no match of `min_ngram`, or the match's continuation
        reaches the end) the best shorter match fills in, then the last token repeated.
        It makes no `hints`."""
        return prompt_lookup(tokens, lengths, k, self.min_ngram, self.max_ngram, self.window)


def earlier_matches(tokens: list[int], window: int, max_len: int) -> Iterator[tuple[int, int]]:
    """Each earlier end `i` of a match of the sequence's last tokens within its last `window`
    tokens, in order, with the match's length `n` (at most `max_len`): `tokens[i - n + 1 :
    i + 1]` equals the last `n` tokens."""
    end = len(tokens) - 1
    last, lo = tokens[end], max(end - window + 1, 0)
    i = lo - 1
    while True:  # `list.index` scans in C
        try:
            i = tokens.index(last, i + 1, end)
        except ValueError:
            return
        n = 1
        while n < max_len and n <= i - lo and tokens[i - n] == tokens[end - n]:
            n += 1
        yield i, n


@dataclass
class SpecStats:
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of them, accepted
    forced: int = 0  # draft tokens a grammar forced (accepted without verification)
    forwards: int = 0  # sequence-steps that carried drafts
    emitted: int = 0  # tokens those sequence-steps produced (accepted + the one drawn)


class Speculator:
    """Attaches drafts to a batch's decodes and accounts for what was accepted."""

    def __init__(self, num_tokens: int, drafter: Drafter | None = None,
                 max_batch: int = MAX_BATCH, min_acceptance: float = MIN_ACCEPTANCE):
        """`min_acceptance`: a request whose looked-up drafts are accepted less often stops
        looking up once `PROBATION` of them were verified (0: never stops)."""
        self.k, self.max_batch, self.min_acceptance = num_tokens, max_batch, min_acceptance
        self.drafter = drafter or PromptLookup()
        self.stats = SpecStats()
        self._record: dict[str, tuple[int, int]] = {}  # request id -> (drafted, accepted)

    def wants(self, num_decodes: int) -> bool:
        """Would a step of this many decodes speculate? (The overlapped loop then hands back
        to the regular schedule, which attaches drafts, if one of them `may_draft`.)"""
        return num_decodes <= self.max_batch

    def attach(
        self,
        batch: Batch,
        tokens_left: Callable[[Request], int],
        add_draft: Callable[[ScheduledSeq, list[int], int], bool],
        budget: int,
        grammar: DraftGrammar | None = None,
    ) -> bool:
        """Give the batch's eligible decodes their drafts within `budget` extra tokens;
        whether any got one. `tokens_left`: how many tokens a request may still produce."""
        decodes = [s for s in batch.seqs if s.num_new_tokens == 1 and s.samples]
        if not decodes or not self.wants(len(decodes)):
            return False
        budget -= batch.num_tokens
        any_draft = False
        for seq in decodes:
            req = seq.request
            left = min(tokens_left(req), budget + 1)
            if left <= 1 or not self.drafts(req):
                continue
            forced: list[int] = []  # as jump-forward would append them, then the final one
            if grammar is not None and req.matcher is not None and req.params.logprobs is None:
                forced = grammar.forced_tokens(req, left, with_last=True)
            # The final forced token could merge with what follows: it is a draft the model
            # verifies (proposed by the grammar, not looked up).
            num_forced = max(len(forced) - 1, 0)
            k = min(self.k, left - 1 - len(forced)) if self._looks_up(req) else 0
            context = req.token_ids + forced if forced else req.token_ids  # no copy if none
            looked = self.drafter.propose(context, k, req.namespace) if k > 0 else []
            if grammar is not None and looked:
                allowed = grammar.valid_prefix(req, forced + looked)
                looked = looked[: max(allowed - len(forced), 0)]
            draft = forced + looked
            if draft and add_draft(seq, draft, num_forced):
                budget -= len(draft)
                any_draft = True
        return any_draft

    def accepted(self, seq: ScheduledSeq, drawn: list[int], looked: int | None = None) -> int:
        """How many of `seq`'s drafts are accepted given the tokens `drawn` at its positions
        (`drawn` may stop short): the forced ones, then the others equal to their position's
        token; recorded. `looked`: how many drafts after the forced ones were looked up (by
        default all; a device drafter's fillers after them are accepted alike, not recorded)."""
        n = min(seq.num_forced, len(drawn))
        while n < min(len(seq.draft), len(drawn)) and seq.draft[n] == drawn[n]:
            n += 1
        if looked is None:
            looked = len(seq.draft) - seq.num_forced
        hits = min(max(n - seq.num_forced, 0), looked)
        rid = seq.request.request_id
        drafted, accepted = self._record.get(rid, (0, 0))
        self._record[rid] = drafted + looked, accepted + hits
        s = self.stats
        s.drafted += looked
        s.accepted += hits
        s.forced += min(seq.num_forced, n)
        s.forwards += 1
        s.emitted += n + 1
        return n

    def release(self, req: Request, completed: bool = False) -> None:
        """`req` ended; a `completed` one (not aborted nor failed) teaches a drafter that
        learns (`SuffixDrafter`) what it wrote."""
        self._record.pop(req.request_id, None)
        learn = getattr(self.drafter, "learn", None)
        if completed and learn is not None and req.num_output_tokens:
            learn(req.namespace, req.prompt_token_ids, req.output_token_ids)

    def drafts(self, req: Request) -> bool:
        """Whether the request's decodes get drafts: its grammar's forced tokens always (the
        engine then leaves them to the draft instead of jump-forward, so they share a forward
        with looked-up ones), looked-up ones while they pay (`_looks_up`)."""
        p = req.params
        if not p.speculative or p.needs_penalties:
            return False
        return req.reasoning is None  # a reasoning budget counts tokens one by one

    def may_draft(self, req: Request) -> bool:
        """Whether `req`'s next decode could get a draft: it drafts, and has a grammar to
        force tokens or still looks drafts up. Without one such request in a batch, the
        overlapped loop goes on (its steps would not speculate)."""
        forced = req.matcher is not None and req.params.logprobs is None
        return self.drafts(req) and (forced or self._looks_up(req))

    def loops(self, req: Request) -> bool:
        """Whether `req` may decode in the overlapped speculative loop (engine/spec/loop.py),
        whose drafts and accepted tokens stay on the device until the step after: it drafts,
        and nothing of its sampling depends on its tokens being on the host (a grammar's masks
        and forced tokens; `min_tokens` bans, which count its outputs)."""
        p = req.params
        return (self.drafts(req) and p.constraint is None
                and req.num_output_tokens >= p.min_tokens)

    def _looks_up(self, req: Request) -> bool:
        drafted, accepted = self._record.get(req.request_id, (0, 0))
        return drafted < PROBATION or accepted >= self.min_acceptance * drafted
