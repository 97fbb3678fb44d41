"""One step's model inputs as host lists, built once from the scheduled sequences. Pure Python.

The eager forward uploads them (`ModelRunner._prepare`); a CUDA graph copies them into its
static buffers (`engine.runner.cuda_graphs`). Tokens are laid out in the order of the sequences,
which
the model runner sorts decodes first (one query each, attended in one batched call), then
prefill chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.scheduler import ScheduledSeq


@dataclass
class StepInputs:
    """What the forward of one step reads, on the host."""

    # Per token.
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)  # where each token's K/V is written
    # Per sequence.
    tables: list[list[int]] = field(default_factory=list)  # the pages covering its context
    context_lens: list[int] = field(default_factory=list)  # its tokens once this step ran
    lora_slots: list[int] = field(default_factory=list)  # its adapter's slot, -1: base model
    # Per prefill chunk (they follow the decodes): its start among the prefill tokens, then
    # their count.
    query_start: list[int] = field(default_factory=lambda: [0])
    # Per sampling sequence its last token (every token of a speculative decode's).
    sample_rows: list[int] = field(default_factory=list)
    num_decodes: int = 0

    @classmethod
    def build(cls, seqs: list[ScheduledSeq], page_size: int) -> StepInputs:
        """`seqs` decodes first. (Locals, not attributes, in the loop: it runs per token.)"""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables, lens, lora_slots, query_start = [], [], [], [0]
        sample_rows: list[int] = []
        for s in seqs:
            req, start, n = s.request, s.start, s.num_new_tokens
            end = start + n
            tables.append(req.pages[: -(-end // page_size)])
            lens.append(end)
            lora_slots.append(req.lora_slot)
            if n == 1:
                # A decode ahead of its token (`launch(after=...)`) gets it on the device.
                ids.append(req.token_ids[start] if start < req.num_tokens else 0)
                positions.append(start)
                slots.append(_kv_slot(req.pages, start, page_size))
            else:
                ids.extend(req.token_ids[start:end] if not s.draft else
                           [req.token_ids[start], *s.draft])
                positions.extend(range(start, end))
                slots.extend(_kv_slot(req.pages, p, page_size) for p in range(start, end))
                query_start.append(query_start[-1] + n)
            if s.draft:  # a speculative decode draws from its last forced draft on
                sample_rows.extend(range(len(ids) - s.num_drawn, len(ids)))
            elif s.samples:
                sample_rows.append(len(ids) - 1)
        num_decodes = len(seqs) - (len(query_start) - 1)
        return cls(ids, positions, slots, tables, lens, lora_slots, query_start, sample_rows,
                   num_decodes)

    @property
    def num_new_tokens(self) -> list[int]:
        """Per sequence, in order: its tokens in this step (each decode's one, then each
        chunk's)."""
        qs = self.query_start
        return [1] * self.num_decodes + [b - a for a, b in zip(qs, qs[1:], strict=False)]

    @property
    def max_prefill_len(self) -> int:
        qs = self.query_start
        return max((b - a for a, b in zip(qs, qs[1:], strict=False)), default=0)


def _kv_slot(pages: list[int], position: int, page_size: int) -> int:
    """The KV cache slot of a sequence's token at `position`."""
    return pages[position // page_size] * page_size + position % page_size
