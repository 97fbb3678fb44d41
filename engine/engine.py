"""The engine step: schedule -> run -> postprocess.

On CUDA the decode steps overlap (`EngineConfig.overlap_schedule`): step N+1's forward is queued
on the device, fed by step N's tokens there, before the host reads step N's tokens and
postprocesses them, so the host's work per step hides behind the device's (SGLang's overlap
scheduler). Requests that step N ends ran one token too far in step N+1; that row is dropped.
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, wait

import torch

from engine.config import EngineConfig, ModelLoadError
from engine.detokenizer import Decoder, IncrementalDetokenizer
from engine.loader import load_model, resolve_model_dir
from engine.messages import RequestOutput
from engine.model_runner import ModelRunner, Step
from engine.page_allocator import PageAllocator
from engine.prefix_cache import PrefixCache
from engine.request import Request
from engine.sampler import SampleResult
from engine.sampling_params import InvalidRequestError, SamplingParams
from engine.scheduler import Batch, Scheduler
from engine.structured import GrammarStage
from lora.layers import wrap_model
from lora.manager import AdapterManager, UnknownAdapter
from lora.slots import LoraSlots

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LLMEngine:
    def __init__(self, cfg: EngineConfig):
        from transformers import AutoTokenizer

        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.model_dir = resolve_model_dir(cfg.model, cfg.cache_dir)
        self.model = load_model(self.model_dir, DTYPES[cfg.dtype], cfg.device)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot load the tokenizer from {self.model_dir}: {e}") from e
        mc = self.model_config = self.model.cfg
        self.eos_token_ids = set(mc.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.decoder = Decoder(self.tokenizer)  # shared by the requests' detokenizers

        num_pages = cfg.num_pages or self._pages_for_budget(cfg.kv_cache_gb)
        self.max_model_len = min(cfg.max_model_len or mc.max_position, num_pages * cfg.page_size)
        self.allocator = PageAllocator(num_pages)
        self.grammar = GrammarStage(self.tokenizer, mc.vocab_size, sorted(self.eos_token_ids))
        dtype, device = DTYPES[cfg.dtype], self.model.embed_tokens.weight.device
        slots = None
        if cfg.max_loras:
            slots = LoraSlots(mc, cfg.max_loras, cfg.max_lora_rank, dtype, device)
        self.adapters = AdapterManager(mc, slots, cfg.max_cpu_loras, cfg.adapter_dir, dtype)
        lora = wrap_model(self.model, slots, self.adapters.slot_of) if slots else None
        session_pages = num_pages // 4 if cfg.session_kv_pages is None else cfg.session_kv_pages
        self.prefix_cache = PrefixCache(self.allocator, cfg.page_size, cfg.prefix_cache,
                                        session_pages)
        self.scheduler = Scheduler(
            self.allocator,
            cfg.page_size,
            cfg.max_num_seqs,
            cfg.max_num_batched_tokens,
            adapters=self.adapters,
            is_ready=self.grammar.is_ready,
            cache=self.prefix_cache,
        )
        self.runner = ModelRunner(
            self.model, num_pages, cfg.page_size, cfg.seed, grammar=self.grammar, lora=lora,
            cuda_graph_max_batch=cfg.max_num_seqs if cfg.cuda_graphs else 0,
            max_model_len=self.max_model_len, eos_token_ids=sorted(self.eos_token_ids),
        )
        self._requests: dict[str, Request] = {}
        overlap = cfg.overlap_schedule
        self.overlap = self.runner.device.type == "cuda" if overlap is None else overlap
        self._ahead: Step | None = None  # the overlapped decode step in flight

    def _pages_for_budget(self, gb: float) -> int:
        mc = self.model_config
        itemsize = torch.empty((), dtype=DTYPES[self.cfg.dtype]).element_size()
        per_page = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * itemsize * self.cfg.page_size
        return max(1, int(gb * 2**30) // per_page)

    # -- requests -------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise `InvalidRequestError` for a request that must not enter the batch."""
        params.validate()
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty", "prompt")
        vocab = self.model_config.vocab_size
        # set/min/max run in C: a 4k-token session turn checks in tens of microseconds.
        ints = set(map(type, prompt_token_ids)) <= {int, bool}
        if not ints or min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise InvalidRequestError(
                f"prompt token ids must be integers in [0, {vocab})", "prompt"
            )
        if n + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the "
                f"request asks for {n} prompt tokens plus max_tokens={params.max_tokens}",
                "max_tokens" if n < self.max_model_len else "prompt",
            )

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
        try:
            self.adapters.attach(req)
        except UnknownAdapter:
            raise InvalidRequestError(f"unknown adapter {params.adapter!r}", "model") from None
        req.adapter_uid = self.adapters.uid_of(req)
        req.output_state = IncrementalDetokenizer(self.decoder, req.prompt_token_ids, params.stop)
        self.grammar.submit(req)
        self._requests[request_id] = req
        self.scheduler.add(req)
        return req

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self._requests.get(request_id)
        if req is None:
            return None
        self._finish(req, "abort")
        return self._output(req, [], None)

    def release_session(self, session_id: str) -> None:
        """A session ended: its KV stays cached but is no longer pinned."""
        self.prefix_cache.release_session(session_id)

    def reset_prefix_cache(self) -> int:
        """Drop every cached page (between runs; raises while requests run)."""
        return self.prefix_cache.reset()

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
        failed = [self._fail(req, why) for req, why in self._not_startable()]
        try:
            if self._ahead is not None:
                return failed + self._step_ahead()
            batch = self.scheduler.schedule()
            failed += [self._fail(req, why) for req, why in batch.failed]
            if not batch:
                if not failed:
                    self._wait_for_background(0.05)
                return failed
            if self.overlap and all(s.num_new_tokens == 1 and s.samples for s in batch.seqs):
                step = self.runner.launch(batch)
                self.runner.sample(step, step.rows)
                self._ahead = step
                return failed + self._step_ahead()
            return failed + self.postprocess(batch, self.runner.run(batch))
        except BaseException:
            self._ahead = None  # what was in flight belongs to requests the caller now fails
            raise

    def _step_ahead(self) -> list[RequestOutput]:
        """Queue the next decode step behind the one in flight, then postprocess the one in
        flight (the host's work runs while the device computes) and queue the next one's draw
        (its grammar masks need this step's tokens accepted)."""
        prev = self._ahead
        nxt = self._decodes_ahead(prev)
        self._ahead = self.runner.launch(nxt, after=prev) if nxt else None
        outputs = self.postprocess(prev.batch, self.runner.collect(prev), jump_forward=False)
        if self._ahead is not None:
            alive = [r for r in self._ahead.rows if not r.finished]
            if alive:
                self.runner.sample(self._ahead, alive)
            else:
                self._ahead = None
        return outputs

    def _decodes_ahead(self, prev: Step) -> Batch | None:
        """The decodes that follow `prev`: its requests that its tokens cannot end by length.
        None when a waiting request could start instead (the regular schedule admits it)."""
        if self.scheduler.admits_now():
            return None
        reqs = [
            r for r in prev.drawn.reqs
            if not r.finished
            and r.num_output_tokens + 1 < r.params.max_tokens
            and r.num_tokens + 1 < self.max_model_len
        ]
        return self.scheduler.schedule_ahead(reqs)

    def _wait_for_background(self, timeout: float) -> None:
        """Nothing could run: wait for an adapter read or a grammar compile to finish instead
        of spinning (a spinning loop steals the CPU those need)."""
        pending = self.adapters.pending_loads()
        pending += [r.pending_grammar for r in self.scheduler.waiting if r.pending_grammar]
        if pending:
            wait(pending, timeout, return_when=FIRST_COMPLETED)

    def _not_startable(self) -> list[tuple[Request, str]]:
        """Waiting requests that can never start: their adapter failed to load, or their
        grammar failed to compile."""
        failed = list(self.adapters.take_failed())
        for req in self.scheduler.waiting:
            error = GrammarStage.compile_error(req)
            if error is not None:
                failed.append((req, error))
        return failed

    def postprocess(
        self,
        batch: Batch,
        samples: list[tuple[Request, SampleResult]],
        jump_forward: bool = True,
    ) -> list[RequestOutput]:
        """Append each sampled token and check stops. A request whose row could not be sampled,
        or whose own postprocessing raises (grammar, detokenizer, output check), fails alone
        with the reason; the rest of the batch goes on. Rows of requests that ended while the
        step was in flight (aborted) are dropped. `jump_forward=False` when the next step is
        already queued: it decodes the sampled token, so no forced tokens may follow it."""
        sampled = [(r, s) for r, s in samples if not r.finished]
        self.scheduler.update(batch, {r: s.token_id for r, s in sampled if s.error is None})
        outputs = []
        for req, sample in sampled:
            if sample.error is not None:
                outputs.append(self._fail(req, sample.error))
                continue
            try:
                outputs.append(self._advance(req, sample, jump_forward))
            except Exception as e:
                log.exception("request %s failed after sampling", req.request_id)
                outputs.append(self._fail(req, f"internal error: {type(e).__name__}: {e}"))
        return outputs

    def _advance(self, req: Request, sample: SampleResult, jump_forward: bool) -> RequestOutput:
        new = [sample.token_id]
        reason = self._check_stop(req, sample.token_id)
        jump_forward = jump_forward and req.matcher is not None and req.params.logprobs is None
        if reason is None and jump_forward:
            reason = self._jump_forward(req, new)  # only a grammar forces tokens
        if reason:
            self._finish(req, reason)
        lp = [sample.logprob] if sample.logprob is not None else None
        return self._output(req, new, lp)

    def _jump_forward(self, req: Request, new: list[int]) -> str | None:
        """Append the tokens the grammar forces; the next step prefills them as one chunk."""
        limit = req.params.max_tokens - req.num_output_tokens
        for token in self.grammar.jump_forward(req, limit):
            req.token_ids.append(token)
            new.append(token)
            reason = self._check_stop(req, token, accepted=True)
            if reason:
                return reason
        return None

    def _check_stop(self, req: Request, token: int, accepted: bool = False) -> str | None:
        p = req.params
        if not accepted:
            req.error = GrammarStage.accept(req, token)
            if req.error:
                return "error"
        if (
            token in p.stop_token_ids
            or (not p.ignore_eos and token in self.eos_token_ids)
            or GrammarStage.terminated(req)
            or req.output_state.add(token) is not None
        ):
            req.error = GrammarStage.check(req, req.output_state.text)
            return "error" if req.error else "stop"
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _fail(self, req: Request, why: str) -> RequestOutput:
        """End `req` with finish_reason "error" (also when it had just finished otherwise).
        The output is built without the detokenizer, which may be what failed."""
        req.error = why
        if req.finished:
            req.finish_reason = "error"
        else:
            self._finish(req, "error")
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=[],
            new_text="",
            finished=True,
            finish_reason="error",
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            num_output_tokens=req.num_output_tokens,
            error=why,
        )

    def _finish(self, req: Request, reason: str) -> None:
        self.scheduler.finish(req, reason)
        self.adapters.release(req)
        self.runner.sampler.release(req.request_id)
        self._requests.pop(req.request_id, None)

    def _output(self, req: Request, new_ids: list[int], logprobs) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_ids,
            new_text=req.output_state.take(final=req.finished),
            finished=req.finished,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            num_output_tokens=req.num_output_tokens,
            logprobs=logprobs,
            error=req.error,
        )
