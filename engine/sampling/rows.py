"""A step's sampling parameters on the host, ready for one copy to the device.

`StepRows` turns the step's requests into a few small arrays in row order (temperature, top-k,
top-p, min-p, noise key) and the sparse (row, token, value) entries of logit bias, penalties
and min_tokens bans; `kernels.upload.upload_arrays` sends them all in one host->device copy.
Nothing here is proportional to the vocabulary. `RowState` is what the sampler keeps about a
request between its steps: its noise seed and its parameters as arrays, made once, and the
counts of its output tokens, grown as they arrive.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import numpy as np

from engine.core.request import Request
from engine.sampling.counter_rng import M32, hash32, mix

PLAIN, TOP_K, SORT, GREEDY = "plain", "top_k", "sort", "greedy"  # how a step draws


class RowState:
    """What the sampler keeps about one request until it is released: its noise seed, its
    parameters as the step reads them (made once), its output token counts (grown)."""

    def __init__(self, req: Request, rng: random.Random, vocab: int, eos: Sequence[int]):
        self.req = req
        p = req.params
        seed = rng.getrandbits(64) if p.seed is None else p.seed  # unseeded: drawn once
        self.seed_key = mix(seed & M32, (seed >> 32) & M32)  # int64 seeds: both halves count
        self.greedy = p.greedy
        top_k = min(p.top_k, vocab) if p.top_k > 0 else vocab  # vocab: off
        # (temperature, top_k, top_p, min_p); greedy rows draw nothing: neutral values
        self.draw = (1.0, vocab, 1.0, 0.0) if p.greedy else (p.temperature, top_k, p.top_p,
                                                             p.min_p)
        self.logprobs = p.logprobs
        bias = {t: b for t, b in p.logit_bias.items() if 0 <= t < vocab}
        self.bias_ids = np.fromiter(bias, np.int64, len(bias))
        self.bias_values = np.fromiter(bias.values(), np.float32, len(bias))
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
        self.ban_ids = np.array(sorted(t for t in banned if 0 <= t < vocab), np.int64)
        self.penalized = p.needs_penalties
        self.sparse = bool(len(bias) or self.penalized or (p.min_tokens and len(self.ban_ids)))
        self.prompt_ids: np.ndarray | None = None  # distinct prompt tokens, when penalized
        # Distinct output tokens and their counts: slots [0, len(out_slot)) of the arrays.
        self.out_slot: dict[int, int] = {}
        self.out_ids = np.zeros(16, np.int64)
        self.out_counts = np.zeros(16, np.float32)
        self.num_counted = 0

    def count_outputs(self) -> int:
        """Count the output tokens that arrived since the last call; the number of distinct
        output tokens so far."""
        req = self.req
        for t in req.token_ids[req.num_prompt_tokens + self.num_counted :]:
            slot = self.out_slot.get(t)
            if slot is None:
                slot = self.out_slot[t] = len(self.out_slot)
                if slot == len(self.out_ids):
                    self.out_ids = np.resize(self.out_ids, 2 * slot)
                    self.out_counts = np.resize(self.out_counts, 2 * slot)
                self.out_ids[slot], self.out_counts[slot] = t, 0.0
            self.out_counts[slot] += 1.0
            self.num_counted += 1
        return len(self.out_slot)


class StepRows:
    """One step's sampling parameters, in row order, on the host: `arrays` by name.

    Per row (when some row samples): floats (3, N) temperature, top_p, min_p; ints (2, N)
    top_k (V: off) and the noise key of the row's draw (from its seed and the index in the
    output of the token drawn now); greedy (N,). Sparse entries address the flattened logits
    (row * V + token): bias_at / bias_values, repetition_at / repetition_values (the penalty;
    prompt and output tokens, repeats allowed), penalty_at / penalty_values (-(frequency x
    count + presence), output tokens), ban_at (min_tokens not reached yet).
    """

    def __init__(
        self,
        reqs: list[Request],
        vocab: int,
        state: Callable[[Request, int], RowState],
        offsets: Sequence[int] | None = None,
        keys_on_device: bool = False,
    ):
        """`offsets`: per row, how many tokens past the request's last known one its draw is
        (a speculative step draws several positions of one request; None: all 0).
        `keys_on_device`: the rows' positions are known on the device only; `seed_keys` (N,)
        goes up, and the sampler makes the noise keys there (`Sampler.launch`)."""
        self.keys_on_device = keys_on_device
        self.offsets = np.zeros(len(reqs), np.int64) if offsets is None else np.asarray(
            offsets, np.int64)
        states = [state(r, vocab) for r in reqs]
        greedy = [st.greedy for st in states]
        self.any_greedy = any(greedy)
        self.logprob_rows = [i for i, st in enumerate(states) if st.logprobs is not None]
        self.logprob_k = max((states[i].logprobs or 0 for i in self.logprob_rows), default=0)
        self.arrays: dict[str, np.ndarray] = {}
        if self.logprob_rows:
            self.arrays["logprob_rows"] = np.array(self.logprob_rows, np.int64)
        self.path, self.k = GREEDY, vocab
        if not all(greedy):
            self._draws(reqs, states, np.array(greedy), vocab)
        sparse = [i for i, st in enumerate(states) if st.sparse]
        if sparse:
            self._sparse(states, sparse, vocab)

    def _draws(self, reqs: list[Request], states: list[RowState], greedy: np.ndarray,
               vocab: int) -> None:
        temperature, top_k, top_p, min_p = np.array([st.draw for st in states]).T
        sampled = ~greedy
        k = top_k[sampled]
        if (k < vocab).all():
            self.path, self.k = TOP_K, int(k.max())
        elif (k < vocab).any() or (top_p[sampled] < 1.0).any():
            self.path = SORT
        else:
            self.path = PLAIN
        self.any_top_p = bool((top_p[sampled] < 1.0).any())
        self.any_min_p = bool((min_p[sampled] > 0.0).any())
        seeds = np.array([st.seed_key for st in states], np.int64)
        if self.keys_on_device:  # the sampler makes the keys there
            self.arrays["seed_keys"] = seeds
            keys = np.zeros_like(seeds)
        else:
            positions = np.array([len(r.token_ids) - len(r.prompt_token_ids) for r in reqs])
            keys = hash32(seeds ^ hash32(positions + self.offsets))
        self.arrays["floats"] = np.stack([temperature, top_p, min_p]).astype(np.float32)
        self.arrays["ints"] = np.stack([top_k.astype(np.int64), keys])
        if self.any_greedy:
            self.arrays["greedy"] = greedy

    def _sparse(self, states: list[RowState], rows: list[int], vocab: int) -> None:
        """Each kind's entries: token ids per row joined once, rows repeated to match."""
        entries: dict[str, tuple[list, list, list]] = {}  # kind -> rows, ids, lengths

        def add(kind: str, row: int, ids: np.ndarray) -> None:
            r, i, n = entries.setdefault(kind, ([], [], []))
            r.append(row)
            i.append(ids)
            n.append(len(ids))

        bias_values, rep_values, freq, pres, counts = [], [], [], [], []
        for row in rows:
            st = states[row]
            p = st.req.params
            if len(st.bias_ids):
                add("bias", row, st.bias_ids)
                bias_values.append(st.bias_values)
            if st.req.num_output_tokens + self.offsets[row] < p.min_tokens and len(st.ban_ids):
                add("ban", row, st.ban_ids)
            if not st.penalized:
                continue
            n = st.count_outputs()
            if p.repetition_penalty != 1.0:
                if st.prompt_ids is None:
                    st.prompt_ids = np.unique(np.asarray(st.req.prompt_token_ids, np.int64))
                add("repetition", row, st.prompt_ids)  # repeats write the same value
                add("repetition", row, st.out_ids[:n])
                rep_values += [p.repetition_penalty] * 2
            if n and (p.frequency_penalty or p.presence_penalty):
                add("penalty", row, st.out_ids[:n])
                counts.append(st.out_counts[:n])
                freq.append(p.frequency_penalty)
                pres.append(p.presence_penalty)
        for kind, (r, ids, lens) in entries.items():
            self.arrays[f"{kind}_at"] = np.repeat(np.array(r) * vocab, lens) + np.concatenate(ids)

        def per_entry(kind: str, values: list[float]) -> np.ndarray:  # a row's, repeated
            return np.repeat(np.array(values, np.float32), entries[kind][2])

        if bias_values:
            self.arrays["bias_values"] = np.concatenate(bias_values)
        if rep_values:
            self.arrays["repetition_values"] = per_entry("repetition", rep_values)
        if counts:
            self.arrays["penalty_values"] = -(
                per_entry("penalty", freq) * np.concatenate(counts) + per_entry("penalty", pres)
            )
