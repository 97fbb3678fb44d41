"""The one small interface over grammar backends (llguidance, xgrammar, outlines-core).

A backend turns a `ConstraintSpec` into a picklable artifact inside a compile worker
(`compile`), and turns that artifact back into a matcher factory in the engine (`load`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from grammar.spec import ConstraintSpec
from grammar.vocab import TokenVocab


class BackendError(Exception):
    """A backend cannot compile a spec (unsupported feature, syntax error...)."""


class Unsatisfiable(BackendError):
    """No output satisfies the spec: no other backend is tried."""


class Matcher(ABC):
    """Per-request grammar state. Not thread-safe; one per request."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]`.

        Args:
            bitmask: [batch, ceil(vocab_size / 32)] int32 on CPU; bit `i % 32` of word
                `i // 32` is set iff token `i` is allowed (xgrammar's layout).
            row: the row of `bitmask` to fill; other rows are untouched.

        Every token allowed here is one `accept` takes; a row with no bit set means the output
        cannot go on. Raises BackendError when the backend fails (e.g. a resource limit).
        """

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar forbids it. Raises
        BackendError when the backend fails on it (a resource limit); the matcher is then
        unusable."""

    @abstractmethod
    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens (e.g. rejected speculative tokens)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once a stop token was accepted: the output is complete."""

    @abstractmethod
    def forced_continuation(self) -> str:
        """The text the grammar forces next (jump-forward), or "" if none or unsupported.

        The text is not accepted yet: the caller tokenizes it canonically at the current
        boundary and feeds the tokens through `accept`.
        """


def bitmask_row(bitmask: torch.Tensor, row: int) -> torch.Tensor:
    """`bitmask[row]`, checked to be what backends that write through a raw pointer need."""
    r = bitmask[row]  # (W,)
    if r.device.type != "cpu" or r.dtype != torch.int32 or not r.is_contiguous():
        raise ValueError("the bitmask must be a contiguous int32 CPU tensor")
    return r


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled constraint, shared (cached) across requests; make one matcher each."""

    spec: ConstraintSpec
    backend: str  # the backend that compiled it
    compile_ms: float  # failed attempts, compiling and loading: the wait for a matcher
    _factory: Callable[[], Matcher]
    nbytes: int = 0  # estimated memory held in this process (the compile cache's budget)

    def matcher(self) -> Matcher:
        """A fresh matcher at the grammar's start state."""
        return self._factory()


class Backend(ABC):
    """One grammar library, bound to one vocabulary."""

    name: str
    # Memory a loaded grammar holds per byte of its pickled artifact: an estimate, measured on
    # large schemas, for the compile cache's byte budget.
    bytes_per_artifact_byte: float = 1.0

    @abstractmethod
    def __init__(self, vocab: TokenVocab): ...

    # Any: each backend's own artifact type (xgrammar's and llguidance's JSON text, an
    # outlines-core Index); only the backend that made an artifact loads it.
    @abstractmethod
    def compile(self, spec: ConstraintSpec) -> Any:
        """Compile `spec` into a picklable artifact. Runs in a compile worker; raises
        BackendError (or anything) when the spec is unsupported."""

    @abstractmethod
    def load(self, artifact: Any) -> Callable[[], Matcher]:
        """Rebuild a compiled grammar from its artifact; return its matcher factory."""
