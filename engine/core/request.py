"""A request's state as it moves through the engine. Pure Python."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling.params import SamplingParams

if TYPE_CHECKING:
    from concurrent.futures import Future

    from engine.core.detokenizer import IncrementalDetokenizer
    from engine.core.reasoning import Reasoning, ReasoningDetokenizer
    from grammar.backend import CompiledGrammar, Matcher
    from lora.manager import Lease
    from sessions.radix_tree import RadixNode

_arrival = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence. `token_ids` is prompt + output so far.

    The one scheduling rule: each step `num_computed_tokens` (tokens whose KV is in the cache)
    catches up toward `len(token_ids)`. When it reaches it, the step samples a new token.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tenant: str = "default"
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from a prefix cache (usage reporting)
    pages: list[int] = field(default_factory=list)
    # The first `num_cached_pages` of `pages` belong to the prefix cache, locked through
    # `cache_node` (see engine/kv/prefix_cache.py); the rest belong to the request.
    num_cached_pages: int = 0
    cache_node: RadixNode | None = None
    session_id: str | None = None  # a session's turn: its KV stays pinned after it finishes
    adapter_uid: int = 0  # which weights of `params.adapter` (set by the engine; 0: base)
    lora: Lease | None = None  # its hold on `params.adapter` (lora/manager.py); None: base
    lora_waits: bool = False  # its last admission found it ready but for room for its adapter
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # what stopped it: a stop token id or stop string
    error: str | None = None  # why the request failed (finish_reason "error")
    arrival: int = field(default_factory=lambda: next(_arrival))
    added_at: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None  # when it first entered the running batch
    num_preemptions: int = 0
    # Each stage's own state, set when the engine admits the request:
    # - the output processor's detokenizer (engine/core/output_processor.py);
    output_state: IncrementalDetokenizer | ReasoningDetokenizer | None = None
    # - structured output (engine/sampling/structured.py): the grammar compiling until it is
    #   ready, then its matcher;
    pending_grammar: Future[CompiledGrammar] | None = None
    matcher: Matcher | None = None
    # - a reasoning model's phase (engine/core/reasoning.py); None when it does not reason.
    reasoning: Reasoning | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def namespace(self) -> tuple[str, str | None, int]:
        """KV is shared only within one (tenant, adapter weights): an adapter is named by a
        hash of its files, so other weights under the same name are another adapter."""
        return (self.tenant, self.params.adapter, self.adapter_uid)

    @property
    def lora_slot(self) -> int:
        """Its adapter's device slot, pinned from admission to finish; -1: none (yet)."""
        return -1 if self.lora is None else self.lora.slot

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def sort_key(self) -> tuple[int, int]:
        """Lower runs first: priority, then arrival (FCFS)."""
        return (self.params.priority, self.arrival)
