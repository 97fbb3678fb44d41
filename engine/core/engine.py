"""The engine: one builder for rank 0's parts (model, tokenizer, KV pool, prefix cache,
grammar stage, adapters, runner, scheduler), admission, and the step: schedule -> one of the
step modes (engine/core/steps.py, engine/spec/steps.py) -> outputs (`LLMEngine.step`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from concurrent.futures import FIRST_COMPLETED, wait
from contextlib import nullcontext

import torch

from engine.config import EngineConfig, ModelConfig, ModelLoadError, ResolvedConfig
from engine.core.detokenizer import Decoder
from engine.core.output_processor import OutputProcessor
from engine.core.reasoning import ReasoningFormat
from engine.core.request import Request
from engine.core.scheduler import Batch, Scheduler
from engine.core.steps import STEP_KINDS, OverlapStep, StepMode, StepParts, SyncStep
from engine.kv.disk import DiskKV, disk_tier
from engine.kv.page_allocator import PageAllocator
from engine.kv.prefix_cache import PrefixCache
from engine.kv.tiers import HostKV
from engine.messages import RequestOutput
from engine.parallel.collectives import SentHostKV, SentSlots, rank_fingerprint
from engine.parallel.disk import DiskPeers
from engine.parallel.partition import Partition
from engine.parallel.workers import Workers
from engine.runner.loader import load_model, resolve_model_dir
from engine.runner.model_runner import build_runner
from engine.sampling.params import InvalidRequestError, SamplingParams, check_request
from engine.sampling.structured import GrammarStage
from engine.spec.speculative import CPU_MAX_BATCH, MAX_BATCH, PromptLookup, Speculator
from engine.spec.steps import DraftLoopStep, SpeculativeStep
from engine.spec.suffix import SuffixDrafter
from kernels import spec_decode
from lora.manager import AdapterManager, UnknownAdapter
from lora.slots import LoraSlots

log = logging.getLogger(__name__)


class AdapterAdmission:
    """The scheduler's adapter predicate (`engine.core.scheduler.Admission`) over the manager's
    leases: a base request may start; one with an adapter once its slot is pinned."""

    def __init__(self, manager: AdapterManager):
        self.manager = manager

    def can_admit(self, req: Request) -> bool:
        return req.lora is None or self.manager.admit(req.lora)

    def loading(self, req: Request) -> bool:
        return req.lora is not None and self.manager.placed(req.lora) == "copying"

    def resident(self, req: Request) -> bool:
        return req.lora is not None and self.manager.placed(req.lora) == "ready"


class LLMEngine:
    def __init__(self, cfg: EngineConfig):
        self.model_dir = resolve_model_dir(cfg.model, cfg.cache_dir)
        cfg, why = cfg.settle_device(torch.cuda.is_available(),
                                     ModelConfig.from_dir(self.model_dir).dtype)
        if why:
            log.info("auto settings: %s", why)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        elif cfg.tensor_parallel_size > 1 and cfg.device == "cpu":  # the ranks share the cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.tensor_parallel_size))
        dtype = getattr(torch, cfg.dtype)  # the config's dtype names are torch's
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
        self.model = load_model(self.model_dir, dtype, cfg.device, part, tp,
                                cfg.load_quantization)
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
        memory = torch.cuda.mem_get_info(device)[::-1] if device.type == "cuda" else None
        cfg, why = cfg.resolve(dataclasses.replace(mc, num_kv_heads=kv_heads), device.type,
                               memory)  # from here on, no "auto" settings
        self.cfg = cfg
        if why:
            log.info("memory: %s", why)
        self.max_model_len = cfg.max_model_len
        self.max_num_seqs = cfg.max_num_seqs
        speculator = None
        if cfg.num_speculative_tokens:
            drafter = (SuffixDrafter(cfg.suffix_cache_tokens)
                       if cfg.speculative_method == "suffix" else PromptLookup())
            speculator = Speculator(cfg.num_speculative_tokens, drafter, max_batch=MAX_BATCH
                                    if device.type == "cuda" else CPU_MAX_BATCH)
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
        lora = (cfg.max_loras, cfg.lora_pool_rows, cfg.max_lora_rank, dtype, device)
        if cfg.max_loras and tp is not None and part is not None:
            slots = SentSlots(self.model.local_cfg, *lora, part.cut_lora, tp=tp)
        elif cfg.max_loras:
            slots = LoraSlots(mc, *lora)
        self.adapters = AdapterManager(
            mc, slots, cfg.max_cpu_loras, cfg.adapter_dir, dtype,
            None if cfg.cpu_lora_cache_gb is None else int(cfg.cpu_lora_cache_gb * 2**30))
        self.runner = build_runner(self.model, cfg, sorted(self.eos_token_ids), slots, tp,
                                   self.grammar)
        if speculator is not None and cfg.overlap_schedule:
            # The overlapped speculative loop's kernels compile now, not in its first step.
            spec_decode.warm_up(device, speculator.k, cfg.page_size)
            warm_up = getattr(speculator.drafter, "warm_up", None)
            if warm_up is not None:
                warm_up(device, speculator.k)
        host: HostKV | None = self.runner.host_kv
        if host is not None and tp is not None:
            host = SentHostKV(host, tp)  # the workers copy their heads' share of each page
        self.prefix_cache = PrefixCache(self.allocator, cfg.page_size, cfg.prefix_cache,
                                        cfg.session_kv_pages, host, self._disk_tier(cfg))
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
        self.parts = StepParts(self.scheduler, self.runner, self.out, self.grammar, speculator,
                               cfg.overlap_schedule, single_device=self.workers is None)
        # In the order they are offered a batch; the synchronous step takes any.
        self.modes: list[StepMode] = [DraftLoopStep(self.parts), SpeculativeStep(self.parts),
                                      OverlapStep(self.parts), SyncStep(self.parts)]
        self._in_flight: StepMode | None = None  # the mode whose step is on the device
        # Per kind of step: how many ran and their wall seconds (`step`'s, device waits
        # included), for /metrics: an overlapped step costs the device's time, a synchronous
        # one the device's plus the host's.
        self.step_times: dict[str, list[float]] = {k: [0, 0.0] for k in STEP_KINDS}
        self._kind: str | None = None  # the running step's, set by `_step`

    def _disk_tier(self, cfg: ResolvedConfig) -> DiskKV | None:
        host = self.runner.host_kv
        if host is None:
            return None
        size = self.workers.tp.size if self.workers else 1
        disk = disk_tier(cfg, self.model_config, self.model_dir, host.pool.shape, 0, size)
        if disk is not None and self.workers is not None:
            disk.peers = DiskPeers(self.workers.tp, self.workers.answers)
        return disk

    @property
    def speculator(self) -> Speculator | None:
        return self.parts.speculator

    @speculator.setter
    def speculator(self, speculator: Speculator | None) -> None:
        self.parts.speculator = speculator

    @property
    def overlap(self) -> bool:
        return self.parts.overlap

    @overlap.setter
    def overlap(self, on: bool) -> None:
        self.parts.overlap = on

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
        *,
        validated: bool = False,
    ) -> Request:
        """Queue a request (`validated`: the caller has run `validate` on it, as `LLM.generate`
        does for a whole call before adding any of it)."""
        if request_id in self._requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        if not validated:
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
        """Free the CUDA graphs and stop the tensor-parallel workers (each after its queued
        KV page files are written); the engine cannot step afterwards."""
        cache = getattr(self, "prefix_cache", None)
        if cache is not None and cache.tiers is not None and cache.tiers.disk is not None:
            cache.tiers.disk.flush()
        runner = getattr(self, "runner", None)  # None too if __init__ failed before it
        if runner is not None:
            runner.close()
        workers = getattr(self, "workers", None)
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
        """schedule -> run -> postprocess, in the step mode that takes the batch; a mode that
        left a step in flight runs this one. Raises `RankDied` once a tensor-parallel worker
        has exited."""
        start, self._kind = time.perf_counter(), None
        try:
            with self.workers.running() if self.workers is not None else nullcontext():
                return self._step()
        finally:
            if self._kind is not None:  # a step that ran a batch
                times = self.step_times[self._kind]
                times[0] += 1
                times[1] += time.perf_counter() - start

    def _step(self) -> list[RequestOutput]:
        failed = [self.out.fail(req, why) for req, why in self._not_startable()]
        mode, self._in_flight = self._in_flight, None  # if it raises, nothing stays in flight
        if mode is None:
            batch = self.scheduler.schedule()
            failed += [self.out.fail(req, why) for req, why in batch.failed]
            if not batch:
                if not failed:
                    self._wait_for_background(0.05)
                return failed
            mode, outputs = self._start(batch)
        else:
            outputs = mode.resume()
        self._kind = mode.kind
        self._in_flight = mode if mode.in_flight else None
        return failed + outputs

    def _start(self, batch: Batch) -> tuple[StepMode, list[RequestOutput]]:
        for mode in self.modes:
            outputs = mode.start(batch)
            if outputs is not None:
                return mode, outputs
        raise AssertionError("the synchronous step takes every batch")

    def _wait_for_background(self, timeout: float) -> None:
        """Nothing could run: wait for an adapter read, a grammar compile or a KV read from
        disk to finish instead of spinning (a spinning loop steals the CPU, and the GIL, those
        need)."""
        self.adapters.wait_for_copies()  # an adapter's copy to the device: a few ms at most
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
