"""CUDA graphs of the speculative verify step (`VerifyGraphs`): a few sequences, each a short
chunk ending at a sampled position, and the layout and forward they replay
(`verify_layout`, `verify_forward`), which run eagerly on the CPU as well. The decode and
extend graphs they share `GraphSet` with are engine/runner/cuda_graphs.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.runner.cuda_graphs import GraphSet, KVCaches, stage_segments
from engine.runner.models.llama import LlamaForCausalLM
from engine.runner.step_inputs import StepInputs
from kernels.attention import AttentionMetadata
from kernels.seg_lora import MAX_ROWS
from lora.layers import LoraContext

VERIFY_SIZES = (1, 2, 4, 8, 16)  # sequences


class VerifyGraphs(GraphSet):
    """CUDA graphs of a step of a few sequences, each a short chunk ending at a sampled
    position: a speculative step's decodes with their drafts (engine/spec/speculative.py), beside
    plain decodes and the chunks jump-forward appends. Eagerly, such a step costs more host
    time launching kernels than GPU time running them.

    A step of `s` sequences replays the graph of the smallest size `b >= s`. Each sequence gets
    `queries` query slots (1 + the engine's draft tokens): its `n` real tokens, then padding
    queries at the positions after them, which causality hides from the real ones; they write
    their K/V to the pad page and their logits are not kept. Sequences `s..b` are padding
    throughout. LoRA is segmented: a sequence's padding queries take its adapter, so that each
    sequence stays one run.
    """

    lora_kernels = ("segmented",)

    def segment_capacity(self, b: int) -> int:
        """Runs of equal slot over `b` sequences (at most `b`), cut into `MAX_ROWS` rows."""
        return b + -(-b * self.queries // MAX_ROWS)

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: KVCaches,
        page_size: int,
        pad_page: int,
        max_seqs: int,
        max_pages_per_seq: int,
        lora: LoraContext | None,
        queries: int,
    ):
        self.queries = q = queries
        sizes = [s for s in VERIFY_SIZES if s <= max_seqs]
        b = sizes[-1]
        t = b * q
        super().__init__(model, kv_caches, page_size, pad_page, max_pages_per_seq, lora, sizes, {
            "input_ids": (torch.long, (t,), 0),
            "positions": (torch.long, (t,), 0),
            "slot_mapping": (torch.long, (t,), pad_page * page_size),
            "sample_rows": (torch.long, (t,), 0),
            "lens": (torch.int32, (b,), q),
            "seg_indptr": (torch.int32, (self.segment_capacity(b) + 1,), 0),
            "seg_slots": (torch.int32, (self.segment_capacity(b),), -1),
            "tables": (torch.int32, (b, max_pages_per_seq), pad_page),
        })
        device = model.embed_tokens.weight.device
        self.query_start = {s: torch.arange(0, (s + 1) * q, q, dtype=torch.int32, device=device)
                            for s in self.sizes}

    def fits(self, inputs: StepInputs) -> bool:
        """A step of 1..max sequences, each `queries` tokens or fewer and sampled at its last
        (a decode, drafted or not, or a prompt's last chunk), with room in the table for its
        padding's positions."""
        num_seqs = len(inputs.tables)
        if not 1 <= num_seqs <= self.sizes[-1]:
            return False
        limit = self.max_pages * self.page_size - self.queries
        starts = _seq_starts(inputs)
        return all(n <= self.queries and inputs.positions[i] <= limit
                   for i, n in zip(starts, inputs.num_new_tokens, strict=True))

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Replay for a step that `fits`. Returns the fp32 logits [rows, vocab] of its
        `inputs.sample_rows` (a view, valid until the next replay)."""
        s, q = len(inputs.tables), self.queries
        b = next(size for size in self.sizes if size >= s)
        h = self._stage()
        layout = verify_layout(inputs, b, q, self.pad_page, self.page_size)
        tables = layout.pop("tables")
        for name, values in layout.items():
            h[name][: len(values)] = values
        h["tables"][:b, : tables.shape[1]] = tables
        h["tables"][:b, tables.shape[1] :] = self.pad_page
        kernel = None
        if self.lora is not None and any(slot >= 0 for slot in inputs.lora_slots):
            kernel = "segmented"
            slots = [slot for slot in inputs.lora_slots for _ in range(q)] + [-1] * (b - s) * q
            stage_segments(h, slots, self.segment_capacity(b))
        self._send("tables", b)
        graph, logits = self.graphs[(b, kernel)]
        graph.replay()
        return logits[: len(inputs.sample_rows)]

    def run_fed(self, fed: VerifyFed) -> torch.Tensor:
        """Replay for a step built on the device (`VerifyFed`) of 1..max sequences, each of
        exactly `queries` tokens. Returns the fp32 logits [sequences * queries, vocab] (a view,
        valid until the next replay)."""
        s, q = len(fed.lora_slots), self.queries
        b = next(size for size in self.sizes if size >= s)
        real, t = s * q, b * q
        h = self._stage()
        # Padding sequences, as `verify_layout` lays them out; the real ones come from `fed`.
        h["input_ids"][real:t] = 0
        h["positions"][real:t] = np.tile(np.arange(q), b - s)
        h["slot_mapping"][real:t] = self.pad_slot
        h["sample_rows"][:t] = np.arange(t)
        h["lens"][s:b] = q
        h["tables"][:b] = self.pad_page
        kernel = None
        if self.lora is not None and any(slot >= 0 for slot in fed.lora_slots):
            kernel = "segmented"
            slots = [slot for slot in fed.lora_slots for _ in range(q)] + [-1] * (b - s) * q
            stage_segments(h, slots, self.segment_capacity(b))
        self._send("tables", b)
        d = self.inputs.dev  # after the copy up, in stream order
        d["input_ids"][:real].copy_(fed.input_ids)
        d["positions"][:real].copy_(fed.positions)
        d["slot_mapping"][:real].copy_(fed.slot_mapping)
        d["lens"][:s].copy_(fed.lens)
        d["tables"][:s, : fed.tables.shape[1]].copy_(fed.tables)
        graph, logits = self.graphs[(b, kernel)]
        graph.replay()
        return logits[:real]

    def _forward(self, b: int) -> torch.Tensor:
        return verify_forward(self.model, self.kv_caches, self.inputs.dev, b, self.queries,
                              self.page_size, self.query_start[b])


@dataclass
class VerifyFed:
    """A verify step whose inputs were built on the device (the overlapped speculative loop,
    engine/spec/loop.py): S sequences of q tokens each, all sampled."""

    input_ids: torch.Tensor  # (S * q,) int64
    positions: torch.Tensor  # (S * q,) int64
    slot_mapping: torch.Tensor  # (S * q,) int64
    lens: torch.Tensor  # (S,) int32: each sequence's context once the step ran
    tables: torch.Tensor  # (S, width) int32: each sequence's pages, padded
    lora_slots: list[int]  # each sequence's adapter slot (-1: the base model)


def verify_layout(
    inputs: StepInputs, b: int, q: int, pad_page: int, page_size: int
) -> dict[str, np.ndarray]:
    """A verify graph's static inputs of size `b` for a step that fits it: each sequence's
    tokens at its `q` query slots, padding queries after them (token 0, at the
    positions that follow, K/V to the pad page), whole padding sequences past the step's; the
    sampled rows at their slots (unread rows: 0). `tables` are as wide as the step needs,
    padded with the pad page."""
    s = len(inputs.tables)
    counts = np.asarray(inputs.num_new_tokens)
    starts = np.asarray(_seq_starts(inputs))
    within = np.arange(q)
    real = np.zeros((b, q), dtype=bool)
    real[:s] = within[None, :] < counts[:, None]
    src = np.zeros((b, q), dtype=np.int64)
    src[:s] = np.minimum(starts[:, None] + within[None, :], len(inputs.input_ids) - 1)
    first = np.zeros(b, dtype=np.int64)
    first[:s] = np.asarray(inputs.positions)[starts]  # each sequence's first position
    pad_slot = pad_page * page_size
    lens = (first + q).astype(np.int32)  # the padding queries' positions included
    width = max(max(len(t) for t in inputs.tables), -(-int(lens.max()) // page_size))
    tables = np.full((b, width), pad_page, dtype=np.int32)
    for i, pages in enumerate(inputs.tables):
        tables[i, : len(pages)] = pages
    # A sampled token's slot: its sequence's row, its offset in the sequence.
    seq_of = np.repeat(np.arange(s), counts)
    offset = np.arange(len(inputs.input_ids)) - starts[seq_of]
    rows = np.asarray(inputs.sample_rows, dtype=np.int64)
    sample_rows = np.zeros(b * q, dtype=np.int64)
    sample_rows[: len(rows)] = seq_of[rows] * q + offset[rows]
    return {
        "input_ids": np.where(real, np.asarray(inputs.input_ids)[src], 0).ravel(),
        "positions": (first[:, None] + within[None, :]).ravel(),
        "slot_mapping": np.where(real, np.asarray(inputs.slot_mapping)[src], pad_slot).ravel(),
        "sample_rows": sample_rows,
        "lens": lens,
        "tables": tables,
    }


def verify_forward(
    model: LlamaForCausalLM,
    kv_caches: KVCaches,
    d: dict[str, torch.Tensor],
    b: int,
    q: int,
    page_size: int,
    query_start: torch.Tensor,
) -> torch.Tensor:
    """The forward of a verify graph of size `b`, `q` queries a sequence, over its inputs `d`
    (`verify_layout`'s, on the device): fp32 logits [b * q, vocab] of `d["sample_rows"]`."""
    t = b * q
    meta = AttentionMetadata(
        slot_mapping=d["slot_mapping"][:t],
        page_size=page_size,
        num_decodes=0,
        decode_tables=d["tables"][:0],
        decode_lens=d["lens"][:0],
        prefill_tables=d["tables"][:b],
        prefill_query_start=query_start,
        prefill_lens=d["lens"][:b],
        max_prefill_len=q,
    )
    hidden = model(d["input_ids"][:t], d["positions"][:t], kv_caches, meta)
    return model.compute_logits(hidden.index_select(0, d["sample_rows"][:t]))


def _seq_starts(inputs: StepInputs) -> list[int]:
    """Where each sequence's tokens start in the step: decodes first, one token each, then
    the chunks at their query starts."""
    nd = inputs.num_decodes
    return list(range(nd)) + [nd + start for start in inputs.query_start[:-1]]
