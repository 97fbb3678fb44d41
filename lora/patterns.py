"""PEFT's `rank_pattern` / `alpha_pattern`: regexes over module names, from untrusted files.

A key applies to a module when it matches a dotted suffix of the module's name (PEFT's
`get_pattern_key`). The keys come from uploaded `adapter_config.json` files, so they are
matched with the `regex` engine, whose matches can time out: validation matches every key
against every module name of the base model within `BUDGET_S`, and a pattern that backtracks
catastrophically is refused instead of hanging the server. Later matches are over the same
names, so they are bounded too.
"""

from __future__ import annotations

import time
from typing import Any

import regex

BUDGET_S = 0.25


def pattern_key(patterns: dict[str, Any], module_path: str) -> str | None:
    """The first key of `patterns` that matches `module_path`, or None."""
    for key in patterns:
        if regex.match(_suffix(key), module_path):
            return key
    return None


def check_patterns(patterns: list[str], paths: list[str]) -> list[str]:
    """A problem for each pattern that does not compile or does not match all module `paths`
    within the shared budget."""
    deadline = time.monotonic() + BUDGET_S
    problems = []
    for pattern in patterns:
        try:
            compiled = regex.compile(_suffix(pattern))
            for path in paths:
                compiled.match(path, timeout=max(deadline - time.monotonic(), 1e-3))
        except regex.error as e:
            problems.append(f"pattern {pattern!r} is not a valid regex ({e})")
        except TimeoutError:
            problems.append(f"pattern {pattern!r} takes too long to match module names "
                            "(catastrophic backtracking)")
    return problems


def _suffix(key: str) -> str:
    return rf"(.*\.)?({key})$"
