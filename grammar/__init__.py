"""Structured generation: constraint specs -> compiled grammars -> per-request matchers.

`grammar.spec` is pure Python (the gateway imports it to validate requests); the compiler,
backends and matchers load torch and the grammar libraries.
"""
