"""Schema and regex rewrites that let a backend read a constraint the way JSON Schema means it.

`ascii_digits`: JSON Schema's regex dialect is ECMA-262, where `\\d` is ASCII; Rust's regex
(outlines-core, llguidance) would match every Unicode digit.
`rewrite_schema`: apply that to every `pattern`, drop `format`s a backend does not know
(unknown formats are annotations that assert nothing), and optionally drop keywords.
"""

from __future__ import annotations

from grammar.spec import DATA_KEYWORDS  # instances, not subschemas: never rewritten

# Keywords whose values map names to subschemas: the names are not keywords.
NAMED_SUBSCHEMAS = frozenset(
    {"properties", "definitions", "$defs", "dependentSchemas", "dependencies"}
)


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


def rewrite_schema(
    node: object,
    drop_keys: frozenset[str] = frozenset(),
    drop_formats: frozenset[str] = frozenset(),
) -> object:
    """`node` with ECMA `pattern`s, without the keywords `drop_keys` and without the
    `"format"`s named in `drop_formats`, in every subschema."""

    def walk(x: object) -> object:
        if isinstance(x, list):
            return [walk(v) for v in x]
        if not isinstance(x, dict):
            return x
        out: dict[str, object] = {}
        for k, v in x.items():
            if k in drop_keys or (k == "format" and isinstance(v, str) and v in drop_formats):
                continue
            if k in DATA_KEYWORDS:
                out[k] = v
            elif k == "pattern" and isinstance(v, str):
                out[k] = ascii_digits(v)
            elif k == "patternProperties" and isinstance(v, dict):
                out[k] = {ascii_digits(p): walk(s) for p, s in v.items()}
            elif k in NAMED_SUBSCHEMAS and isinstance(v, dict):
                out[k] = {name: walk(s) for name, s in v.items()}
            else:
                out[k] = walk(v)
        return out

    return walk(node)
