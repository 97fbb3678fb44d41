"""A compiled grammar's first steps, checked in the compile worker before the engine uses it.

A backend can compile a constraint that no output satisfies (a `$ref` cycle, an empty character
class, rules that only refer to each other), and one past its own resource limits: llguidance
enforces those when it consumes a token, not when it computes the mask, so a token its mask
allowed can then fail. Both used to surface mid-generation as "the grammar refused sampled
token". `probe` walks the first tokens of one output through the mask and the matcher and
refuses such a grammar at compile time, where the next backend can still be tried.
"""

from __future__ import annotations

import numpy as np
import torch

from grammar.backend import BackendError, Matcher, Unsatisfiable
from grammar.vocab import TokenVocab

PROBE_STEPS = 8  # tokens walked; limits were hit on the first in every case seen


def allowed_tokens(row: torch.Tensor, vocab_size: int) -> np.ndarray:
    """Token ids whose bit is set in one bitmask row [ceil(vocab_size / 32)]."""
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


def probe(matcher: Matcher, vocab: TokenVocab, steps: int = PROBE_STEPS) -> None:
    """Walk up to `steps` tokens from the start state, each the lowest id the mask allows
    (the stop token only when nothing else is), checking that the matcher accepts it.

    Raises Unsatisfiable when the start state allows nothing, and BackendError when a later
    state allows nothing or the matcher refuses (or fails on) a token its mask allowed.
    """
    bitmask = torch.zeros((1, -(-vocab.vocab_size // 32)), dtype=torch.int32)
    stops = set(vocab.stop_token_ids)
    for step in range(steps):
        matcher.fill_bitmask(bitmask, 0)
        allowed = allowed_tokens(bitmask[0], vocab.vocab_size)
        if not len(allowed):
            if step == 0:
                raise Unsatisfiable("its start state allows no token")
            raise BackendError(f"the grammar allows no token after {step} tokens")
        token = next((int(t) for t in allowed if int(t) not in stops), int(allowed[0]))
        if not matcher.accept(token):
            raise BackendError(f"the matcher refused token {token}, which its mask allowed")
        if matcher.is_terminated():
            return
