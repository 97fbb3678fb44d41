"""Turns a scheduled `Batch` into tensors, runs one forward over all its tokens, samples.

This is the only engine module that builds tensors from the scheduler's lists. A step's inputs
are built once as host lists (`engine.runner.step_inputs`: decodes first, then prefill chunks); the
eager forward uploads them, and on CUDA a decode-only step, or one sequence's short last chunk,
copies them into a captured graph's static buffers instead (`engine.runner.cuda_graphs`); other
steps
of up to `PIECEWISE_MAX_TOKENS` tokens replay graphs of the layers between their attentions
(`engine.runner.piecewise_graphs`). Every upload goes through pinned memory without waiting
(`kernels.upload`), so the one host sync of a step is reading the sampled tokens.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from engine.config import ResolvedConfig
from engine.core.request import Request
from engine.core.scheduler import Batch, ScheduledSeq
from engine.kv.host import HostKVPool
from engine.parallel.collectives import Forward, TPGroup
from engine.runner.cuda_graphs import EXTEND_ROWS, DecodeGraphs, ExtendGraphs
from engine.runner.models.llama import LlamaForCausalLM
from engine.runner.piecewise_graphs import PiecewiseGraphs
from engine.runner.step_inputs import StepInputs
from engine.runner.verify_graphs import VerifyFed, VerifyGraphs, verify_forward
from engine.sampling.sampler import Drawn, Sampler, SampleResult
from engine.sampling.structured import GrammarStage
from kernels.attention import AttentionMetadata
from kernels.upload import upload
from lora.layers import LoraContext, wrap_model
from lora.slots import LoraSlots

EXTEND_GRAPH_TOKENS = 256  # chunks up to this long replay a graph when alone in their step
# Mixed steps up to this many tokens replay piecewise graphs (engine/runner/piecewise_graphs.py);
# longer ones spend far more GPU time computing than host time launching (H100, 8B model:
# ~45 ms against ~14 ms at 2048 tokens).
PIECEWISE_MAX_TOKENS = 2048


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_pages: int,
        page_size: int,
        seed: int = 0,
        grammar: GrammarStage | None = None,
        lora: LoraContext | None = None,
        cuda_graph_max_batch: int = 0,
        max_model_len: int | None = None,
        eos_token_ids: list[int] | None = None,
        host_kv_pages: int = 0,
        tp: TPGroup | None = None,
        verify_queries: int = 0,
        piecewise_max_tokens: int = PIECEWISE_MAX_TOKENS,
        kv_dtype: torch.dtype | None = None,
    ):
        """`cuda_graph_max_batch > 0` on a CUDA model captures decode graphs for batches up to
        that size and contexts up to `max_model_len` (default: the whole pool).
        `eos_token_ids` (default: the model config's) are banned until a request's
        `min_tokens`. `host_kv_pages > 0` adds the prefix cache's host tier (`host_kv`).
        With `tp` (tensor parallelism), rank 0's runner sends each forward's inputs to the
        other ranks' runners (`engine.parallel.collectives`), which run the same `forward`.
        `verify_queries` (1 + the engine's draft tokens; 0: it does not speculate) sizes the
        graphs of speculative steps of several sequences. `piecewise_max_tokens` (the scheduler's
        token budget; 0: none) sizes the piecewise graphs of mixed steps. `kv_dtype`: the KV
        pool's (default: the model's; float8_e4m3fn: FP8 with the attention layers' per-head
        `kv_scales`)."""
        self.model = model
        self.tp = tp
        self.grammar = grammar
        self.lora = lora  # set when the model's projections are LoRA-wrapped
        self.page_size = page_size
        cfg = model.local_cfg  # this rank's KV heads
        w = model.embed_tokens.weight
        # One spare page past the pool: padded graph rows write their K/V there.
        self.pad_page = num_pages
        shape = ((num_pages + 1) * page_size, cfg.num_kv_heads, cfg.head_dim)
        # Zeros, not empty: the CPU path reads padded slots (with zero weight); keep them finite.
        # One tensor for every layer's K and V, so the host tier moves a page in one kernel.
        self.kv_pool = torch.zeros((cfg.num_layers, 2, *shape), dtype=kv_dtype or w.dtype,
                                   device=w.device)
        self.kv_caches = [(self.kv_pool[i, 0], self.kv_pool[i, 1]) for i in range(cfg.num_layers)]
        self.device = w.device
        # The prefix cache's host tier: forwards, and the graphs captured below, wait for its
        # loads layer by layer (`HostKVPool.layers`).
        self.host_kv = HostKVPool(self.kv_pool, host_kv_pages, page_size) if host_kv_pages else None
        layers = (self.kv_caches if self.host_kv is None
                  else self.host_kv.graph_layers(self.kv_caches))
        eos = cfg.eos_token_ids if eos_token_ids is None else eos_token_ids
        self.sampler = Sampler(seed, eos)
        self.graphs: DecodeGraphs | None = None
        self.extend_graphs: ExtendGraphs | None = None
        self.verify_graphs: VerifyGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        max_pages = min(-(-(max_model_len or num_pages * page_size) // page_size), num_pages)
        self.max_context = max_pages * page_size  # positions a sequence's page table covers
        if cuda_graph_max_batch > 0 and self.device.type == "cuda":
            self.graphs = DecodeGraphs(
                model, layers, page_size, self.pad_page, cuda_graph_max_batch,
                max_pages, lora,
            )
            self.graphs.capture()
            self.extend_graphs = ExtendGraphs(
                model, layers, page_size, self.pad_page, EXTEND_GRAPH_TOKENS, max_pages,
                lora,
            )
            self.extend_graphs.capture()
            if cuda_graph_max_batch >= 2 and verify_queries > 1:
                self.verify_graphs = VerifyGraphs(
                    model, layers, page_size, self.pad_page, cuda_graph_max_batch, max_pages,
                    lora, verify_queries,
                )
                self.verify_graphs.capture()
            if piecewise_max_tokens > 0:
                self.piecewise = PiecewiseGraphs(
                    model, self.kv_caches, self.pad_page * page_size,
                    min(piecewise_max_tokens, PIECEWISE_MAX_TOKENS), cuda_graph_max_batch, lora,
                    self.host_kv.layer_ready if self.host_kv is not None else None,
                )
                self.piecewise.capture()

    def close(self) -> None:
        """Free the CUDA graphs. Under tensor parallelism this comes before the group is
        destroyed: NCCL waits, in destroying a communicator, for every graph that captured
        its collectives to be freed."""
        for graphs in (self.graphs, self.extend_graphs, self.verify_graphs, self.piecewise):
            if graphs is not None:
                graphs.release()
        self.graphs = self.extend_graphs = self.verify_graphs = self.piecewise = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def run(self, batch: Batch) -> list[tuple[Request, SampleResult]]:
        """One forward for the whole batch, sampled and read back: a (request, sample) pair for
        each seq with `samples`, in the batch's order.

        A row that cannot be sampled (non-finite logits, or its grammar failed to fill its
        mask) gets a `SampleResult` with `error` set instead of a token; the other rows are
        sampled as if it were not there.
        """
        reqs = [s.request for s in sorted(batch.seqs, key=self._layout) if s.samples]
        masks = self.grammar.start_fill(reqs) if self.grammar else None  # overlaps the forward
        step = self.launch(batch)
        self.sample(step, reqs, masks)
        by_req = dict(self.collect(step))
        return [(s.request, by_req[s.request]) for s in batch.seqs if s.samples]

    @torch.inference_mode()
    def launch(self, batch: Batch, after: Step | None = None) -> Step:
        """Queue the batch's forward. With `after`, a step still in flight whose draw is queued,
        the batch's decodes are of the tokens that step draws: they feed in on the device,
        before the host has seen them (the overlapped schedule, engine/core/steps.py `OverlapStep`);
        its prompts, if any, are known on the host."""
        seqs = sorted(batch.seqs, key=self._layout)
        inputs = StepInputs.build(seqs, self.page_size)
        input_ids = None if after is None else self._fed_ids(seqs, inputs, after)
        logits = self.forward(inputs, input_ids)
        rows = [s.request for s in seqs for _ in range(s.num_drawn)]
        return Step(batch, rows, logits)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The logits of `inputs`' sampling rows (`input_ids`: the ids on the device, else
        read from `inputs`): a CUDA graph's replay when one fits, else the piecewise graphs'
        when they fit, else the eager forward."""
        if self.tp is not None and self.tp.rank == 0:  # the other ranks run it beside us
            self.tp.send(Forward(inputs, 0 if input_ids is None else len(input_ids)))
            if input_ids is not None:
                self.tp.broadcast(input_ids)
        graph_ok = self.host_kv is None or self.host_kv.graph_ok()
        logits = self._graph_logits(inputs, input_ids) if graph_ok else None
        if logits is not None:
            return logits
        ids, positions, meta, sample_rows = self._prepare(inputs)
        if input_ids is not None:
            ids = input_ids
        pieces = self.piecewise
        if graph_ok and pieces is not None and pieces.fits(len(inputs.input_ids)):
            token_slots = None  # each token's adapter slot, when some token has one
            if any(s >= 0 for s in inputs.lora_slots):
                token_slots = [slot for slot, n in zip(inputs.lora_slots, inputs.num_new_tokens,
                                                       strict=True) for _ in range(n)]
            hidden = pieces.run(ids, positions, meta, token_slots)
        else:
            kv = self.kv_caches if self.host_kv is None else self.host_kv.layers(self.kv_caches)
            if self.lora is not None:
                self.lora.begin_step(inputs.lora_slots, inputs.num_new_tokens)
            hidden = self.model(ids, positions, kv, meta)
        return self.model.compute_logits(hidden[sample_rows])

    @torch.inference_mode()
    def verify(self, fed: VerifyFed) -> torch.Tensor:
        """The fp32 logits [S * q, vocab] of every position of a verify step built on the
        device (the overlapped speculative loop): a verify graph's replay when one fits, else
        the eager forward of the same layout."""
        s, q = len(fed.lora_slots), len(fed.input_ids) // len(fed.lora_slots)
        graphs = self.verify_graphs
        if graphs is not None and s <= graphs.sizes[-1] and (
                self.host_kv is None or self.host_kv.graph_ok()):
            return graphs.run_fed(fed)
        kv = self.kv_caches if self.host_kv is None else self.host_kv.layers(self.kv_caches)
        if self.lora is not None:
            self.lora.begin_step(fed.lora_slots, [q] * s)
        d = {"input_ids": fed.input_ids, "positions": fed.positions,
             "slot_mapping": fed.slot_mapping, "lens": fed.lens, "tables": fed.tables,
             "sample_rows": torch.arange(s * q, device=self.device)}
        starts = torch.arange(0, (s + 1) * q, q, dtype=torch.int32, device=self.device)
        return verify_forward(self.model, kv, d, s, q, self.page_size, starts)

    @torch.inference_mode()
    def sample(
        self,
        step: Step,
        reqs: list[Request],
        masks: Future | None = None,
        offsets: list[int] | None = None,
        positions: torch.Tensor | None = None,
    ) -> None:
        """Queue the draw of `reqs`, the step's sampling rows still wanted (in row order), after
        their grammar masks (`masks`: filled already; None fills them now). `offsets`: the
        rows' positions past their request's last token; `positions`: their indices in their
        request's output, on the device, when the host does not know them (`Sampler.launch`)."""
        logits = step.logits
        if reqs != step.rows:
            wanted = set(reqs)
            keep = [i for i, r in enumerate(step.rows) if r in wanted]
            logits = logits[upload([keep], torch.long, self.device)[0]]
        if masks is None and self.grammar is not None:
            drafts = {s.request: (s.draft, s.num_forced) for s in step.batch.seqs if s.draft}
            masks = self.grammar.start_fill(reqs, drafts)
        finite = torch.isfinite(logits).all(dim=1)  # (N,): comes back with the sampled tokens
        # The sampler computes on finite numbers only; the rows that had others are dropped.
        logits.nan_to_num_(0.0, 0.0, 0.0)
        step.grammar_errors = GrammarStage.apply(logits, masks)
        step.drawn = self.sampler.launch(logits, reqs, ok=finite, offsets=offsets,
                                         positions=positions)

    def collect(self, step: Step) -> list[tuple[Request, SampleResult]]:
        """Wait for the step's drawn tokens (its one sync): (request, sample) per drawn row."""
        if step.drawn is None:
            return []
        reqs = step.drawn.reqs
        samples = self.sampler.collect(step.drawn)
        for row, sample in enumerate(samples):
            if sample.token_id < 0:
                samples[row] = SampleResult(-1, error=_non_finite_error(reqs[row]))
        for row, why in step.grammar_errors.items():
            samples[row] = SampleResult(-1, error=why)
        return list(zip(reqs, samples, strict=True))

    def _fed_ids(self, seqs: list[ScheduledSeq], inputs: StepInputs, after: Step) -> torch.Tensor:
        """The step's input ids on the device, where the seqs that decode a token `after`
        draws (the step in flight) read it from that draw."""
        assert after.drawn is not None, "launch(after=step) needs the step's draw queued"
        drawn = after.drawn.tokens.clamp(min=0)  # a failed row drew -1; its request ends
        rows = {r: i for i, r in enumerate(after.drawn.reqs)}
        # Decodes come first, one input each: a fed seq's index is its input's position.
        at = [k for k, s in enumerate(seqs) if s.request in rows]
        src = [rows[seqs[k].request] for k in at]
        if len(at) == len(inputs.input_ids):  # decodes of drawn tokens only
            if src == list(range(len(drawn))):
                return drawn
            return drawn[upload([src], torch.long, self.device)[0]]
        ids, at_t, src_t = upload([inputs.input_ids, at, src], torch.long, self.device)
        return ids.index_copy(0, at_t, drawn[src_t])

    def _layout(self, s: ScheduledSeq) -> tuple[bool, int]:
        """Decodes first; within them, one run per adapter slot (SGMV segments, not BGMV)."""
        return s.num_new_tokens != 1, s.request.lora_slot

    def _graph_logits(
        self, inputs: StepInputs, input_ids: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Logits of a decode-only step, of one sequence's short last chunk, or of a few
        sequences' short chunks (a speculative step's drafted decodes), from a CUDA graph;
        None when no graph fits the step.
        `input_ids`: the decodes' tokens on the device (else they are read from `inputs`)."""
        if self.graphs is None:
            return None
        num_seqs, sampled = len(inputs.tables), len(inputs.sample_rows)
        if inputs.num_decodes != num_seqs:  # some seq computes several tokens
            verify = self.verify_graphs
            if input_ids is None and verify is not None and _ends_sampled(inputs) and \
                    verify.fits(inputs):
                return verify.run(inputs)
        if num_seqs == 1 and inputs.num_new_tokens[0] > 1:
            n, extend = inputs.num_new_tokens[0], self.extend_graphs
            if not 1 <= sampled <= EXTEND_ROWS or extend is None or not extend.fits(
                    n, inputs.context_lens[0]):
                return None
            return extend.run(inputs)
        if inputs.num_decodes != num_seqs:
            return None
        if sampled != num_seqs:  # not every seq a sampled decode
            return None
        if not self.graphs.fits(num_seqs, max(inputs.context_lens)):
            return None
        return self.graphs.run(inputs, input_ids)

    def _prepare(
        self, x: StepInputs
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Input ids, positions, attention metadata and the sampled rows of an eager step."""
        nd, num_prefills = x.num_decodes, len(x.tables) - x.num_decodes
        ids, positions, slots, sample_rows = upload(
            [x.input_ids, x.positions, x.slot_mapping, x.sample_rows], torch.long, self.device
        )
        dt, dl, pt, qs, pl = upload(
            [flat_tables(x.tables[:nd]), x.context_lens[:nd], flat_tables(x.tables[nd:]),
             x.query_start, x.context_lens[nd:]],
            torch.int32,
            self.device,
        )
        meta = AttentionMetadata(
            slot_mapping=slots,
            page_size=self.page_size,
            num_decodes=nd,
            decode_tables=dt.view(nd, -1) if nd else dt,
            decode_lens=dl,
            prefill_tables=pt.view(num_prefills, -1) if num_prefills else pt,
            prefill_query_start=qs,
            prefill_lens=pl,
            max_prefill_len=x.max_prefill_len,
        )
        return ids, positions, meta, sample_rows


@dataclass
class Step:
    """A launched forward: its logits are queued on the device; `ModelRunner.sample` queues the
    draw and `collect` reads it back."""

    batch: Batch
    # The requests whose last position has a row of `logits`, in order (a speculative
    # decode's request once per position: `ScheduledSeq.draft`).
    rows: list[Request]
    logits: torch.Tensor  # (len(rows), vocab) fp32
    drawn: Drawn | None = None
    grammar_errors: dict[int, str] = field(default_factory=dict)  # drawn row -> why


def _ends_sampled(inputs: StepInputs) -> bool:
    """Every sequence of the step is sampled at its last token (none is a prompt mid-way)."""
    rows = set(inputs.sample_rows)
    return all(end - 1 in rows for end in itertools.accumulate(inputs.num_new_tokens))


def flat_tables(tables: list[list[int]]) -> list[int]:
    """Rows padded with page 0 to one width (past each row's context: masked out), flattened."""
    width = max((len(t) for t in tables), default=0)
    flat: list[int] = []
    for t in tables:
        flat.extend(t)
        flat.extend([0] * (width - len(t)))
    return flat


def _non_finite_error(req: Request) -> str:
    """Why a row of NaN or Inf logits fails its request (e.g. a LoRA adapter whose weights
    overflow)."""
    adapter = req.params.adapter
    return "the model produced non-finite logits (NaN or Inf) for this request" + (
        f" under LoRA adapter {adapter!r}; its weights may overflow" if adapter else ""
    )


def build_runner(model: LlamaForCausalLM, cfg: ResolvedConfig, eos_token_ids: list[int],
                 slots: LoraSlots | None, tp: TPGroup | None = None,
                 grammar: GrammarStage | None = None) -> ModelRunner:
    """The model runner `cfg` asks for, built the same way by rank 0 (which passes its grammar
    stage) and by every tensor-parallel worker: their graphs, and so the collectives inside
    them, must match."""
    if tp is not None:
        tp.enable_one_shot(model.embed_tokens.weight.dtype, model.cfg.hidden_size)
    return ModelRunner(
        model, cfg.num_pages, cfg.page_size, cfg.seed, grammar=grammar,
        lora=wrap_model(model, slots) if slots else None,
        cuda_graph_max_batch=cfg.max_num_seqs if cfg.cuda_graphs else 0,
        max_model_len=cfg.max_model_len, eos_token_ids=eos_token_ids,
        host_kv_pages=cfg.host_kv_pages if cfg.prefix_cache else 0, tp=tp,
        verify_queries=1 + cfg.num_speculative_tokens if cfg.num_speculative_tokens else 0,
        piecewise_max_tokens=cfg.max_num_batched_tokens if cfg.piecewise_graphs else 0,
        kv_dtype=getattr(torch, cfg.kv_dtype),
    )
