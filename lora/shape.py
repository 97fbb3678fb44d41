"""What lora needs to know of the base model: its architecture and projection shapes. The
engine's `ModelConfig` (engine/config.py) has them; lora names only this protocol, so no
import runs up to the engine, not even a type-only one."""

from __future__ import annotations

from typing import Protocol


class BaseShape(Protocol):
    @property
    def architecture(self) -> str: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
