"""Switchboard's inference engine.

`SamplingParams` is pure Python; `LLM` (which loads torch) is imported lazily so that the
gateway can use `engine.messages` without pulling torch into its modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.sampling.params import InvalidRequestError, SamplingParams

if TYPE_CHECKING:
    from engine.llm import LLM

__all__ = ["LLM", "SamplingParams", "InvalidRequestError"]


def __getattr__(name: str):
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
