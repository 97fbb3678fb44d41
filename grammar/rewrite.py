"""Schema and regex rewrites that let a backend read a constraint the way JSON Schema means it.

`ascii_digits`: JSON Schema's regex dialect is ECMA-262, where `\\d` is ASCII; Rust's regex
(outlines-core, llguidance) would match every Unicode digit.
`rewrite_schema`: apply that to every `pattern`, drop `format`s a backend does not know
(unknown formats are annotations that assert nothing), optionally drop keywords, and make
`oneOf`s of `required` lists disjoint (`disjoint_one_of`).
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


def disjoint_one_of(branches: list[object]) -> list[object] | None:
    """Branches that each allow only what exactly one of `branches` allows, for a `oneOf` whose
    branches are all `{"required": [...]}` (the common "either these keys or those"); None for
    any other `oneOf`, or when no branch can hold alone.

    Backends read `oneOf` as `anyOf`, which lets an object carry the keys of two branches and
    so match both. Branch i holds alone when for every other branch j the object lacks some key
    of j; forbidding every key of j that i does not require guarantees that (a subset of the
    valid instances, never an invalid one). A branch whose keys include all of another's can
    never hold alone and is dropped."""
    keys = [_required_only(b) for b in branches]
    if not keys or any(k is None for k in keys):
        return None
    sets = [frozenset(k) for k in keys if k is not None]
    out: list[object] = []
    for i, own in enumerate(sets):
        others = [s for j, s in enumerate(sets) if j != i]
        if any(s <= own for s in others):
            continue
        banned = sorted(set().union(*others) - own)
        out.append({"required": sorted(own), "properties": {k: False for k in banned}})
    return out or None


def _required_only(branch: object) -> list[str] | None:
    if not isinstance(branch, dict) or set(branch) - {"required", "description", "title"}:
        return None
    req = branch.get("required")
    if not isinstance(req, list) or not req or not all(isinstance(k, str) for k in req):
        return None
    return req


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
            elif k == "oneOf" and isinstance(v, list) and (disjoint := disjoint_one_of(v)):
                out[k] = disjoint
            elif k in NAMED_SUBSCHEMAS and isinstance(v, dict):
                out[k] = {name: walk(s) for name, s in v.items()}
            else:
                out[k] = walk(v)
        return out

    return walk(node)
