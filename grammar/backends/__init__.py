"""The grammar backends, each in its own module, and the factory that picks one by name.

A backend's module is imported only when it is asked for: each wraps a native library
(llguidance, xgrammar, outlines-core), and a compile worker loads only those it tries.
"""

from __future__ import annotations

from grammar.backend import Backend
from grammar.vocab import TokenVocab

# The default fallback order, measured on the MaskBench dev set
# (benchmarks/results/grammar_bench_cpu.md). llguidance refuses keywords it does not implement;
# its relaxed mode then drops those that only rule instances out, which passes more cases than
# xgrammar (which ignores them too, and compiles schemas with optional properties in seconds);
# outlines-core is the last resort. `grammar.validate.check_output` checks every output.
BACKEND_NAMES = ("llguidance", "llguidance-relaxed", "xgrammar", "outlines")


def make_backend(name: str, vocab: TokenVocab) -> Backend:
    """The backend called `name` (one of BACKEND_NAMES)."""
    if name == "xgrammar":
        from grammar.backends.xgrammar import XGrammarBackend

        return XGrammarBackend(vocab)
    if name == "outlines":
        from grammar.backends.outlines import OutlinesBackend

        return OutlinesBackend(vocab)
    if name in ("llguidance", "llguidance-relaxed"):
        from grammar.backends.llguidance import LLGuidanceBackend

        return LLGuidanceBackend(vocab, relaxed=name == "llguidance-relaxed")
    raise ValueError(f"unknown grammar backend {name!r}; expected one of {BACKEND_NAMES}")
