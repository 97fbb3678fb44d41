"""What the gateway may ask of the engine, as two protocols and the small values they return.
Pure Python: no torch here, so the gateway types its side of the seam without the engine's
internals.

    EngineClient     `AsyncEngine`: check a request, compile its constraint, submit it, abort
                     it, release a session; the facts and stats the gateway reads.
    AdapterRegistry  the engine's LoRA `AdapterManager`: add, remove, get and list a tenant's
                     adapters, and the counters its metrics read.

Both are structural (`typing.Protocol`): the implementations do not inherit from them, they
have these members; so does a test's fake.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from engine.kv.prefix_cache import PrefixCacheStats
from engine.messages import GenerateRequest, RequestOutput
from engine.sampling.params import SamplingParams
from grammar.spec import ConstraintSpec
from lora.info import AdapterExists, AdapterInfo, AdapterStats

__all__ = ["AdapterExists", "AdapterInfo", "AdapterRegistry", "AdapterStats", "EngineClient",
           "EngineStats", "Sink"]

Sink = asyncio.Queue[RequestOutput]  # one request's outputs, filled on the event loop only


# -- adapters -----------------------------------------------------------------------------------


class AdapterRegistry(Protocol):
    """A tenant's LoRA adapters. Every member is safe from any thread; `add` and `remove`
    touch the disk, so the gateway calls them off the event loop."""

    @property
    def store_dir(self) -> Path | None:
        """Where uploaded adapters are kept (None: uploads are refused)."""
        ...

    @property
    def stats(self) -> AdapterStats: ...

    @property
    def num_resident(self) -> dict[str, int]:
        """Adapters held per tier ("device", "host") now."""
        ...

    def add(
        self, tenant: str, name: str, path: str | Path, *, move: bool = False, pin: bool = False,
        version: str = "",
    ) -> AdapterInfo:
        """Validate the PEFT folder at `path` and register it as the tenant's `name`
        (`move=True`: move the folder into `store_dir`; `version`: the shared registry's, kept
        in its `AdapterInfo`). A refused adapter leaves no trace.
        Raises:
            ValueError: everything wrong with the folder or the name (lora's `AdapterError`,
                whose `problems` lists each).
            AdapterExists: the tenant already has `name`.
        """
        ...

    def remove(self, tenant: str, name: str) -> bool:
        """Unregister; requests already running with it finish. False: no such adapter."""
        ...

    def get(self, tenant: str, name: str) -> AdapterInfo | None: ...

    def list(self, tenant: str) -> list[AdapterInfo]:
        """The tenant's adapters, oldest first."""
        ...


# -- the engine ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineStats:
    """A snapshot the engine thread publishes after every loop iteration (read anywhere)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_pages_used: int = 0  # held by requests or pinned by sessions (not evictable cache)
    kv_pages_total: int = 0
    jump_forward_tokens: int = 0
    num_preemptions: int = 0  # requests whose KV was dropped to make room (recomputed)
    # Per kind of step (engine/core/engine.py `STEP_KINDS`): how many ran and their wall seconds.
    step_times: dict[str, tuple[int, float]] = field(default_factory=dict)
    prefix: PrefixCacheStats = PrefixCacheStats()
    # Speculative decoding (engine/spec/speculative.py): draft tokens verified and accepted,
    # sequence-steps that carried drafts, and the tokens those produced.
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_forwards: int = 0
    spec_emitted: int = 0
    spec_forced: int = 0
    fatal_error: str | None = None  # why the engine stopped for good (a rank died), else None
    # The core loop's wall seconds by part (engine/core/loop.py `LOOP_PARTS`): waiting for work,
    # applying commands, stepping, publishing outputs. Left out of equality: a snapshot that
    # differs only there is not news (an idle loop still waits).
    loop_seconds: dict[str, float] = field(default_factory=dict, compare=False)


class EngineClient(Protocol):
    """The engine as request handling sees it. Facts are valid once the engine is loaded;
    requests are submitted and aborted on the event loop only."""

    @property
    def max_model_len(self) -> int: ...

    @property
    def max_num_seqs(self) -> int:
        """The running batch's limit (the gateway's seats: it plus the queue)."""
        ...

    @property
    def model_dir(self) -> Path:
        """The HF-style folder of the served model (config.json, the tokenizer)."""
        ...

    @property
    def adapters(self) -> AdapterRegistry | None:
        """None before loading, or for an engine without LoRA."""
        ...

    @property
    def stats(self) -> EngineStats: ...

    @property
    def num_outstanding(self) -> int:
        """Requests submitted and not yet finished."""
        ...

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise `InvalidRequestError` before the request is queued."""
        ...

    async def compile_grammar(self, spec: ConstraintSpec) -> None:
        """Compile a constraint (or find it cached); raises `GrammarError` when no backend
        can."""
        ...

    def add_request(self, request: GenerateRequest, sink: Sink) -> None:
        """Every output for `request` goes into `sink`, the last with `finished=True`."""
        ...

    def abort(self, request_id: str) -> None:
        """Stop a request; its KV pages are freed before the next engine step."""
        ...

    def release_session(self, session_id: str) -> None:
        """The session ended: unpin its KV."""
        ...
