"""Which slice of each weight a tensor-parallel rank holds (Megatron-style).

A rank holds a contiguous range of the attention heads, of the MLP's intermediate features and
of the vocabulary:

- q/k/v and gate/up are column-parallel: the rank keeps the output rows of its heads and its
  intermediate features; o_proj and down_proj are row-parallel: it keeps the matching input
  columns, and the partial outputs are summed over the ranks (one all-reduce each).
- KV heads are split across the ranks, whole query groups with them. With fewer KV heads than
  ranks, each KV head is replicated on the ranks that share its query group.
- The embedding and lm_head are vocabulary-parallel: each rank keeps `vocab_rows` rows (the
  last rank's padded with zeros past the vocabulary, so every shard has one shape).

Splits need not be even (SmolLM2's 3 KV heads over 2 ranks: 1 and 2), except that replicated
KV heads must divide the ranks evenly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.config import ModelConfig, ModelLoadError

# How each projection of the checkpoint is split: the dimension of its weight `[out, in]`
# that is sliced, and which range it takes.
COLUMN = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "ffn", "up_proj": "ffn"}
ROW = {"o_proj": "q", "down_proj": "ffn"}
VOCAB = ("embed_tokens", "lm_head")


@dataclass(frozen=True)
class Partition:
    """One rank's share of the model. Ranges are `(start, stop)` in the full model."""

    rank: int
    size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    ffn: tuple[int, int]
    vocab_start: int
    vocab_rows: int  # rows of this rank's embedding shard (the same on every rank)
    head_dim: int

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, size: int) -> Partition:
        """Rank `rank` of `size`; raises ModelLoadError when the model cannot be split so."""
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside 0..{size - 1}")
        nq, nkv = cfg.num_heads, cfg.num_kv_heads
        group = nq // nkv  # query heads per KV head
        if nkv >= size:
            kv = _split(nkv, size, rank)
            q = (kv[0] * group, kv[1] * group)
        else:
            per = size // nkv  # ranks sharing one KV head
            if size % nkv or group % per:
                raise ModelLoadError(
                    f"tensor_parallel_size={size} cannot split {nq} query heads over {nkv} KV "
                    f"heads: with fewer KV heads than ranks, the ranks must divide evenly "
                    f"among the KV heads and their query groups")
            kv = (rank // per, rank // per + 1)
            n = group // per
            q = (kv[0] * group + (rank % per) * n, kv[0] * group + (rank % per + 1) * n)
        if cfg.intermediate_size < size:
            raise ModelLoadError(f"tensor_parallel_size={size} exceeds the model's "
                                 f"{cfg.intermediate_size} intermediate features")
        rows = -(-cfg.vocab_size // size)
        return cls(rank, size, q, kv, _split(cfg.intermediate_size, size, rank), rank * rows,
                   rows, cfg.head_dim)

    def local(self, cfg: ModelConfig) -> ModelConfig:
        """The shapes this rank's modules are built with (`vocab_size`: its shard's rows)."""
        return dataclasses.replace(
            cfg,
            num_heads=self.q_heads[1] - self.q_heads[0],
            num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
            intermediate_size=self.ffn[1] - self.ffn[0],
            vocab_size=self.vocab_rows,
        )

    def slice_of(self, proj: str) -> tuple[int, int, int] | None:
        """How this rank slices a checkpoint tensor of `proj` ("q_proj", ..., "down_proj",
        "embed_tokens", "lm_head"; a bias follows its weight's dim 0): (dim, start, stop),
        or None when every rank holds all of it. The vocabulary's stop may pass the
        vocabulary: the caller pads."""
        if proj in VOCAB:
            return 0, self.vocab_start, self.vocab_start + self.vocab_rows
        kind = COLUMN.get(proj) or ROW.get(proj)
        if kind is None:
            return None
        start, stop = {"q": self.q_heads, "kv": self.kv_heads, "ffn": self.ffn}[kind]
        if kind != "ffn":
            start, stop = start * self.head_dim, stop * self.head_dim
        return (0 if proj in COLUMN else 1), start, stop

    def cut_lora(self, proj: str, a: torch.Tensor, b: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's shard of one projection's LoRA (a: [r, in], b: [out, r]): B's rows of a
        column-parallel projection, A's columns of a row-parallel one. A row-parallel shrink
        is then partial and its expand adds into the partial output that the all-reduce sums,
        so LoRA needs no collective of its own (S-LoRA's split)."""
        if proj in COLUMN:
            return a, cut(b, self, proj)
        if proj in ROW:
            return cut(a, self, proj), b
        return a, b


def _split(n: int, size: int, rank: int) -> tuple[int, int]:
    """Rank `rank`'s contiguous share of `n` items over `size` ranks (sizes differ by <= 1)."""
    return rank * n // size, (rank + 1) * n // size


def projection(name: str) -> str:
    """The module a tensor belongs to: "layers.0.self_attn.q_proj.weight" -> "q_proj"."""
    return name.split(".")[-2] if "." in name else name


def cut(t: torch.Tensor, part: Partition | None, proj: str | None) -> torch.Tensor:
    """This rank's slice of a whole checkpoint tensor of `proj` (None, or a projection
    `slice_of` does not split: all of it); vocabulary shards padded with zero rows."""
    how = part.slice_of(proj) if part is not None and proj is not None else None
    if how is None:
        return t
    dim, start, stop = how
    piece = t.narrow(dim, start, max(0, min(stop, t.shape[dim]) - start))
    if piece.shape[dim] == stop - start:
        return piece
    pad = list(piece.shape)
    pad[dim] = stop - start - piece.shape[dim]
    return torch.cat([piece, piece.new_zeros(pad)], dim)


# Our fused projections (`engine.runner.models.llama`): their checkpoint parts, in row order.
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def cut_fused(name: str, t: torch.Tensor, part: Partition | None, cfg: ModelConfig) -> torch.Tensor:
    """This rank's slice of the whole model's tensor `name` (our parameter names, e.g.
    "layers.3.self_attn.qkv_proj.weight"): a fused projection is cut part by part."""
    proj = projection(name)
    parts = FUSED_PARTS.get(proj)
    if part is None or parts is None:
        return cut(t, part, proj)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    ffn = cfg.intermediate_size
    sizes = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": ffn, "up_proj": ffn}
    pieces = t.split([sizes[p] for p in parts])
    return torch.cat([cut(x, part, p) for x, p in zip(pieces, parts, strict=True)])
