"""Per-request generation knobs. Pure Python: the gateway builds these without torch."""

from __future__ import annotations

import math
from dataclasses import InitVar, dataclass, field
from typing import Any

from grammar.spec import ConstraintSpec, GrammarError, parse_constraint


class InvalidRequestError(ValueError):
    """A request the engine refuses before it enters the batch.

    `param` names the offending field (OpenAI's error `param`), so the gateway can answer a 400
    that points at it.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass
class SamplingParams:
    """How to sample one request. `temperature == 0` means greedy."""

    max_tokens: int = 16
    min_tokens: int = 0  # EOS and stop_token_ids are banned until this many tokens are out
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: chosen token's logprob plus top-k
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    priority: int = 0  # lower runs first; FCFS within a priority
    # May draft tokens when the engine speculates (engine/spec/speculative.py).
    speculative: bool = True
    # Structured output, as the offline API's convenience: OpenAI's `response_format` or vLLM's
    # `structured_outputs` dict, parsed into `constraint` here and not kept. The gateway parses
    # the request once and passes `constraint` alone, so the engine only ever sees the spec.
    response_format: InitVar[dict[str, Any] | None] = None
    structured_outputs: InitVar[dict[str, Any] | None] = None
    constraint: ConstraintSpec | None = None
    adapter: str | None = None
    # A reasoning model's output starts with its reasoning (engine/core/reasoning.py): kept apart,
    # and a constraint applies after it. False: the output is all answer (raw completions).
    reasoning: bool = True
    max_reasoning_tokens: int | None = None  # then the end marker is forced (it counts too)

    def __post_init__(
        self, response_format: dict[str, Any] | None, structured_outputs: dict[str, Any] | None
    ) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if self.constraint is None and (response_format or structured_outputs):
            try:  # the gateway's parser too: one reading of these fields
                self.constraint = parse_constraint(response_format, structured_outputs)
            except GrammarError as e:
                raise InvalidRequestError(e.message, e.param or "response_format") from None
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Each knob's type and range, as vLLM's. Every float's range is closed on both sides
        (NaN and Infinity are out). Token ids (`stop_token_ids`, `logit_bias`' keys) are the
        engine's to check against its vocabulary (`LLMEngine.validate`)."""

        def bad(msg: str, param: str) -> InvalidRequestError:
            return InvalidRequestError(msg, param)

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise bad(f"max_tokens must be an integer, got {self.max_tokens!r}", "max_tokens")
        if self.max_tokens <= 0:
            raise bad(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool):
            raise bad(f"min_tokens must be an integer, got {self.min_tokens!r}", "min_tokens")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise bad(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
                "min_tokens",
            )
        if not 0.0 <= self.temperature < math.inf:  # NaN fails every comparison
            raise bad(f"temperature must be a finite number >= 0, got {self.temperature}",
                      "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not (self.top_k == -1 or self.top_k >= 1):
            raise bad(f"top_k must be -1 (off) or >= 1, got {self.top_k}", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad(f"logprobs must be in [0, 20], got {self.logprobs}", "logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(f"{name} must be in [-2, 2], got {getattr(self, name)}", name)
        if not 0.0 < self.repetition_penalty < math.inf:  # vLLM's bound, finite
            raise bad(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}",
                "repetition_penalty",
            )
        if self.max_reasoning_tokens is not None and not (
            isinstance(self.max_reasoning_tokens, int) and self.max_reasoning_tokens >= 1
        ):
            raise bad(f"max_reasoning_tokens must be an integer >= 1, got "
                      f"{self.max_reasoning_tokens!r}", "max_reasoning_tokens")
        if any(not s for s in self.stop):
            raise bad("stop strings must be non-empty", "stop")
        if any(not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):
            raise bad("logit_bias values must be in [-100, 100]", "logit_bias")

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def check_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int,
                  max_model_len: int) -> None:
    """Raise `InvalidRequestError` for a request that must not enter the batch: its prompt's
    ids and stop token ids against the vocabulary, its length against the context. (Each knob
    was checked once, when `params` was made.) Pure: the gateway runs it on the facts the
    engine core sent at its handshake."""
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("the prompt is empty", "prompt")
    if not _in_vocab(prompt_token_ids, vocab_size):
        raise InvalidRequestError(
            f"prompt token ids must be integers in [0, {vocab_size})", "prompt")
    if not _in_vocab(params.stop_token_ids, vocab_size):
        raise InvalidRequestError(
            f"stop_token_ids must be integers in [0, {vocab_size}), the model's vocabulary",
            "stop_token_ids")
    if n + params.max_tokens > max_model_len:
        raise InvalidRequestError(
            f"this model's maximum context length is {max_model_len} tokens, but the "
            f"request asks for {n} prompt tokens plus max_tokens={params.max_tokens}",
            "max_tokens" if n < max_model_len else "prompt")


def _in_vocab(token_ids: list[int], vocab: int) -> bool:
    """Whether every id is an integer in [0, vocab) (none: True). set/min/max run in C: a
    4k-token session turn checks in tens of microseconds; 10**20 is refused here, before it
    could overflow a tensor."""
    return set(map(type, token_ids)) <= {int, bool} and (
        not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab))
