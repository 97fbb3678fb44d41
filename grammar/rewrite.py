"""JSON Schema's regex dialect (ECMA-262) for the Rust regex engines of outlines-core and
llguidance."""

from __future__ import annotations


def ascii_digits(regex: str) -> str:
    """Read `\\d` as [0-9], as ECMA-262 (JSON Schema's dialect) and xgrammar do; Rust's regex
    would match every Unicode digit."""
    out, depth, i = [], 0, 0
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            nxt = regex[i + 1]
            if nxt == "d":
                out.append("0-9" if depth else "[0-9]")
            elif nxt == "D" and not depth:
                out.append("[^0-9]")
            else:
                out.append(c + nxt)
            i += 2
            continue
        if c == "[":
            depth += 1
        elif c == "]" and depth:
            depth -= 1
        out.append(c)
        i += 1
    return "".join(out)
