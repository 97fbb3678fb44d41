"""Suffix decoding: drafts from what a tenant's agents wrote before, as well as from the
sequence itself (after Arctic Inference's SuffixDecoding). Pure Python.

Agents repeat themselves across requests: the same tool-call skeletons, paths, JSON keys and
code, turn after turn and session after session. Prompt lookup (`PromptLookup`) only finds a
draft inside the sequence; `SuffixDrafter` also looks in a corpus of earlier outputs.

- **The corpus** is per namespace (`Request.namespace`: the tenant and the adapter's
  weights, as the prefix cache keys KV), so no tenant's text ever drafts for another. It
  holds each finished request's output with the last `CONTEXT` tokens of its prompt before
  it (so the start of an answer matches the chat template's header), and an index from every
  `ANCHOR`-token n-gram to where it ends. It is bounded by `max_tokens` over all namespaces;
  past it, the least recently used entries (written or drafted from) go first.
- **Candidates** for a sequence: the earlier occurrences of its last tokens, in the sequence
  itself (2 tokens or more, in its last `window` tokens) and in its namespace's corpus (its
  last `ANCHOR` tokens, the most recent `MAX_CANDIDATES` occurrences). Each match is extended
  backwards, up to `MAX_MATCH` tokens.
- **The draft** follows the candidates whose match is longest (every one matching at least
  `LONG_MATCH` tokens counts as longest): token by token, the one most of them continue with,
  while the product of those shares (the draft's estimated chance) stays above `MIN_PROB`,
  the candidates disagreeing dropping out as it goes. Its length adapts to the match: at
  most twice the match length, and the engine's ceiling (`--num-speculative-tokens`).

In the overlapped loop on CUDA (engine/spec/loop.py) the device runs a step ahead of the host,
so the drafts are made in two halves. When it queues a step, the host drafts from the corpus
with the tokens it has (`hints`: its last tokens, then a draft as long as the device may have
run ahead plus k), and the device finds where its own last tokens are in that hint and drafts
what follows (`propose_on_device`); a row whose tokens left the hint, or that has none, drafts
from the sequence alone, by prompt lookup on the device. A hint the device keeps following is
not drafted again, and the host never scans the sequence: in the loop the host's time per step
is what a small model's step costs.

Drafts are verified as any (engine/spec/speculative.py), so outputs are exactly those of
plain decoding. Linear drafts, not trees: a verify step costs the same for a chain of k
tokens as for a tree of k nodes, and where candidates disagree the draft stops at the
disagreement, so a tree would mostly add branches that are rarely right; on the CPU, where
every extra row costs, and in the GPU loop's fixed-shape steps, a chain keeps each step's
rows the ones most likely accepted.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence

import numpy as np
import torch

from engine.core.request import Request
from engine.spec.speculative import PromptLookup, earlier_matches
from kernels.spec_decode import leading_true, prompt_lookup
from kernels.upload import upload_arrays

ANCHOR = 3  # tokens of the corpus index's n-grams: the shortest match looked up there
CONTEXT = 16  # prompt tokens kept before each output
MAX_MATCH = 32  # a match is extended backwards this far at most
LONG_MATCH = 8  # every candidate matching at least this many tokens votes
MAX_CANDIDATES = 64  # most recent corpus occurrences of an n-gram looked at
MIN_PROB = 0.3  # a draft stops where its estimated chance falls below this
DEFAULT_TOKENS = 1 << 18  # corpus tokens kept over all namespaces

Candidate = tuple[Sequence[int], int, int]  # (source, index of the next token, match length)


class _Corpus:
    """One namespace's outputs and their n-gram index. A removed entry's index hits are
    dropped lazily (skipped when met), and the index is rebuilt once they outnumber the
    live ones, so removing costs O(1) and the index stays within twice the tokens kept."""

    def __init__(self) -> None:
        self.entries: dict[int, list[int]] = {}
        self.index: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # n-gram -> (entry, end)
        self.live = self.stale = 0  # index hits of kept and of removed entries

    def add(self, key: int, tokens: list[int]) -> None:
        self.entries[key] = tokens
        self._index(key, tokens)

    def _index(self, key: int, tokens: list[int]) -> None:
        for end in range(ANCHOR - 1, len(tokens)):
            gram = tuple(tokens[end - ANCHOR + 1 : end + 1])
            self.index.setdefault(gram, []).append((key, end))
        self.live += max(len(tokens) - ANCHOR + 1, 0)

    def remove(self, key: int) -> None:
        n = max(len(self.entries.pop(key)) - ANCHOR + 1, 0)
        self.live -= n
        self.stale += n
        if self.stale > self.live:
            self.index, self.live, self.stale = {}, 0, 0
            for k, tokens in self.entries.items():
                self._index(k, tokens)

    def candidates(self, tokens: list[int]) -> list[tuple[int, Candidate]]:
        """(entry, candidate) for the latest occurrences of `tokens`' last ANCHOR tokens."""
        hits = self.index.get(tuple(tokens[-ANCHOR:]))
        if not hits:
            return []
        out: list[tuple[int, Candidate]] = []
        for key, end in reversed(hits):
            source = self.entries.get(key)
            if source is None:  # removed
                continue
            out.append((key, (source, end + 1, _match(tokens, source, end, ANCHOR))))
            if len(out) == MAX_CANDIDATES:
                break
        return out


class SuffixDrafter:
    """Drafts from the sequence and its namespace's earlier outputs (see the module's text).
    `max_tokens`: the corpus's bound over all namespaces (`--suffix-cache-tokens`)."""

    def __init__(self, max_tokens: int = DEFAULT_TOKENS, window: int = 4096) -> None:
        self.max_tokens = max_tokens
        self.lookup = PromptLookup(window=window)  # the loop's drafter on the device
        self._corpora: dict[Hashable, _Corpus] = {}
        self._lru: OrderedDict[int, Hashable] = OrderedDict()  # entry -> namespace
        self._next = 0
        self.num_tokens = 0
        # the loop's requests: (their token count when hinted, the hint's draft)
        self._hinted: dict[str, tuple[int, list[int]]] = {}

    # -- learning ---------------------------------------------------------------------------

    def learn(self, namespace: Hashable, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Keep a finished request's output, after the end of its prompt."""
        if not output or self.max_tokens <= 0:
            return
        tokens = list(prompt[-CONTEXT:]) + list(output)
        tokens = tokens[-self.max_tokens:]
        key, self._next = self._next, self._next + 1
        self._corpora.setdefault(namespace, _Corpus()).add(key, tokens)
        self._lru[key] = namespace
        self.num_tokens += len(tokens)
        while self.num_tokens > self.max_tokens:
            self._evict()

    def _evict(self) -> None:
        key, namespace = self._lru.popitem(last=False)
        corpus = self._corpora[namespace]
        self.num_tokens -= len(corpus.entries[key])
        corpus.remove(key)
        if not corpus.entries:
            del self._corpora[namespace]

    # -- drafting ---------------------------------------------------------------------------

    def propose(self, tokens: list[int], k: int, namespace: Hashable = None) -> list[int]:
        if k <= 0 or len(tokens) < 2:
            return []
        return _draft(self._in_sequence(tokens) + self._in_corpus(tokens, namespace), k)

    def _in_corpus(self, tokens: list[int], namespace: Hashable) -> list[Candidate]:
        """Earlier outputs' occurrences of the sequence's last ANCHOR tokens (the entries
        count as used)."""
        corpus = self._corpora.get(namespace)
        if corpus is None or len(tokens) < ANCHOR:
            return []
        found = []
        for key, cand in corpus.candidates(tokens):
            found.append(cand)
            self._lru.move_to_end(key)
        return found

    def _in_sequence(self, tokens: list[int]) -> list[Candidate]:
        """Earlier occurrences of the sequence's last two tokens or more (prompt lookup's)."""
        return [(tokens, i + 1, n)
                for i, n in earlier_matches(tokens, self.lookup.window, MAX_MATCH) if n >= 2]

    def hints(self, reqs: Sequence[Request], k: int) -> list[list[int]]:
        """For each of the loop's requests, its last `max_ngram` tokens, then what its
        namespace's earlier outputs draft after them (the device looks in the sequence
        itself), up to 2k + 1 tokens (the device may be 1 + k tokens ahead and drafts k); []
        where they draft nothing. A hint whose draft the request has followed since, with 2
        tokens of it left, is kept rather than drafted again."""
        tail, out, hinted = self.lookup.max_ngram, [], {}
        for req in reqs:
            tokens, n = req.token_ids, req.num_tokens
            at, draft = self._hinted.get(req.request_id, (n, []))
            done = n - at
            if len(draft) - done < 2 or draft[:done] != tokens[at:]:
                at, draft = n, _draft(self._in_corpus(tokens, req.namespace), 2 * k + 1)
            hinted[req.request_id] = (at, draft)
            out.append(tokens[-tail:] + draft[n - at :] if draft else [])
        self._hinted = hinted  # requests that left the loop are forgotten
        return out

    def warm_up(self, device: torch.device, k: int) -> None:
        """Compile the hints' lookup for `k` drafts (kernels/spec_decode.py `warm_up` compiles
        the loop's other kernels) on a CUDA device."""
        if device.type != "cuda":
            return
        tokens = torch.arange(256, device=device).repeat(2, 1)
        lengths = torch.full((2,), 8, device=device)
        self.propose_on_device(tokens, lengths, k, [list(range(6)), []])
        torch.cuda.synchronize(device)

    def propose_on_device(self, tokens: torch.Tensor, lengths: torch.Tensor, k: int,
                          hints: list[list[int]] | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """The overlapped loop's drafts (`DeviceDrafter`): where a row's last tokens are found
        in its hint (`hints`), what follows them there; elsewhere the sequence's own, by prompt
        lookup on the device."""
        drafts, looked = self.lookup.propose_on_device(tokens, lengths, k)
        if not hints or not any(hints):
            return drafts, looked
        return _follow(tokens, lengths, hints, drafts, looked, self.lookup.max_ngram)


def _follow(tokens: torch.Tensor, lengths: torch.Tensor, hints: list[list[int]],
            drafts: torch.Tensor, looked: torch.Tensor, tail: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's hint, then -2, then the row's last `tail` tokens (as of the device),
    searched by prompt lookup: a match in the hint drafts what follows it there, the drafts
    past the hint's end taken from `drafts`; a row with no match of 2 tokens keeps `drafts`
    and `looked`. The rows are as wide as the longest hint could be, so the lookup compiles
    once (`SuffixDrafter.warm_up`)."""
    rows, k = drafts.shape
    width = tail + 2 * k + 1  # `hints`' longest
    hay = np.full((rows, width + 1), -1, np.int64)  # hints to the right, -1 before them
    for i, hint in enumerate(hints):
        hay[i, width - len(hint) : width] = hint
    hay[:, width] = -2  # the hint's end; no token equals -1 or -2
    side = upload_arrays({"hay": hay}, tokens.device)["hay"]
    back = (lengths - 1).unsqueeze(1) - torch.arange(tail - 1, -1, -1, device=tokens.device)
    hay_t = torch.cat([side, tokens.gather(1, back.clamp(min=0))], dim=1)
    whole = hay_t.new_full((rows,), hay_t.shape[1])  # every row's length: all of it
    found, n = prompt_lookup(hay_t, whole, k, 2, tail, hay_t.shape[1])
    before_end = leading_true(found >= 0)  # drafts before the hint's end (the -2)
    n = torch.minimum(n, before_end)
    inside = torch.arange(k, device=found.device) < before_end.unsqueeze(1)
    use = n > 0
    return (torch.where(use.unsqueeze(1) & inside, found, drafts), torch.where(use, n, looked))


def _draft(found: list[Candidate], k: int) -> list[int]:
    """The draft of the candidates that match longest (see the module's text)."""
    if not found:
        return []
    best = max(n for _, _, n in found)
    voters = [(src, at) for src, at, n in found if n >= min(best, LONG_MATCH)]
    return _vote(voters, min(k, 2 * best))


def _match(tokens: Sequence[int], source: Sequence[int], end: int, n: int) -> int:
    """How many tokens up to `source[end]` equal `tokens`' last ones, knowing the last `n`
    do (at most MAX_MATCH)."""
    top = len(tokens) - 1
    while n < MAX_MATCH and end - n >= 0 and source[end - n] == tokens[top - n]:
        n += 1
    return n


def _vote(voters: list[tuple[Sequence[int], int]], limit: int) -> list[int]:
    """Follow the voters' continuations while most of them agree (see the module's text)."""
    draft: list[int] = []
    prob = 1.0
    while len(draft) < limit:
        counts = Counter(src[at] for src, at in voters if at < len(src))
        if not counts:
            break
        token, agree = counts.most_common(1)[0]
        prob *= agree / sum(counts.values())
        if prob < MIN_PROB:
            break
        draft.append(token)
        voters = [(src, at + 1) for src, at in voters if at < len(src) and src[at] == token]
    return draft
