"""CUDA graphs of the forward (embedding to fp32 logits): decode steps, and one sequence's short
last chunk.

A decode-only step of `n` sequences replays the graph of the smallest captured size `b >= n`.
Every input lives in a static buffer the graph was captured on, filled from the step's
`StepInputs` before a replay; rows `n..b` are padding: token 0 at position 0, its K/V written to
the runner's spare pad page, its logits ignored. With LoRA, each size has two more graphs: one
whose projections run `kernels.seg_lora` over a static segment table of fixed capacity
(`segment_capacity`), refilled from the step's adapter slots before a replay, and one running
BGMV over static per-token slots, replayed when the step's adapters make more segments than
`lora.batch.graph_kernel` allows (then each row reads its own adapter anyway, and BGMV's wider
grid reads faster). Graphs are keyed `(size, LoRA kernel or None)`.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from engine.runner.models.llama import LlamaForCausalLM
from engine.runner.step_inputs import StepInputs
from kernels.attention import AttentionMetadata
from kernels.seg_lora import MAX_ROWS, segment_table
from kernels.upload import Staging
from lora.batch import SEGMENTED_MAX_SEGMENTS, LoraBatchInfo, graph_kernel
from lora.layers import LoraContext

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]  # iterated once per forward, layer by layer


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


@contextmanager
def gc_paused() -> Iterator[None]:
    """Collect garbage, then keep the cyclic collector off while graphs are captured. A dead
    engine's graphs freed by a collection that runs mid-capture destroy their graph execs, which
    CUDA forbids while a stream captures: the capture fails, and the CUDA generator is left in
    capture state for every later random draw. (torch 2.13 no longer collects on entering
    `torch.cuda.graph`.)"""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def stage_segments(h: dict[str, np.ndarray], slots: list[int], capacity: int) -> int:
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


class GraphSet:
    """What the decode, extend and verify graph sets share: static inputs staged on the host
    and sent up in one copy per replay; capturing every size, without LoRA and with each LoRA
    kernel of `lora_kernels`."""

    lora_kernels: tuple[str, ...] = ("segmented", "bgmv")

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: KVCaches,
        page_size: int,
        pad_page: int,
        max_pages_per_seq: int,
        lora: LoraContext | None,
        sizes: list[int],
        inputs: dict[str, tuple[torch.dtype, tuple[int, ...], int]],
    ):
        """`inputs`: the static inputs, name -> (dtype, shape, value before the first step)."""
        self.model, self.kv_caches, self.lora = model, kv_caches, lora
        self.page_size, self.pad_page = page_size, pad_page
        self.pad_slot = pad_page * page_size
        self.max_pages = max_pages_per_seq
        self.sizes = sizes
        device = model.embed_tokens.weight.device
        self.inputs = Staging({k: (dtype, shape) for k, (dtype, shape, _) in inputs.items()},
                              device)
        for name, (_, _, value) in inputs.items():
            self.inputs.host[name].fill(value)
        self._copied = torch.cuda.Event()  # recorded after each copy out of the host buffer
        self._send()
        self.graphs: dict[tuple[int, str | None], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so the smaller graphs reuse its memory pool."""
        pool = torch.cuda.graph_pool_handle()
        variants = (None, *self.lora_kernels) if self.lora is not None else (None,)
        with gc_paused():
            for b in reversed(self.sizes):
                for kernel in variants:
                    self._set_lora(b, kernel)
                    self.graphs[(b, kernel)] = capture_graph(lambda b=b: self._forward(b), pool)
        if self.lora is not None:
            self.lora.info = None
        torch.cuda.synchronize()

    def release(self) -> None:
        """Free every captured graph (`ModelRunner.close`)."""
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def _stage(self) -> dict[str, np.ndarray]:
        """The host side of the static inputs, to fill for the next replay: rewritten only once
        the last copy out of it has run, so staging never races a copy still queued."""
        self._copied.synchronize()
        return self.inputs.host

    def _send(self, last: str | None = None, rows: int = 0) -> None:
        """Copy the staged inputs up without waiting (`Staging.send`)."""
        self.inputs.send(last, rows)
        self._copied.record()

    def segment_capacity(self, b: int) -> int:
        """Segments in the segmented LoRA graph of size `b`."""
        raise NotImplementedError

    def _forward(self, b: int) -> torch.Tensor:
        """The forward of size `b` over the static inputs, as captured."""
        raise NotImplementedError

    def _set_lora(self, b: int, kernel: str | None) -> None:
        """The LoRA wrappers read `lora.info` while being captured: a kernel over the static
        LoRA inputs of size `b` (their capacity, not the step's adapters, sizes the grid)."""
        if self.lora is None:
            return
        d = self.inputs.dev
        if kernel == "segmented":
            cap = self.segment_capacity(b)
            self.lora.info = LoraBatchInfo.segmented(d["seg_indptr"][: cap + 1],
                                                     d["seg_slots"][:cap])
        elif kernel == "bgmv":
            self.lora.info = LoraBatchInfo.per_token(d["token_slots"][:b])
        else:
            self.lora.info = None


class DecodeGraphs(GraphSet):
    @staticmethod
    def segment_capacity(b: int) -> int:
        """Segments the segmented LoRA graph of size `b` launches programs for: its step has at
        most `SEGMENTED_MAX_SEGMENTS` with an adapter, and one of base rows (sorted by slot,
        they are one run). Every program past the step's segments exits at once, but costs."""
        return min(b, SEGMENTED_MAX_SEGMENTS + 1)

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: KVCaches,
        page_size: int,
        pad_page: int,
        max_batch: int,
        max_pages_per_seq: int,
        lora: LoraContext | None,
    ):
        sizes = capture_sizes(max_batch)
        b = sizes[-1]
        # The tables come last: a graph of size s needs their first s rows only.
        super().__init__(model, kv_caches, page_size, pad_page, max_pages_per_seq, lora, sizes, {
            "input_ids": (torch.long, (b,), 0),
            "positions": (torch.long, (b,), 0),
            "slot_mapping": (torch.long, (b,), pad_page * page_size),
            "lens": (torch.int32, (b,), 1),
            "token_slots": (torch.int32, (b,), -1),
            "seg_indptr": (torch.int32, (b + 1,), 0),
            "seg_slots": (torch.int32, (b,), -1),
            "tables": (torch.int32, (b, max_pages_per_seq), pad_page),
        })
        self.last_key: tuple[int, str | None] | None = None  # the graph replayed last
        self._rows: list[list[int] | None] = [None] * b  # the pages each host table row holds

    def fits(self, num_seqs: int, context: int) -> bool:
        """A decode-only step of `num_seqs` sequences, the longest `context` tokens long."""
        return num_seqs <= self.sizes[-1] and -(-context // self.page_size) <= self.max_pages

    def run(self, inputs: StepInputs, device_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Replay for a decode-only step of `n` sequences, each sampled. `device_ids` ([n], on
        the device) replaces `inputs.input_ids` when given. Returns fp32 logits [n, vocab] (a
        view of the graph's output, valid until the next replay)."""
        n = len(inputs.input_ids)
        b = next(s for s in self.sizes if s >= n)
        h = self._stage()
        h["input_ids"][:n] = inputs.input_ids
        h["positions"][:n] = inputs.positions
        h["slot_mapping"][:n] = inputs.slot_mapping
        h["lens"][:n] = inputs.context_lens
        for i, pages in enumerate(inputs.tables):  # a row is rewritten only when its pages changed
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
        if self.lora is not None and any(s >= 0 for s in inputs.lora_slots):
            # Rows n..b (padding) are in no segment and have no slot.
            kernel = graph_kernel(stage_segments(h, inputs.lora_slots, b))
            if kernel == "bgmv":
                h["token_slots"][:n] = inputs.lora_slots
                h["token_slots"][n:b] = -1
        self._send("tables", b)
        if device_ids is not None:
            self.inputs.dev["input_ids"][:n].copy_(device_ids)
        self.last_key = (b, kernel)
        graph, logits = self.graphs[self.last_key]
        graph.replay()
        return logits[:n]

    def _forward(self, b: int) -> torch.Tensor:
        d = self.inputs.dev
        empty = d["lens"][:0]
        meta = AttentionMetadata(
            slot_mapping=d["slot_mapping"][:b],
            page_size=self.page_size,
            num_decodes=b,
            decode_tables=d["tables"][:b],
            decode_lens=d["lens"][:b],
            prefill_tables=d["tables"][:0],
            prefill_query_start=empty,
            prefill_lens=empty,
            max_prefill_len=0,
        )
        hidden = self.model(d["input_ids"][:b], d["positions"][:b], self.kv_caches, meta)
        return self.model.compute_logits(hidden)


EXTEND_ROWS = 17  # logits rows of an extend graph: a speculative decode's 1 + up to 16 drafts


def extend_sizes(max_tokens: int) -> list[int]:
    """Padded chunk lengths of the extend graphs: every 16 up to 128, then every 32 up to 256
    (padding costs attention work), capped at `max_tokens`."""
    sizes = list(range(16, 129, 16)) + list(range(160, 257, 32))
    return sorted({min(s, max_tokens) for s in sizes})


class ExtendGraphs(GraphSet):
    """CUDA graphs of one sequence's short last chunk: a cached session's next turn, whose
    eager forward would cost more host time launching kernels than GPU time running them.

    A chunk of `n` new tokens on a context of `ctx` replays the graph of the smallest size
    `b >= n`: the chunk becomes `b` queries at positions `ctx - n .. ctx - n + b - 1`. The
    `b - n` padding queries come after the real ones, so causality hides them from every real
    query; they write their K/V to the pad page, read the pad page past the context, and only
    the sampled tokens' logits are kept: the last real one's, or every position of a
    speculative decode's (up to `EXTEND_ROWS`). One sequence is one adapter, so LoRA is
    segmented.
    """

    lora_kernels = ("segmented",)

    @staticmethod
    def segment_capacity(b: int) -> int:
        """One sequence, one adapter: segments of `MAX_ROWS` rows."""
        return -(-b // MAX_ROWS)

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: KVCaches,
        page_size: int,
        pad_page: int,
        max_tokens: int,
        max_pages_per_seq: int,
        lora: LoraContext | None,
    ):
        sizes = extend_sizes(max_tokens)
        b = sizes[-1]
        super().__init__(model, kv_caches, page_size, pad_page, max_pages_per_seq, lora, sizes, {
            "input_ids": (torch.long, (b,), 0),
            "positions": (torch.long, (b,), 0),
            "slot_mapping": (torch.long, (b,), pad_page * page_size),
            "sample_rows": (torch.long, (EXTEND_ROWS,), 0),
            "lens": (torch.int32, (1,), b),
            "seg_indptr": (torch.int32, (b + 1,), 0),
            "seg_slots": (torch.int32, (b,), -1),
            "table": (torch.int32, (1, max_pages_per_seq), pad_page),
        })
        device = model.embed_tokens.weight.device
        self.query_start = {s: torch.tensor([0, s], dtype=torch.int32, device=device)
                            for s in self.sizes}

    def fits(self, num_tokens: int, context: int) -> bool:
        """A chunk of `num_tokens` ending at `context` tokens; its padding's positions must
        stay inside the table too."""
        if not 1 < num_tokens <= self.sizes[-1]:
            return False
        b = next(s for s in self.sizes if s >= num_tokens)
        return context - num_tokens + b <= self.max_pages * self.page_size

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Replay for a step of one sequence's chunk of `n` tokens, sampled at its
        `inputs.sample_rows` (at most `EXTEND_ROWS`). Returns the fp32 logits [rows, vocab] of
        those tokens (a view, valid until the next replay)."""
        n, rows = len(inputs.input_ids), inputs.sample_rows
        b = next(s for s in self.sizes if s >= n)
        start, pages, slot = inputs.positions[0], inputs.tables[0], inputs.lora_slots[0]
        h = self._stage()
        h["input_ids"][:n] = inputs.input_ids
        h["input_ids"][n:b] = 0
        h["positions"][:n] = inputs.positions
        h["positions"][n:b] = 0
        h["slot_mapping"][:n] = inputs.slot_mapping
        h["slot_mapping"][n:b] = self.pad_slot
        h["table"][0, : len(pages)] = pages
        h["table"][0, len(pages) :] = self.pad_page
        h["lens"][0] = start + b
        h["sample_rows"][: len(rows)] = rows
        h["sample_rows"][len(rows) :] = n - 1  # unread rows
        kernel = "segmented" if self.lora is not None and slot >= 0 else None
        if kernel:  # the padding queries are in no segment
            stage_segments(h, [slot] * n, b)
        self._send("table", 1)
        graph, logits = self.graphs[(b, kernel)]
        graph.replay()
        return logits[: len(rows)]

    def _forward(self, b: int) -> torch.Tensor:
        d = self.inputs.dev
        empty = d["lens"][:0]
        meta = AttentionMetadata(
            slot_mapping=d["slot_mapping"][:b],
            page_size=self.page_size,
            num_decodes=0,
            decode_tables=d["table"][:0],
            decode_lens=empty,
            prefill_tables=d["table"],
            prefill_query_start=self.query_start[b],
            prefill_lens=d["lens"],
            max_prefill_len=b,
        )
        hidden = self.model(d["input_ids"][:b], d["positions"][:b], self.kv_caches, meta)
        return self.model.compute_logits(hidden.index_select(0, d["sample_rows"]))
