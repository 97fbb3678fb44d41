"""Structured generation: constraint specs -> compiled grammars -> per-request matchers.

`grammar.spec` is pure Python (the gateway parses requests with it); the compiler,
backends and matchers load torch and the grammar libraries.
"""
