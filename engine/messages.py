"""The typed boundary between the gateway and the engine. Pure Python: no torch here.

The gateway submits a `GenerateRequest`; the engine answers with a stream of `RequestOutput`
deltas for that request id, the last one with `finished=True`. Everything else the gateway may
ask of the engine (and of its adapter registry) is declared in engine/protocols.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling.params import SamplingParams


@dataclass
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tenant: str = "default"
    session_id: str | None = None  # a session's turn: its KV stays pinned for the next turn


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class RequestOutput:
    """What one engine step produced for one request.

    `new_token_ids` / `new_text` are the delta since the previous output. Text is held back
    while it could still be the start of a stop string, so a stop string never leaks, and
    while it ends inside an incomplete UTF-8 sequence.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    # With "stop": the stop token id or stop string that ended it (None: EOS or the grammar).
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    error_code: str | None = None  # "engine_failed": the engine stopped, not this request
    # A reasoning model's (engine/core/reasoning.py): the reasoning text's delta (not in new_text)
    # and the output tokens its reasoning took so far, markers included.
    new_reasoning_text: str = ""
    num_reasoning_tokens: int = 0
    # Seconds from its arrival at the engine to its first step (waiting for a seat, pages, a
    # grammar compile or an adapter load); None until it was scheduled.
    queue_time: float | None = None
