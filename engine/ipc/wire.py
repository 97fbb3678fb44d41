"""What the gateway's `EngineProcess` (engine/ipc/core_client.py) and the engine-core process
(engine/ipc/core_process.py) say to each other over their socket, besides the step loop's commands
(`GenerateRequest` and engine/core/loop.py's `Abort`, `ReleaseSession`, `FailAll`, `STOP`). Plain
dataclasses that pickle; no torch.

    client -> core   the commands; `Call` (compile a grammar, add or remove an adapter).
    core -> client   `Status` (loading stage, then the facts or why loading failed);
                     `Outputs` (one loop iteration's outputs for this client, and the stats);
                     `Reply` (a `Call`'s answer); `AdapterTable` (the registry, after every
                     change and whenever an adapter moved between tiers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.messages import RequestOutput
from engine.protocols import EngineStats
from lora.info import AdapterInfo, AdapterStats


@dataclass(frozen=True)
class CoreFacts:
    """What the gateway needs to know of the loaded engine, sent once it is loaded."""

    max_model_len: int
    max_num_seqs: int
    vocab_size: int
    model_dir: Path
    lora: bool  # an adapter registry exists (`--max-loras` > 0)
    adapter_store_dir: Path | None


@dataclass(frozen=True)
class Status:
    stage: str
    facts: CoreFacts | None = None  # set once loaded
    load_error: str | None = None  # set when loading failed (the core then exits)


@dataclass(frozen=True)
class Outputs:
    outputs: list[RequestOutput]
    stats: EngineStats


@dataclass(frozen=True)
class Call:
    call_id: int
    method: str  # "compile_grammar" | "add_adapter" | "remove_adapter"
    args: tuple[Any, ...]


@dataclass(frozen=True)
class Reply:
    call_id: int
    value: Any = None
    # (kind, message, details) when the call raised; kind: "grammar" (details: the param),
    # "adapter" (details: the problems), "exists", "error".
    error: tuple[str, str, Any] | None = None


@dataclass(frozen=True)
class AdapterTable:
    adapters: list[AdapterInfo]
    stats: AdapterStats
    resident: dict[str, int] = field(default_factory=dict)
