"""Turns a scheduled `Batch` into tensors, runs one forward over all its tokens, samples.

This is the only engine module that builds tensors from the scheduler's lists. Tokens are laid
out decodes first (one query each, attended in one batched call), then prefill chunks.
"""

from __future__ import annotations

import torch

from engine.models.llama import LlamaForCausalLM
from engine.sampler import Sampler, SampleResult
from engine.scheduler import Batch, ScheduledSeq
from engine.structured import GrammarStage
from kernels.attention import AttentionMetadata, PrefillSeq
from lora.layers import LoraContext


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_pages: int,
        page_size: int,
        seed: int = 0,
        grammar: GrammarStage | None = None,
        lora: LoraContext | None = None,
    ):
        self.model = model
        self.grammar = grammar
        self.lora = lora  # set when the model's projections are LoRA-wrapped
        self.page_size = page_size
        cfg = model.cfg
        w = model.embed_tokens.weight
        shape = (num_pages * page_size, cfg.num_kv_heads, cfg.head_dim)
        # Zeros, not empty: padded decode slots are read (with zero weight) and must be finite.
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=w.dtype, device=w.device),
                torch.zeros(shape, dtype=w.dtype, device=w.device),
            )
            for _ in range(cfg.num_layers)
        ]
        self.device = w.device
        self.sampler = Sampler(seed)
        self._offsets = torch.arange(page_size, device=self.device)

    @torch.inference_mode()
    def run(self, batch: Batch) -> list[SampleResult]:
        """One forward for the whole batch; returns a sample for each seq with `samples`."""
        seqs = sorted(batch.seqs, key=self._layout)
        input_ids, positions, meta, sample_rows = self._prepare(seqs)
        reqs = [s.request for s in seqs if s.samples]
        masks = self.grammar.start_fill(reqs) if self.grammar else None  # overlaps the forward
        if self.lora is not None:
            self.lora.begin_step([s.request for s in seqs], [s.num_new_tokens for s in seqs])
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        logits = self.model.compute_logits(hidden[sample_rows])
        GrammarStage.apply(logits, masks)
        samples = self.sampler(logits, reqs)
        by_req = dict(zip(reqs, samples, strict=True))
        return [by_req[s.request] for s in batch.seqs if s.samples]

    def _layout(self, s: ScheduledSeq) -> tuple[bool, int]:
        """Decodes first; within them, one run per adapter slot (SGMV segments, not BGMV)."""
        return s.num_new_tokens != 1, self.lora.slot_of(s.request) if self.lora else -1

    def _slots(self, pages: list[int], num_tokens: int) -> torch.Tensor:
        """Slots of a sequence's first `num_tokens` tokens."""
        table = torch.tensor(pages[: -(-num_tokens // self.page_size)], device=self.device)
        return (table.unsqueeze(1) * self.page_size + self._offsets).flatten()[:num_tokens]

    def _prepare(self, seqs: list[ScheduledSeq]):
        ids: list[int] = []
        pos: list[int] = []
        sample_rows: list[int] = []
        decode_ctx: list[torch.Tensor] = []
        prefills: list[PrefillSeq] = []
        slot_parts: list[torch.Tensor] = []
        for s in seqs:
            req, start, n = s.request, s.start, s.num_new_tokens
            first = len(ids)
            ids.extend(req.token_ids[start : start + n])
            pos.extend(range(start, start + n))
            if s.samples:
                sample_rows.append(len(ids) - 1)
            ctx = self._slots(req.pages, start + n)
            slot_parts.append(ctx[start:])
            if n == 1:
                decode_ctx.append(ctx)
            elif start == 0:
                prefills.append(PrefillSeq(first, n, 0, None, None))
            else:
                q_pos = torch.arange(start, start + n, device=self.device).unsqueeze(1)
                mask = torch.arange(start + n, device=self.device).unsqueeze(0) <= q_pos
                prefills.append(PrefillSeq(first, n, start, ctx, mask))

        decode_slots = decode_bias = None
        if decode_ctx:
            lens = torch.tensor([len(c) for c in decode_ctx], device=self.device)
            decode_slots = torch.nn.utils.rnn.pad_sequence(decode_ctx, batch_first=True)
            pad = torch.arange(decode_slots.shape[1], device=self.device) >= lens.unsqueeze(1)
            dtype = self.kv_caches[0][0].dtype
            decode_bias = torch.zeros(pad.shape, dtype=dtype, device=self.device)
            decode_bias = decode_bias.masked_fill(pad, float("-inf"))[:, None, None, :]
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slot_parts),
            num_decodes=len(decode_ctx),
            decode_slots=decode_slots,
            decode_bias=decode_bias,
            prefills=prefills,
        )
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        return as_tensor(ids), as_tensor(pos), meta, as_tensor(sample_rows)
