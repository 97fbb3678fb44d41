"""The draw: an exponential race over counter-based noise, in two rounds.

argmax_t p_t / E_t, with E_t ~ Exp(1) independent, picks token t with probability p_t / sum(p).
Noise for every token of a 128k vocabulary costs some twenty integer passes over
(rows x vocabulary); two rounds cost almost nothing. First a block of consecutive token ids
(about sqrt(V) of them) wins a race run with the blocks' masses, then a token of that block wins
a race run with its probabilities: the block wins with probability its mass, the token then with
its share of it, the same law as one race over all tokens.

E = -log u, with u uniform in (0, 1) from hash32(hash32(i) ^ key) (`engine.sampling.counter_rng`):
the
key is the row's (seed, position); i is the block in the block round and blocks + the token's
offset in its block in the token round (the token round needs noise independent of the block
round's, not of the block). Only integers go into u and its float is exact, so a key gives the
same noise on every device and in any batch; the block size depends on the vocabulary alone.
"""

from __future__ import annotations

import torch

from engine.sampling.counter_rng import hash32, open_uniform


def block_size(vocab: int) -> int:
    """The power of two nearest above sqrt(vocab): both rounds then race ~sqrt(V) entries."""
    size = 1
    while size * size < vocab:
        size *= 2
    return size


class Race:
    """Draws a token per row from its probabilities; keeps a few constants per device."""

    def __init__(self) -> None:
        self._constants_by: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """probs: [N, V] >= 0 in vocabulary order, each row with some mass (need not sum to
        1); keys: [N] int64, the rows' 32-bit noise keys. Returns [N] int64 token ids."""
        n, vocab = probs.shape
        size = block_size(vocab)
        full, blocks = vocab // size, -(-vocab // size)
        hashed, offsets = self._constants(vocab, probs.device)
        noise = exponential(hashed, keys)  # (N, blocks + size): both rounds' in one pass
        mass = probs[:, : full * size].view(n, full, size).sum(dim=-1)  # (N, blocks)
        if full < blocks:  # the last block is short
            mass = torch.cat([mass, probs[:, full * size :].sum(dim=-1, keepdim=True)], dim=1)
        block = torch.div(mass, noise[:, :blocks]).argmax(dim=-1, keepdim=True)  # (N, 1)
        token = block * size + offsets  # (N, size)
        inner = probs.gather(1, token.clamp(max=vocab - 1))
        if full < blocks:
            inner = inner.masked_fill(token >= vocab, 0.0)
        offset = torch.div(inner, noise[:, blocks:]).argmax(dim=-1)
        return block.squeeze(1) * size + offset

    def _constants(self, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """hash32 of 0 .. blocks + size - 1, and the offsets 0 .. size - 1, made once."""
        key = (vocab, device)
        if key not in self._constants_by:
            size = block_size(vocab)
            ids = torch.arange(-(-vocab // size) + size, device=device)
            self._constants_by[key] = hash32(ids), torch.arange(size, device=device)
        return self._constants_by[key]


def exponential(hashed_ids: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[N, K] fp32 Exp(1) noise of (key, i): -log u, u = open_uniform(hash32(hash32(i) ^ key)).

    hashed_ids: [K] hash32 of the indices i; keys: [N] int64 below 2**32."""
    return open_uniform(hash32(hashed_ids ^ keys.unsqueeze(1))).log_().neg_()
