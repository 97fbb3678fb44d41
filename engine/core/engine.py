"""The engine step: schedule -> run -> postprocess (`LLMEngine.step`).

On CUDA the steps overlap (`EngineConfig.overlap_schedule`; `LLMEngine._overlap_step`): step
N+1's forward is queued on the device, fed by step N's tokens there, before the host reads step
N's tokens and postprocesses them, so the host's work per step hides behind the device's
(SGLang's overlap scheduler). Requests that step N ends ran one token too far in step N+1; that
row is dropped. Requests that start while the loop runs are prefilled in it when their whole
prompt fits one step; one that needs chunks hands back to the regular schedule.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from concurrent.futures import FIRST_COMPLETED, wait
from typing import cast

import torch

from engine.config import EngineConfig, ModelConfig, ModelLoadError, ResolvedConfig
from engine.core.detokenizer import Decoder
from engine.core.output_processor import OutputProcessor
from engine.core.reasoning import ReasoningFormat
from engine.core.request import Request
from engine.core.scheduler import Batch, ScheduledSeq, Scheduler
from engine.kv.disk import DiskKV, fingerprint
from engine.kv.page_allocator import PageAllocator
from engine.kv.prefix_cache import PrefixCache
from engine.messages import RequestOutput
from engine.parallel.collectives import SentSlots, rank_fingerprint
from engine.parallel.partition import Partition
from engine.parallel.workers import Workers
from engine.runner.loader import load_model, resolve_model_dir
from engine.runner.model_runner import Step, build_runner
from engine.sampling.params import InvalidRequestError, SamplingParams, check_request
from engine.sampling.sampler import SampleResult
from engine.sampling.structured import GrammarStage
from engine.spec.loop import DraftLoop, LoopStep
from engine.spec.speculative import CPU_MAX_BATCH, MAX_BATCH, DeviceDrafter, Speculator
from kernels import spec_decode
from lora.manager import AdapterManager, UnknownAdapter
from lora.slots import LoraSlots

log = logging.getLogger(__name__)

# How a step ran (`LLMEngine.step_times`): in the overlapped loop (queued behind the step in
# flight), synchronously (prefill and admission steps, a request mid-chunk, CPU engines), or
# carrying speculative drafts (synchronous too).
STEP_KINDS = ("overlapped", "synchronous", "speculative")


class AdapterAdmission:
    """The scheduler's adapter predicate (`engine.core.scheduler.Admission`) over the manager's
    leases: a base request may start; one with an adapter once its slot is pinned."""

    def __init__(self, manager: AdapterManager):
        self.manager = manager

    def can_admit(self, req: Request) -> bool:
        return req.lora is None or self.manager.admit(req.lora)


class LLMEngine:
    def __init__(self, cfg: EngineConfig):
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        elif cfg.tensor_parallel_size > 1 and cfg.device == "cpu":  # the ranks share the cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.tensor_parallel_size))
        dtype = getattr(torch, cfg.dtype)  # the config's dtype names are torch's
        self.model_dir = resolve_model_dir(cfg.model, cfg.cache_dir)
        # Tensor parallelism: the workers load their shards while this process loads rank 0's.
        self.workers = Workers(cfg, self.model_dir) if cfg.tensor_parallel_size > 1 else None
        try:
            self._load(cfg, dtype)
        except BaseException:
            self.close()
            raise

    def _load(self, cfg: EngineConfig, dtype: torch.dtype) -> None:
        from transformers import AutoTokenizer

        tp = self.workers.tp if self.workers else None
        part = None
        if tp is not None:
            part = Partition.of(ModelConfig.from_dir(self.model_dir), 0, tp.size)
        self.model = load_model(self.model_dir, dtype, cfg.device, part, tp)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot load the tokenizer from {self.model_dir}: {e}") from e
        mc = self.model_config = self.model.cfg
        device = self.model.embed_tokens.weight.device
        # The KV pool's pages are sized by the rank holding the most KV heads.
        kv_heads = (mc.num_kv_heads if tp is None else
                    max(Partition.of(mc, r, tp.size).local(mc).num_kv_heads
                        for r in range(tp.size)))
        cfg = self.cfg = cfg.resolve(dataclasses.replace(mc, num_kv_heads=kv_heads),
                                     device.type)  # from here on, no "auto" settings
        self.max_model_len = cfg.max_model_len
        self.overlap = cfg.overlap_schedule
        self.speculator = (Speculator(cfg.num_speculative_tokens, max_batch=MAX_BATCH
                                      if device.type == "cuda" else CPU_MAX_BATCH)
                           if cfg.num_speculative_tokens else None)
        self.eos_token_ids = set(mc.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        if self.workers is not None:
            self.workers.agree(cfg, sorted(self.eos_token_ids),
                               rank_fingerprint(mc, self.model_dir, self.model))
        self.decoder = Decoder(self.tokenizer)  # shared by the requests' detokenizers
        self.reasoning_format = ReasoningFormat.for_tokenizer(self.tokenizer,
                                                              cfg.reasoning_parser)

        self.allocator = PageAllocator(cfg.num_pages)
        self.grammar = GrammarStage(self.tokenizer, mc.vocab_size, sorted(self.eos_token_ids))
        slots: LoraSlots | None = None
        if cfg.max_loras and tp is not None and part is not None:
            slots = SentSlots(self.model.local_cfg, cfg.max_loras, cfg.max_lora_rank, dtype,
                              device, part.cut_lora, tp=tp)
        elif cfg.max_loras:
            slots = LoraSlots(mc, cfg.max_loras, cfg.max_lora_rank, dtype, device)
        self.adapters = AdapterManager(mc, slots, cfg.max_cpu_loras, cfg.adapter_dir, dtype)
        self.runner = build_runner(self.model, cfg, sorted(self.eos_token_ids), slots, tp,
                                   self.grammar)
        if self.speculator is not None and self.overlap:
            # The overlapped speculative loop's kernels compile now, not in its first step.
            spec_decode.warm_up(device, self.speculator.k, cfg.page_size)
        self.prefix_cache = PrefixCache(self.allocator, cfg.page_size, cfg.prefix_cache,
                                        cfg.session_kv_pages, self.runner.host_kv,
                                        self._disk_tier(cfg, dtype))
        self.scheduler = Scheduler(
            self.allocator,
            cfg.page_size,
            cfg.max_num_seqs,
            cfg.max_num_batched_tokens,
            adapters=AdapterAdmission(self.adapters),
            is_ready=self.grammar.is_ready,
            cache=self.prefix_cache,
        )
        self._requests: dict[str, Request] = {}
        self.out = OutputProcessor(self.scheduler, self.grammar, self.adapters, self.runner,
                                   lambda: self.speculator, self._requests, self.eos_token_ids,
                                   self.max_model_len, self.decoder, self.reasoning_format,
                                   self.tokenizer)
        self._ahead: Step | None = None  # the overlapped decode step in flight
        # The overlapped speculative loop (engine/spec/loop.py): its sequences on the device,
        # and its step in flight.
        self._loop: DraftLoop | None = None
        self._loop_ahead: LoopStep | None = None
        # Per kind of step: how many ran and their wall seconds (`step`'s, device waits
        # included), for /metrics: an overlapped step costs the device's time, a synchronous
        # one the device's plus the host's.
        self.step_times: dict[str, list[float]] = {k: [0, 0.0] for k in STEP_KINDS}
        self._kind: str | None = None  # the running step's, set by `_step`

    def _disk_tier(self, cfg: ResolvedConfig, dtype: torch.dtype) -> DiskKV | None:
        if cfg.kv_disk_dir is None or self.runner.host_kv is None:
            return None
        mc = self.model_config
        shape = (mc.num_layers, 2, cfg.page_size, mc.num_kv_heads, mc.head_dim)
        model = {**dataclasses.asdict(mc), "path": str(self.model_dir)}
        cap = int(cfg.kv_disk_gb * 2**30) if cfg.kv_disk_gb else None
        per_tenant = int(cfg.kv_disk_tenant_gb * 2**30)
        return DiskKV(cfg.kv_disk_dir, fingerprint(model, cfg.dtype, shape), shape, dtype, cap,
                      per_tenant)

    # -- requests -------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise `InvalidRequestError` for a request that must not enter the batch."""
        check_request(prompt_token_ids, params, self.model_config.vocab_size,
                      self.max_model_len)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tenant: str = "default",
        session_id: str | None = None,
    ) -> Request:
        if request_id in self._requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        self.validate(prompt_token_ids, params)
        req = Request(request_id, list(prompt_token_ids), params, tenant, session_id=session_id)
        if params.adapter is not None:
            try:
                req.lora = self.adapters.attach(tenant, params.adapter)
            except UnknownAdapter:
                raise InvalidRequestError(f"unknown adapter {params.adapter!r}",
                                          "model") from None
            req.adapter_uid = req.lora.uid
        req.output_state = self.out.output_stage(req)
        self.grammar.submit(req)
        self._requests[request_id] = req
        self.scheduler.add(req)
        return req

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self._requests.get(request_id)
        if req is None:
            return None
        self.out.finish(req, "abort")
        return self.out.output(req, [], None)

    def release_session(self, session_id: str) -> None:
        """A session ended: its KV stays cached but is no longer pinned."""
        self.prefix_cache.release_session(session_id)

    def reset_prefix_cache(self) -> int:
        """Drop every cached page (between runs; raises while requests run)."""
        return self.prefix_cache.reset()

    @property
    def fatal_error(self) -> str | None:
        """Why the engine cannot step any more (a tensor-parallel rank died), else None."""
        return self.workers.dead() if self.workers is not None else None

    def close(self) -> None:
        """Stop the tensor-parallel workers; the engine cannot step afterwards."""
        workers = getattr(self, "workers", None)  # None too if __init__ failed before it
        if workers is not None:
            workers.close()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """schedule -> run -> postprocess. With `overlap` on, a batch whose every seq samples
        (no prompt left mid-chunk) starts the overlapped loop instead (`_overlap_step`).
        Raises `RankDied` once a tensor-parallel worker has exited."""
        start, self._kind = time.perf_counter(), None
        try:
            if self.workers is None:
                return self._step()
            with self.workers.running():
                return self._step()
        finally:
            if self._kind is not None:  # a step that ran a batch
                times = self.step_times[self._kind]
                times[0] += 1
                times[1] += time.perf_counter() - start

    def _step(self) -> list[RequestOutput]:
        failed = [self.out.fail(req, why) for req, why in self._not_startable()]
        if self._loop_ahead is not None:
            self._kind = "speculative"
            return failed + self._loop_step(self._loop_ahead)
        if self._ahead is not None:
            self._kind = "overlapped"
            return failed + self._overlap_step(self._ahead)
        batch = self.scheduler.schedule()
        failed += [self.out.fail(req, why) for req, why in batch.failed]
        if not batch:
            if not failed:
                self._wait_for_background(0.05)
            return failed
        looped = self._start_loop(batch) if self._loops(batch) else None
        if looped is not None:
            self._kind = "speculative"
            return failed + self._loop_step(looped)
        if self.speculator is not None and self.speculator.attach(
            batch, self.out.tokens_left, self.scheduler.add_draft,
            self.scheduler.max_num_batched_tokens, self.grammar,
        ):
            self._kind = "speculative"
            return failed + self._speculate(batch)
        if self.overlap and batch.all_sample:
            self._kind = "overlapped"
            first = self.runner.launch(batch)
            self.runner.sample(first, first.rows)
            return failed + self._overlap_step(first)
        self._kind = "synchronous"
        return failed + self.out.postprocess(batch, self.runner.run(batch))

    def _overlap_step(self, prev: Step) -> list[RequestOutput]:
        """One step of the overlapped loop. `prev` (step N) is in flight, its draw queued: queue
        step N+1's decodes behind it, fed by N's tokens on the device; postprocess N while the
        device computes; then queue N+1's draw (its grammar masks need N's tokens accepted).
        N+1 may also prefill requests that start now. Ends (nothing left ahead) when no request
        decodes on or starts, or when one must start in chunks."""
        self._ahead = None  # until N+1 is queued: if this raises, nothing stays in flight
        nxt = self._next_step(prev)
        failed = [self.out.fail(req, why) for req, why in nxt.failed] if nxt else []
        ahead = self.runner.launch(nxt, after=prev) if nxt else None
        # N+1 decodes N's sampled token: no forced (jump-forward) tokens may follow it.
        outputs = failed + self.out.postprocess(
            prev.batch, self.runner.collect(prev), jump_forward=False)
        if ahead is not None:
            alive = [r for r in ahead.rows if not r.finished]
            if alive:
                self.runner.sample(ahead, alive)
                self._ahead = ahead
        return outputs

    def _next_step(self, prev: Step) -> Batch | None:
        """The step that follows `prev`: its requests that its tokens cannot end by length
        decode on, and waiting requests whose whole prompt fits start beside them (their
        prefill overlaps too). None when the regular schedule must decide."""
        assert prev.drawn is not None, "an overlapped step's draw is queued at launch"
        reqs = [r for r in prev.drawn.reqs if not r.finished and self.out.tokens_left(r) > 1]
        spec = self.speculator
        if spec is not None and spec.wants(len(reqs)) and any(map(spec.may_draft, reqs)):
            return None  # the regular schedule attaches drafts
        return self.scheduler.schedule_ahead(reqs)

    def _speculate(self, batch: Batch) -> list[RequestOutput]:
        """A step whose decodes carry drafts (engine/spec/speculative.py), run synchronously: every
        position of a drafted decode is drawn; its accepted drafts and the token drawn after
        them are appended, each through the stop checks, and its KV is kept up to them. The
        seqs without drafts go through `postprocess`."""
        step = self.runner.launch(batch)
        seq_of = {s.request: s for s in batch.seqs}
        offsets, prev = [], None
        for req in step.rows:  # a drafted decode's rows are consecutive, one per drawn position
            offsets.append(offsets[-1] + 1 if req is prev else seq_of[req].num_forced)
            prev = req
        self.runner.sample(step, step.rows, offsets=offsets)
        plain: list[tuple[Request, SampleResult]] = []
        drafted: dict[Request, list[SampleResult]] = {}
        for req, result in self.runner.collect(step):
            if seq_of[req].draft:
                drafted.setdefault(req, []).append(result)
            else:
                plain.append((req, result))
        outputs = self.out.postprocess(Batch([s for s in batch.seqs if not s.draft]), plain)
        for req, results in drafted.items():
            outputs.append(self._advance_drafted(seq_of[req], results))
        return outputs

    # -- the overlapped speculative loop (engine/spec/loop.py) ---------------------------

    def _loops(self, batch: Batch) -> bool:
        """Does this batch start the overlapped speculative loop? Decodes only (overlapped
        steps, on one device), few enough to speculate, each free to loop, one still
        drafting."""
        spec = self.speculator
        if spec is None or not self.overlap or self.workers is not None or not hasattr(
                spec.drafter, "propose_on_device"):
            return False
        reqs = [s.request for s in batch.seqs]
        return (all(s.num_new_tokens == 1 and s.samples for s in batch.seqs)
                and spec.wants(len(reqs)) and all(map(spec.loops, reqs))
                and any(map(spec.may_draft, reqs)))

    def _start_loop(self, batch: Batch) -> LoopStep | None:
        """The loop's first step, queued; None when a request has no room for it (the batch
        then runs as the regular schedule would)."""
        assert self.speculator is not None
        # One run per adapter slot (SGMV segments), as `ModelRunner._layout` orders decodes.
        reqs = sorted((s.request for s in batch.seqs), key=lambda r: r.lora_slot)
        drafter = cast(DeviceDrafter, self.speculator.drafter)
        self._loop = DraftLoop(reqs, self.speculator.k, drafter, self.runner.device)
        first = self._loop_launch(reqs, in_flight=False)
        if first is None:
            self._loop = None
        return first

    def _loop_step(self, prev: LoopStep) -> list[RequestOutput]:
        """One step of the loop: queue the next step of `prev`'s requests still running, then
        read `prev`'s draws and advance its requests while the device computes. The loop ends
        (nothing queued; the regular schedule decides next) when no request is left, a waiting
        one could start, none still drafts, or one has no room."""
        self._loop_ahead = None  # until the next step is queued
        reqs = [r for r in prev.reqs if not r.finished]
        nxt = self._loop_launch(reqs, in_flight=True) if self._loop_goes_on(reqs) else None
        outputs = self._loop_collect(prev)
        self._loop_ahead = nxt
        if nxt is None:
            self._loop = None
        return outputs

    def _loop_goes_on(self, reqs: list[Request]) -> bool:
        if self.speculator is None:  # turned off (tests and benchmarks swap it)
            return False
        sched = self.scheduler
        if len(sched.running) < sched.max_num_seqs and any(
                map(sched.is_ready, sched.waiting)):
            return False  # the regular schedule admits it
        return any(map(self.speculator.may_draft, reqs))

    def _loop_launch(self, reqs: list[Request], in_flight: bool) -> LoopStep | None:
        """Reserve what the step's positions may reach and queue it; None when a request has
        no room (pages, its row on the device, its page table)."""
        loop = self._loop
        assert loop is not None and self.speculator is not None
        q = self.speculator.k + 1
        # The device may be 1 + k tokens past the host (`in_flight`); the step computes the
        # last token and k drafts after it.
        extra = 2 * q - 1 if in_flight else q - 1
        for req in reqs:
            need = req.num_tokens + extra
            if need > self.runner.max_context or not loop.room(req, in_flight):
                return None
            if not self.scheduler.reserve(req, need):
                return None
        return loop.launch(self.runner, reqs)

    def _loop_collect(self, step: LoopStep) -> list[RequestOutput]:
        """Read the step's draws and drafts; advance each request still running by its
        accepted drafts and the token after them, through the stop checks."""
        q = len(step.step.rows) // max(len(step.reqs), 1)
        results = self.runner.collect(step.step)
        drafts = step.drafts.tolist()
        outputs = []
        for i, req in enumerate(step.reqs):
            if req.finished:  # ended while the step was in flight
                continue
            row = [r for _, r in results[i * q : (i + 1) * q]]
            error = next((r.error for r in row if r.error is not None), None)
            if error is not None:  # its row on the device went on with a wrong token
                outputs.append(self.out.fail(req, error))
                continue
            seq = ScheduledSeq(req, req.num_tokens - 1, q)
            *seq.draft, looked = drafts[i]
            appended = 1 + sum(1 for _ in itertools.takewhile(
                lambda pair: pair[0] == pair[1].token_id, zip(seq.draft, row[:-1], strict=True)))
            before = req.num_tokens
            outputs.append(self._advance_drafted(seq, row, looked))
            if not req.finished and req.num_tokens - before != appended:
                # The device appended what was accepted: the host must have too.
                outputs.append(self.out.fail(req, "internal error: the speculative loop's "
                                          "tokens diverged from the host's"))
        return outputs

    def _advance_drafted(self, seq: ScheduledSeq, results: list[SampleResult],
                         looked: int | None = None) -> RequestOutput:
        """Append a drafted decode's drawn tokens up to the first that differs from its draft
        (or a row that could not be sampled), each through the stop checks. `results`: the
        draws from its last forced draft on (`ScheduledSeq.num_drawn`); `looked`: as for
        `Speculator.accepted`."""
        req = seq.request
        results = [SampleResult(t) for t in seq.draft[: seq.num_forced]] + results
        good = list(itertools.takewhile(lambda r: r.error is None, results))
        if not good:
            return self.out.fail(req, results[0].error or "")
        assert self.speculator is not None, "only a speculating engine drafts"
        accepted = self.speculator.accepted(seq, [r.token_id for r in good], looked)
        new, lps = [], []
        try:
            for i, r in enumerate(good[: accepted + 1]):
                forced = i < seq.num_forced  # the grammar's token, whatever was drawn
                token = seq.draft[i] if forced else r.token_id
                req.token_ids.append(token)
                new.append(token)
                if r.logprob is not None and not forced:  # none forced with logprobs
                    lps.append(r.logprob)
                reason = self.out.check_stop(req, token)
                if reason:
                    self.out.finish(req, reason)
                    break
                # Past the forced drafts (the grammar forces those in a row), a token after
                # which the grammar forces more ends the run, as jump-forward would: the next
                # draft starts with the forced tokens, tokenized canonically.
                if seq.num_forced - 1 <= i < accepted and self._forces_next(req):
                    break
        except Exception as e:
            log.exception("request %s failed after sampling", req.request_id)
            return self.out.fail(req, f"internal error: {type(e).__name__}: {e}")
        # The KV holds the last known token and each draft equal to the token after it.
        req.num_computed_tokens = seq.start + len(new)
        return self.out.output(req, new, lps or None)

    def _forces_next(self, req: Request) -> bool:
        """Whether the request's grammar now forces tokens that jump-forward would append."""
        if req.matcher is None or req.params.logprobs is not None:
            return False
        return bool(self.grammar.forced_tokens(req, self.out.tokens_left(req)))

    def _wait_for_background(self, timeout: float) -> None:
        """Nothing could run: wait for an adapter read, a grammar compile or a KV read from
        disk to finish instead of spinning (a spinning loop steals the CPU, and the GIL, those
        need)."""
        pending = self.adapters.pending_loads()
        pending += [r.pending_grammar for r in self.scheduler.waiting if r.pending_grammar]
        pending += self.prefix_cache.pending_reads()
        if pending:
            wait(pending, timeout, return_when=FIRST_COMPLETED)

    def _not_startable(self) -> list[tuple[Request, str]]:
        """Waiting requests that can never start: their adapter failed to load, or their
        grammar failed to compile."""
        leases = dict(self.adapters.take_failed())
        failed = [(r, leases[r.lora]) for r in self._requests.values() if r.lora in leases]
        for req in self.scheduler.waiting:
            error = GrammarStage.compile_error(req)
            if error is not None:
                failed.append((req, error))
        return failed
