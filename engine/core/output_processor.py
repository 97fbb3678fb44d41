"""What the engine does with a step's sampled tokens (`OutputProcessor.postprocess`): append
each, advance its grammar (appending the tokens the grammar forces: jump-forward), check the
stop conditions (the length stop is one function, `tokens_left`), detokenize, and finish the
requests that ended (their pages, adapter lease and sampler state go back). `LLMEngine`'s step
modes call it; so does the speculative loop for the tokens it accepted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.core.detokenizer import Decoder, IncrementalDetokenizer
from engine.core.reasoning import Reasoning, ReasoningDetokenizer, ReasoningFormat
from engine.core.request import Request
from engine.core.scheduler import Batch, Scheduler
from engine.messages import RequestOutput
from engine.sampling.sampler import SampleResult
from engine.sampling.structured import GrammarStage

if TYPE_CHECKING:
    from engine.runner.model_runner import ModelRunner
    from engine.spec.speculative import Speculator
    from lora.manager import AdapterManager

log = logging.getLogger(__name__)


class OutputProcessor:
    """`runner` and `speculator()` are read when used: tests and benchmarks swap the runner's
    sampler and the engine's speculator."""

    def __init__(self, scheduler: Scheduler, grammar: GrammarStage, adapters: AdapterManager,
                 runner: ModelRunner, speculator: Callable[[], Speculator | None],
                 requests: dict[str, Request],
                 eos_token_ids: set[int], max_model_len: int, decoder: Decoder,
                 reasoning_format: ReasoningFormat | None, tokenizer: object):
        self.scheduler, self.grammar, self.adapters = scheduler, grammar, adapters
        self.runner, self.speculator, self.requests = runner, speculator, requests
        self.eos_token_ids, self.max_model_len = eos_token_ids, max_model_len
        self.decoder, self.reasoning_format, self.tokenizer = decoder, reasoning_format, tokenizer

    def output_stage(self, req: Request) -> IncrementalDetokenizer | ReasoningDetokenizer:
        """The request's detokenizer; a reasoning one (and `req.reasoning`) when the model
        reasons and the request asks for it."""
        p, fmt = req.params, self.reasoning_format
        if fmt is None or not p.reasoning:
            return IncrementalDetokenizer(self.decoder, req.prompt_token_ids, p.stop)
        thinking = fmt.thinks_first(req.prompt_token_ids, self.tokenizer)
        req.reasoning = Reasoning(fmt, p.max_reasoning_tokens, thinking)
        return ReasoningDetokenizer(self.decoder, req.prompt_token_ids, p.stop, req.reasoning)

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
        spec = self.speculator()
        spec = spec if spec is not None and spec.wants(len(sampled)) else None
        outputs = []
        for req, sample in sampled:
            if sample.error is not None:
                outputs.append(self.fail(req, sample.error))
                continue
            try:  # the tokens a grammar forces go to the next step's draft if it drafts
                jump = jump_forward and not (spec is not None and spec.drafts(req))
                outputs.append(self.advance(req, sample, jump))
            except Exception as e:
                log.exception("request %s failed after sampling", req.request_id)
                outputs.append(self.fail(req, f"internal error: {type(e).__name__}: {e}"))
        return outputs

    def advance(self, req: Request, sample: SampleResult, jump_forward: bool) -> RequestOutput:
        new = [sample.token_id]
        reason = self.check_stop(req, sample.token_id)
        jump_forward = jump_forward and req.matcher is not None and req.params.logprobs is None
        if reason is None and jump_forward:
            reason = self._jump_forward(req, new)  # only a grammar forces tokens
        if reason:
            self.finish(req, reason)
        lp = [sample.logprob] if sample.logprob is not None else None
        return self.output(req, new, lp)

    def _jump_forward(self, req: Request, new: list[int]) -> str | None:
        """Append the tokens the grammar forces; the next step prefills them as one chunk."""
        for token in self.grammar.jump_forward(req, self.tokens_left(req)):
            req.token_ids.append(token)
            new.append(token)
            reason = self.check_stop(req, token, accepted=True)
            if reason:
                return reason
        return None

    def check_stop(self, req: Request, token: int, accepted: bool = False) -> str | None:
        p, detok = req.params, req.output_state
        assert detok is not None, "set at admission"
        if not accepted:
            req.error = GrammarStage.accept(req, token)
            if req.error:
                return "error"
        if token in p.stop_token_ids:
            req.stop_reason = token
        elif not ((not p.ignore_eos and token in self.eos_token_ids)
                  or GrammarStage.terminated(req)):
            # As vLLM: a stop string ends the output only once more than min_tokens are out.
            req.stop_reason = detok.add(token, req.num_output_tokens > p.min_tokens)
            if req.stop_reason is None:
                return "length" if self.tokens_left(req) <= 0 else None
        req.error = GrammarStage.check(req, detok.text)
        return "error" if req.error else "stop"

    def tokens_left(self, req: Request) -> int:
        """The length stop: how many more tokens `req` may have before `max_tokens` or the
        context (`max_model_len`) ends it."""
        by_max_tokens = req.params.max_tokens - req.num_output_tokens
        return min(by_max_tokens, self.max_model_len - req.num_tokens)

    def fail(self, req: Request, why: str) -> RequestOutput:
        """End `req` with finish_reason "error" (also when it had just finished otherwise).
        The output is built without the detokenizer, which may be what failed."""
        req.error = why
        if req.finished:
            req.finish_reason = "error"
        else:
            self.finish(req, "error")
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

    def finish(self, req: Request, reason: str) -> None:
        self.scheduler.finish(req, reason)
        if req.lora is not None:
            self.adapters.release(req.lora)
        self.runner.sampler.release(req.request_id)
        speculator = self.speculator()
        if speculator is not None:
            speculator.release(req, completed=reason in ("stop", "length"))
        self.requests.pop(req.request_id, None)

    def output(self, req: Request, new_ids: list[int], logprobs) -> RequestOutput:
        r, detok = req.reasoning, req.output_state
        assert detok is not None, "set at admission"
        thought = detok.take_reasoning(req.finished) if isinstance(
            detok, ReasoningDetokenizer) else ""
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_ids,
            new_text=detok.take(final=req.finished),
            finished=req.finished,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason if req.finish_reason == "stop" else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            num_output_tokens=req.num_output_tokens,
            logprobs=logprobs,
            error=req.error,
            new_reasoning_text=thought,
            num_reasoning_tokens=r.num_tokens if r else 0,
            queue_time=None if req.scheduled_at is None else req.scheduled_at - req.added_at,
        )
