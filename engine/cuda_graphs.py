"""CUDA graphs of the decode forward (embedding to fp32 logits), one per captured batch size.

A decode-only step of `n` sequences replays the graph of the smallest captured size `b >= n`.
Every input lives in a static buffer the graph was captured on; rows `n..b` are padding: token
0 at position 0, its K/V written to the runner's spare pad page, its logits ignored. With LoRA,
each size has two more graphs: one whose projections run `kernels.seg_lora` over a static
segment table of fixed capacity (`segment_capacity`), refilled from the step's adapter slots
before a replay, and one running BGMV over static per-token slots, replayed when the step's adapters
make more segments than `lora.batch.graph_kernel` allows (then each row reads its own adapter
anyway, and BGMV's wider grid reads faster). Graphs are keyed `(size, LoRA kernel or None)`.
"""

from __future__ import annotations

import torch

from engine.models.llama import LlamaForCausalLM
from engine.staged_inputs import StagedInputs
from kernels.attention import AttentionMetadata
from kernels.seg_lora import MAX_ROWS, segment_table
from lora.batch import SEGMENTED_MAX_SEGMENTS, LoraBatchInfo, graph_kernel
from lora.layers import LoraContext


def capture_graph(forward, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Warm `forward` up on a side stream (compiles kernels, outside the capture), then capture
    it into `pool`; returns the graph and the output it writes."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph, out


def _stage_segments(h: dict, slots: list[int], capacity: int) -> int:
    """Write the segment table of rows with adapter `slots` into the staged host buffers;
    returns how many of its segments have an adapter."""
    indptr, seg_slots = segment_table(slots, capacity)
    h["seg_indptr"][: capacity + 1] = indptr
    h["seg_slots"][:capacity] = seg_slots
    return sum(s >= 0 for s in seg_slots)


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to 128 and every 32 beyond, capped at `max_batch`."""
    sizes = [1, 2, 4, 8] + list(range(16, 129, 16)) + list(range(160, max_batch + 1, 32))
    return sorted({min(s, max_batch) for s in sizes})


class _GraphSet:
    """What the decode and extend graph sets share: capturing every size, without LoRA and
    with each LoRA kernel of `lora_kernels`. Subclasses set `sizes`, `lora`, `seg_indptr`,
    `seg_slots`, `token_slots`, `graphs`; they define `_forward(b)` and
    `segment_capacity(b)`."""

    lora_kernels: tuple[str, ...] = ("segmented", "bgmv")

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so the smaller graphs reuse its memory pool."""
        pool = torch.cuda.graph_pool_handle()
        variants = (None, *self.lora_kernels) if self.lora is not None else (None,)
        for b in reversed(self.sizes):
            for kernel in variants:
                self._set_lora(b, kernel)
                self.graphs[(b, kernel)] = capture_graph(lambda b=b: self._forward(b), pool)
        if self.lora is not None:
            self.lora.info = None
        torch.cuda.synchronize()

    def _set_lora(self, b: int, kernel: str | None) -> None:
        """The LoRA wrappers read `lora.info` while being captured: a kernel over the static
        LoRA inputs of size `b` (their capacity, not the step's adapters, sizes the grid)."""
        if self.lora is None:
            return
        if kernel == "segmented":
            cap = self.segment_capacity(b)
            self.lora.info = LoraBatchInfo.segmented(self.seg_indptr[: cap + 1],
                                                     self.seg_slots[:cap])
        elif kernel == "bgmv":
            self.lora.info = LoraBatchInfo.per_token(self.token_slots[:b])
        else:
            self.lora.info = None


class DecodeGraphs(_GraphSet):
    @staticmethod
    def segment_capacity(b: int) -> int:
        """Segments the segmented LoRA graph of size `b` launches programs for: its step has at
        most `SEGMENTED_MAX_SEGMENTS` with an adapter, and one of base rows (sorted by slot,
        they are one run). Every program past the step's segments exits at once, but costs."""
        return min(b, SEGMENTED_MAX_SEGMENTS + 1)

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        page_size: int,
        pad_page: int,
        max_batch: int,
        max_pages_per_seq: int,
        lora: LoraContext | None,
    ):
        self.model, self.kv_caches, self.lora = model, kv_caches, lora
        self.page_size, self.pad_page = page_size, pad_page
        self.sizes = capture_sizes(max_batch)
        self.max_pages = max_pages_per_seq
        device = model.embed_tokens.weight.device
        b = self.sizes[-1]
        self.pad_slot = pad_page * page_size
        # The tables come last: a graph of size s needs their first s rows only.
        self.inputs = StagedInputs([
            ("input_ids", torch.long, (b,), 0),
            ("positions", torch.long, (b,), 0),
            ("slot_mapping", torch.long, (b,), self.pad_slot),
            ("lens", torch.int32, (b,), 1),
            ("token_slots", torch.int32, (b,), -1),
            ("seg_indptr", torch.int32, (b + 1,), 0),
            ("seg_slots", torch.int32, (b,), -1),
            ("tables", torch.int32, (b, max_pages_per_seq), pad_page),
        ], device)
        d = self.inputs.dev
        self.input_ids, self.positions, self.slot_mapping = (
            d["input_ids"], d["positions"], d["slot_mapping"])
        self.lens, self.tables, self.token_slots = d["lens"], d["tables"], d["token_slots"]
        self.seg_indptr, self.seg_slots = d["seg_indptr"], d["seg_slots"]
        self.last_key: tuple[int, str | None] | None = None  # the graph replayed last
        self._rows: list[list[int] | None] = [None] * b  # the pages each host table row holds
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def fits(self, num_seqs: int, max_pages: int) -> bool:
        return num_seqs <= self.sizes[-1] and max_pages <= self.max_pages

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
        lora_slots: list[int] | None,
        device_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Replay for one decode-only step of `n = len(input_ids)` sequences; `tables[i]` holds
        sequence i's pages covering its context. `device_ids` ([n], on the device) replaces
        `input_ids` when given. Returns fp32 logits [n, vocab] (a view of the graph's output,
        valid until the next replay)."""
        n = len(input_ids)
        b = next(s for s in self.sizes if s >= n)
        h = self.inputs.stage()
        h["input_ids"][:n] = input_ids
        h["positions"][:n] = positions
        h["slot_mapping"][:n] = slots
        h["lens"][:n] = positions
        h["lens"][:n] += 1
        for i, pages in enumerate(tables):  # a row is rewritten only when its pages changed
            if self._rows[i] != pages:
                h["tables"][i, : len(pages)] = pages
                self._rows[i] = list(pages)
        # Padding rows: token 0 at position 0, written to the pad page, which it attends to.
        h["input_ids"][n:b] = 0
        h["positions"][n:b] = 0
        h["slot_mapping"][n:b] = self.pad_slot
        h["lens"][n:b] = 1
        h["tables"][n:b, 0] = self.pad_page
        self._rows[n:b] = [None] * (b - n)
        kernel = None
        if lora_slots is not None:  # rows n..b (padding) are in no segment and have no slot
            kernel = graph_kernel(_stage_segments(h, lora_slots, b))
            if kernel == "bgmv":
                h["token_slots"][:n] = lora_slots
                h["token_slots"][n:b] = -1
        self.inputs.send("tables", b)
        if device_ids is not None:
            self.input_ids[:n].copy_(device_ids)
        self.last_key = (b, kernel)
        graph, logits = self.graphs[self.last_key]
        graph.replay()
        return logits[:n]

    def _forward(self, b: int) -> torch.Tensor:
        empty = self.lens[:0]
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:b],
            page_size=self.page_size,
            num_decodes=b,
            decode_tables=self.tables[:b],
            decode_lens=self.lens[:b],
            prefill_tables=self.tables[:0],
            prefill_query_start=empty,
            prefill_lens=empty,
            max_prefill_len=0,
        )
        hidden = self.model(self.input_ids[:b], self.positions[:b], self.kv_caches, meta)
        return self.model.compute_logits(hidden)



def extend_sizes(max_tokens: int) -> list[int]:
    """Padded chunk lengths of the extend graphs: every 16 up to 128, then every 32 up to 256
    (padding costs attention work), capped at `max_tokens`."""
    sizes = list(range(16, 129, 16)) + list(range(160, 257, 32))
    return sorted({min(s, max_tokens) for s in sizes})


class ExtendGraphs(_GraphSet):
    """CUDA graphs of one sequence's short last chunk: a cached session's next turn, whose
    eager forward would cost more host time launching kernels than GPU time running them.

    A chunk of `n` new tokens on a context of `ctx` replays the graph of the smallest size
    `b >= n`: the chunk becomes `b` queries at positions `ctx - n .. ctx - n + b - 1`. The
    `b - n` padding queries come after the real ones, so causality hides them from every real
    query; they write their K/V to the pad page, read the pad page past the context, and only
    the last real token's logits are kept. One sequence is one adapter, so LoRA is segmented.
    """

    lora_kernels = ("segmented",)

    @staticmethod
    def segment_capacity(b: int) -> int:
        """One sequence, one adapter: segments of `MAX_ROWS` rows."""
        return -(-b // MAX_ROWS)

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        page_size: int,
        pad_page: int,
        max_tokens: int,
        max_pages_per_seq: int,
        lora: LoraContext | None,
    ):
        self.model, self.kv_caches, self.lora = model, kv_caches, lora
        self.page_size, self.pad_page = page_size, pad_page
        self.sizes = extend_sizes(max_tokens)
        self.max_pages = max_pages_per_seq
        device = model.embed_tokens.weight.device
        b = self.sizes[-1]

        self.pad_slot = pad_page * page_size
        self.inputs = StagedInputs([
            ("input_ids", torch.long, (b,), 0),
            ("positions", torch.long, (b,), 0),
            ("slot_mapping", torch.long, (b,), self.pad_slot),
            ("sample_row", torch.long, (1,), 0),
            ("lens", torch.int32, (1,), b),
            ("seg_indptr", torch.int32, (b + 1,), 0),
            ("seg_slots", torch.int32, (b,), -1),
            ("table", torch.int32, (1, max_pages_per_seq), pad_page),
        ], device)
        d = self.inputs.dev
        self.input_ids, self.positions, self.slot_mapping = (
            d["input_ids"], d["positions"], d["slot_mapping"])
        self.sample_row, self.lens, self.table = d["sample_row"], d["lens"], d["table"]
        self.seg_indptr, self.seg_slots = d["seg_indptr"], d["seg_slots"]
        self.query_start = {s: torch.tensor([0, s], dtype=torch.int32, device=device)
                            for s in self.sizes}
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def fits(self, num_tokens: int, context: int) -> bool:
        """A chunk of `num_tokens` ending at `context` tokens; its padding's positions must
        stay inside the table too."""
        if not 1 < num_tokens <= self.sizes[-1]:
            return False
        b = next(s for s in self.sizes if s >= num_tokens)
        return context - num_tokens + b <= self.max_pages * self.page_size

    def run(
        self,
        input_ids: list[int],
        start: int,
        slots: list[int],
        pages: list[int],
        lora_slot: int | None,
    ) -> torch.Tensor:
        """Replay for a chunk of `n = len(input_ids)` tokens at positions `start..start+n-1`
        (`slots` their KV slots, `pages` the sequence's pages covering them). Returns the fp32
        logits [1, vocab] of its last token (a view, valid until the next replay)."""
        n = len(input_ids)
        b = next(s for s in self.sizes if s >= n)
        h = self.inputs.stage()
        h["input_ids"][:n] = input_ids
        h["input_ids"][n:b] = 0
        h["positions"][:n] = range(start, start + n)
        h["positions"][n:b] = 0
        h["slot_mapping"][:n] = slots
        h["slot_mapping"][n:b] = self.pad_slot
        h["table"][0, : len(pages)] = pages
        h["table"][0, len(pages) :] = self.pad_page
        h["lens"][0] = start + b
        h["sample_row"][0] = n - 1
        kernel = None if lora_slot is None else "segmented"
        if kernel:  # the padding queries are in no segment
            _stage_segments(h, [lora_slot] * n, b)
        self.inputs.send("table", 1)
        graph, logits = self.graphs[(b, kernel)]
        graph.replay()
        return logits

    def _forward(self, b: int) -> torch.Tensor:
        empty = self.lens[:0]
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:b],
            page_size=self.page_size,
            num_decodes=0,
            decode_tables=self.table[:0],
            decode_lens=empty,
            prefill_tables=self.table,
            prefill_query_start=self.query_start[b],
            prefill_lens=self.lens,
            max_prefill_len=b,
        )
        hidden = self.model(self.input_ids[:b], self.positions[:b], self.kv_caches, meta)
        return self.model.compute_logits(hidden.index_select(0, self.sample_row))
