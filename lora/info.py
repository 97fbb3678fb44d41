"""What the adapter manager tells its callers about adapters: plain values, no torch, so the
gateway reads them (through `engine.protocols.AdapterRegistry`) without loading the engine."""

from __future__ import annotations

from dataclasses import dataclass, field


class AdapterExists(KeyError):
    """The tenant already has an adapter of that name."""


@dataclass(frozen=True)
class AdapterInfo:
    """What the registry tells about one adapter (the gateway's JSON)."""

    name: str
    tenant: str
    rank: int
    target_modules: tuple[str, ...]
    num_bytes: int  # the weights
    stored_bytes: int  # the folder's files on disk (what a tenant's storage quota counts)
    created: int
    pinned: bool
    tier: str  # "device" | "host" | "disk": the fastest tier holding it now
    version: str = ""  # the shared registry's version it was registered as ("": local only)


@dataclass
class AdapterStats:
    """Counters for metrics; plain ints, read from any thread."""

    loads: dict[str, int] = field(default_factory=lambda: {"host": 0, "device": 0})
    evictions: dict[str, int] = field(default_factory=lambda: {"host": 0, "device": 0})
