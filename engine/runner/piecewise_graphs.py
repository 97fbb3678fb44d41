"""CUDA graphs of a mixed step's forward with its attention left out (vLLM's piecewise graphs).

A step that prefills (prompts, chunks, prefix hits beside decodes) runs eagerly: its attention
depends on how many sequences and tokens it holds, which no captured graph fixes. Eagerly, each
layer launches a dozen kernels from Python: on two H100 hosts a step of ~900 tokens (an 8B
model) spent 14 and 27 ms of host time launching, beside ~22 ms of GPU time, and in a server
every launch also waits for the GIL behind the event loop
(benchmarks/results/h100_piecewise_2026-11-25.md).

Here the forward is cut at each attention: piece 0 is the embedding and layer 0 up to its
queries (the RMSNorm, the qkv projection, RoPE with the step's K/V written to the cache); piece
i + 1 is layer i from its attention's output on (o_proj, the residual add and RMSNorm, the MLP)
and layer i + 1 up to its queries; the last piece ends with the final norm. Each piece is
captured for every padded token count (`piecewise_sizes`); a step of `T` tokens replays the
pieces of the smallest size `b >= T` and runs each layer's attention eagerly in between, on its
`T` real rows. Rows `T..b` are padding: their K/V go to the pad page and their outputs are
never read (every op of a piece is row by row). The pieces pass the residual stream, the rotary
tables and the queries through static buffers; the graphs share one memory pool.

With LoRA, each size has a second set of pieces whose projections run SGMV (`kernels.sgmv`)
over a static segment table (runs of rows with one adapter, cut at `SEGMENT_ROWS` rows; its
capacity, not the step's adapters, sizes the grid), refilled before a replay; a base-only step
replays the first set. These steps prefill, so their segments are long: SGMV's prefill tiles
read each adapter tile once per 64 rows, where the decode graphs' `kernels.seg_lora` (16-row
segments, K split over programs) made a 2,048-token step's LoRA 4-10x slower per projection
(benchmarks/results/lora_prefill_h200.md). Steps of more than `PIECEWISE_MAX_TOKENS`
(engine/runner/model_runner.py), whose GPU time dwarfs their launches, stay eager.

Under tensor parallelism the pieces hold the collectives (the all-reduce after o_proj and
down_proj, the embedding's): every rank captures the same pieces in the same order and replays
the same ones each step (the choice depends on the step's inputs alone), so the captured
collectives meet. A row-parallel LoRA's partial shrink adds into the partial output the
all-reduce sums (`Partition.cut_lora`), so LoRA adds no collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from engine.runner.cuda_graphs import capture_graph, gc_paused
from engine.runner.models.llama import DecoderLayer, LlamaForCausalLM
from kernels.attention import AttentionMetadata, paged_attention
from kernels.seg_lora import segment_table
from kernels.sgmv import PREFILL_ROWS
from kernels.upload import upload
from lora.batch import LoraBatchInfo
from lora.layers import LoraContext

KV = tuple[torch.Tensor, torch.Tensor]
SEGMENT_ROWS = PREFILL_ROWS  # the LoRA segments' rows: SGMV's prefill tiles take them whole


def piecewise_sizes(max_tokens: int) -> list[int]:
    """Padded token counts: every 32 from 128 up to 1024, then every 64, capped at
    `max_tokens`. A padded row costs the GPU as much as a real one once a step computes more
    than it reads (an 8B model on an H100: from a few hundred tokens on), so the sizes are
    close; fewer than 128 tokens cost about what 128 do (reading the weights bounds them)."""
    sizes = [*range(128, 1025, 32), *range(1088, max(max_tokens, 1088) + 64, 64)]
    return sorted({min(s, max_tokens) for s in sizes})


class PiecewiseGraphs:
    """The pieces of the forward over static buffers of up to `max_tokens` rows. `capture()`
    (CUDA) records each piece of each size; without it `run` calls the pieces directly, which
    is the same computation (the CPU tests check it against the model's forward)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: Sequence[KV],
        pad_slot: int,
        max_tokens: int,
        max_seqs: int,
        lora: LoraContext | None = None,
        layer_ready: Sequence[torch.cuda.Event] | None = None,
    ):
        """`max_seqs`: the most sequences in a step (it bounds the LoRA segments);
        `layer_ready`: the host KV tier's events; piece i waits for layer i's before it
        writes that layer's K/V (a replayed wait on an event recorded long ago costs nothing)."""
        self.model, self.kv_caches, self.pad_slot = model, list(kv_caches), pad_slot
        self.layers = [cast(DecoderLayer, layer) for layer in model.layers]
        self.max_seqs, self.lora, self.layer_ready = max_seqs, lora, layer_ready
        self.sizes = piecewise_sizes(max_tokens)
        cfg, w = model.local_cfg, model.embed_tokens.weight
        b, half = self.sizes[-1], cfg.head_dim // 2
        self.ids = torch.zeros(b, dtype=torch.long, device=w.device)
        self.positions = torch.zeros(b, dtype=torch.long, device=w.device)
        self.slots = torch.full((b,), pad_slot, dtype=torch.long, device=w.device)
        self.cos = torch.zeros(b, 1, half, dtype=w.dtype, device=w.device)
        self.sin = torch.zeros(b, 1, half, dtype=w.dtype, device=w.device)
        self.x = torch.zeros(b, cfg.hidden_size, dtype=w.dtype, device=w.device)
        self.residual = torch.zeros_like(self.x)
        self.q = torch.zeros(b, cfg.num_heads, cfg.head_dim, dtype=w.dtype, device=w.device)
        self.o = torch.zeros_like(self.q)  # rows past a step's tokens keep finite old values
        cap = self.segment_capacity(b)
        self.seg_indptr = torch.zeros(cap + 1, dtype=torch.int32, device=w.device)
        self.seg_slots = torch.full((cap,), -1, dtype=torch.int32, device=w.device)
        # (size, with LoRA) -> the pieces, in order
        self.graphs: dict[tuple[int, bool], list[torch.cuda.CUDAGraph]] = {}

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.sizes[-1]

    def segment_capacity(self, b: int) -> int:
        """Segments of a step of at most `b` tokens in at most `max_seqs` sequences: each run
        of one adapter is cut into pieces of `SEGMENT_ROWS` rows."""
        return -(-b // SEGMENT_ROWS) + min(self.max_seqs, b)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every piece of every size (with LoRA, twice: base-only and segmented),
        largest first so the smaller sizes reuse its memory pool (the pieces' outputs live in
        the static buffers, outside it)."""
        pool = torch.cuda.graph_pool_handle()
        with gc_paused():
            for b in reversed(self.sizes):
                for lora in (False, True) if self.lora is not None else (False,):
                    self._set_lora(b, lora)
                    self.graphs[(b, lora)] = [
                        capture_graph(lambda i=i, b=b: self._piece(i, b), pool)[0]
                        for i in range(len(self.layers) + 1)]
        self._set_lora(0, False)
        torch.cuda.synchronize()

    def release(self) -> None:
        """Free every captured piece (`ModelRunner.close`)."""
        for pieces in self.graphs.values():
            for graph in pieces:
                graph.reset()
        self.graphs.clear()

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        token_slots: list[int] | None = None,
    ) -> torch.Tensor:
        """The forward of a step of T tokens (`input_ids`, `positions`: [T] on the device;
        `meta`: its attention metadata, slot mapping included; `token_slots`: each token's
        adapter slot, None when no token has one). Returns the final hidden states
        [T, hidden], a view of a static buffer valid until the next run."""
        t = len(input_ids)
        b = next(s for s in self.sizes if s >= t)
        self.ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slots[:t].copy_(meta.slot_mapping)
        self.slots[t:b].fill_(self.pad_slot)  # padding rows' old ids and positions are valid
        lora = token_slots is not None
        if lora:  # the padding rows are in no segment
            assert token_slots is not None and self.lora is not None
            cap = self.segment_capacity(b)
            indptr, seg_slots = upload(list(segment_table(token_slots, cap, SEGMENT_ROWS)),
                                       torch.int32,
                                       self.seg_slots.device)
            self.seg_indptr[: cap + 1].copy_(indptr)
            self.seg_slots[:cap].copy_(seg_slots)
        self._set_lora(b, lora)  # what an uncaptured piece reads (a replay has its own)
        pieces = self.graphs.get((b, lora))
        scale = self.layers[0].self_attn.scale
        self._replay(pieces, 0, b)
        for i, kv in enumerate(self.kv_caches):
            paged_attention(self.q[:t], kv[0], kv[1], meta, scale, out=self.o[:t],
                            kv_scales=self.layers[i].self_attn.kv_scales)
            self._replay(pieces, i + 1, b)
        return self.x[:t]

    def _set_lora(self, b: int, lora: bool) -> None:
        """The LoRA wrappers read `lora.info` when they run or are captured: the segmented
        kernel over the static table of size `b`'s capacity, or none."""
        if self.lora is None:
            return
        cap = self.segment_capacity(b)
        self.lora.info = (LoraBatchInfo.static(self.seg_indptr[: cap + 1], self.seg_slots[:cap],
                                               SEGMENT_ROWS) if lora else None)

    def _replay(self, pieces: list[torch.cuda.CUDAGraph] | None, i: int, b: int) -> None:
        if pieces is None:
            self._piece(i, b)
        else:
            pieces[i].replay()

    def _piece(self, i: int, b: int) -> None:
        """Piece `i` over the first `b` rows of the static buffers."""
        model, layers = self.model, self.layers
        if i == 0:
            x = model.embed(self.ids[:b])
            positions = self.positions[:b]
            self.cos[:b].copy_(model.rope_cos[positions].unsqueeze(1))
            self.sin[:b].copy_(model.rope_sin[positions].unsqueeze(1))
            _store(self.residual[:b], x)
            self._queries(0, layers[0].input_layernorm(x), b)
            return
        layer = layers[i - 1]
        x = layer.self_attn.output(self.o[:b])
        x, residual = layer.post_attention_layernorm.add(x, self.residual[:b])
        x = layer.mlp(x)
        if i < len(layers):
            x, residual = layers[i].input_layernorm.add(x, residual)
            _store(self.residual[:b], residual)
            self._queries(i, x, b)
        else:
            _store(self.x[:b], model.norm.add(x, residual)[0])

    def _queries(self, layer: int, x: torch.Tensor, b: int) -> None:
        """Layer `layer`'s queries of the normed `x` into `self.q`, its K/V into the cache."""
        if self.layer_ready is not None:
            torch.cuda.current_stream().wait_event(self.layer_ready[layer])
        q = self.layers[layer].self_attn.project(
            x, self.cos[:b], self.sin[:b], self.kv_caches[layer], self.slots[:b])
        _store(self.q[:b], q)


def _store(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src, unless an in-place kernel already wrote it there."""
    if src.data_ptr() != dst.data_ptr():
        dst.copy_(src)
