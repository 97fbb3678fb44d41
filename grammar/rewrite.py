"""Schema and regex rewrites that let a backend read a constraint the way JSON Schema means it.

`ascii_digits`: JSON Schema's regex dialect is ECMA-262, where `\\d` is ASCII; Rust's regex
(outlines-core, llguidance) would match every Unicode digit.
`rewrite_schema`: apply that to every `pattern`, drop `format`s a backend does not know
(unknown formats are annotations that assert nothing), optionally drop keywords, write
`oneOf`s of `required` lists as exactly equivalent disjoint branches (`disjoint_one_of`), and,
where llguidance refused the schema, merge overlapping `patternProperties` (`merge_patterns`)
and take keywords off `$ref`s into cycles (`ref_cycles`).

None of these makes a grammar stricter than its schema; where one is looser (merged patterns
with different subschemas), `grammar.validate.check_output` enforces the schema on the output.
"""

from __future__ import annotations

import itertools
import json
import urllib.parse
from collections.abc import Iterator

import jsonschema

from grammar.spec import DATA_KEYWORDS  # instances, not subschemas: never rewritten

# Keywords whose values map names to subschemas: the names are not keywords.
NAMED_SUBSCHEMAS = frozenset(
    {"properties", "definitions", "$defs", "dependentSchemas", "dependencies"}
)
# Keywords that may sit beside a `$ref` without constraining the instance.
BESIDE_REF = frozenset(
    {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
     "writeOnly", "$schema", "$id", "id", "$anchor", "definitions", "$defs"}
)  # fmt: skip
LEGACY_DRAFTS = (jsonschema.Draft3Validator, jsonschema.Draft4Validator,
                 jsonschema.Draft6Validator, jsonschema.Draft7Validator)  # `$ref` hides siblings
APPLICATORS = ("allOf", "anyOf", "oneOf")  # keywords whose members llguidance intersects
MAX_INLINE_DEPTH = 8  # targets `ref_cycles` inlines into one another
MAX_ONE_OF_TERMS = 32  # branches `disjoint_one_of` may write for one `oneOf`
DEPENDENCY_KEYS = ("dependencies", "dependentRequired", "dependentSchemas")
MAX_DEPENDENCIES = 4  # `dependencies_as_any_of` writes at most this many per object


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
    """Branches that hold exactly where `oneOf: branches` does and never two at once, for a
    `oneOf` whose branches are all `{"required": [...]}` (the common "either these keys or
    those"); None for any other `oneOf`, or when the rewrite would take over MAX_ONE_OF_TERMS
    branches (the `oneOf` then stays: backends read it as `anyOf`, `check_output` enforces it).

    Backends read `oneOf` as `anyOf`, which lets an object carry the keys of two branches and
    so match both. Branch i holds alone when the object has its keys S_i and, for every other
    branch j, lacks some key of D_j = S_j - S_i. "Lacks one of [k1, k2, ...]" is the disjoint
    union of "lacks k1", "has k1, lacks k2", ...; the product over j of these pieces gives terms
    (keys required, keys forbidden) that are pairwise disjoint and together hold exactly where
    branch i holds alone. Terms of two branches are disjoint too, so `oneOf` and `anyOf` read
    them alike. A non-object satisfies every `required`, so two or more branches reject it: the
    terms say `"type": "object"`. No term at all: no object is valid, nor anything else."""
    keys = [_required_only(b) for b in branches]
    if not keys or any(k is None for k in keys):
        return None
    sets = [frozenset(k) for k in keys if k is not None]
    terms: list[tuple[frozenset[str], frozenset[str]]] = []  # (required, forbidden)
    for i, own in enumerate(sets):
        partial = [(own, frozenset[str]())]
        for missing in sorted((sorted(s - own) for j, s in enumerate(sets) if j != i), key=len):
            partial = [piece for req, ban in partial for piece in _lacks_one(req, ban, missing)]
            if len(terms) + len(partial) > MAX_ONE_OF_TERMS:
                return None
        terms += partial
    if not terms:
        return [False]
    return [_term(req, ban, len(sets) > 1) for req, ban in terms]


def _lacks_one(
    req: frozenset[str], ban: frozenset[str], keys: list[str]
) -> list[tuple[frozenset[str], frozenset[str]]]:
    """The term (req, ban) split into disjoint terms that each lack one of `keys`."""
    if not ban.isdisjoint(keys):
        return [(req, ban)]
    return [(req | set(keys[:t]), ban | {keys[t]}) for t in range(len(keys)) if keys[t] not in req]


def _term(req: frozenset[str], ban: frozenset[str], objects_only: bool) -> dict[str, object]:
    out: dict[str, object] = {"type": "object"} if objects_only else {}
    out["required"] = sorted(req)
    if ban:
        out["properties"] = {k: False for k in sorted(ban)}
    return out


def _required_only(branch: object) -> list[str] | None:
    if not isinstance(branch, dict) or set(branch) - {"required", "description", "title"}:
        return None
    req = branch.get("required")
    if not isinstance(req, list) or not req or not all(isinstance(k, str) for k in req):
        return None
    return req


def dependencies_as_any_of(node: dict[str, object], live: frozenset[str]) -> dict[str, object]:
    """`node` with its dependencies (the keywords of `DEPENDENCY_KEYS` that its draft defines,
    `live`) written as what llguidance reads: "with A present, B and C are" is `anyOf` [A
    absent (`properties: {A: false}`), `required` [A, B, C]], and "with A present, the object
    matches S" is `anyOf` [A absent, `allOf` [`required` [A], S]], one per dependency, added
    to `allOf`. Exact. llguidance has no dependencies: the strict mode refused such schemas
    and the relaxed mode dropped them, letting any object through. Left as they are: objects
    with more than MAX_DEPENDENCIES (their `anyOf`s multiply out) and those beside a `$ref`."""
    found = [k for k in DEPENDENCY_KEYS if k in live and isinstance(node.get(k), dict)]
    if not found or "$ref" in node or not isinstance(node.get("allOf", []), list):
        return node
    terms: list[object] = []
    for key in found:
        deps = node[key]
        assert isinstance(deps, dict)
        for name, dep in deps.items():
            absent = {"properties": {name: False}}
            if isinstance(dep, str):  # draft 3: one property
                dep = [dep]
            if dep is True or dep == {} or dep == []:
                continue
            if dep is False:
                terms.append(absent)
            elif isinstance(dep, list):
                terms.append({"anyOf": [absent, {"required": [name, *dep]}]})
            elif isinstance(dep, dict):
                terms.append({"anyOf": [absent, {"allOf": [{"required": [name]}, dep]}]})
            else:
                return node
    if len(terms) > MAX_DEPENDENCIES:
        return node
    out = {k: v for k, v in node.items() if k not in found}
    if terms:
        out["allOf"] = [*node.get("allOf", []), *terms]  # type: ignore[misc]
    return out


def merge_patterns(patterns: dict[str, object], overlaps: tuple[str, ...]) -> dict[str, object]:
    """`patternProperties` with the overlapping regexes a backend named merged into one.

    A name that matches several patterns must satisfy all their subschemas; llguidance refuses
    patterns that overlap (unanchored ones nearly always do), naming two of them as
    "/p/ and /q/". Each entry of `overlaps` is such a "p/ and /q"; p and q (or the merged
    patterns holding them) become the one pattern "(?:p)|(?:q)". It matches the same names as
    the two, so `additionalProperties` applies where it did. Its subschema is theirs when they
    are equal (exact), else their `anyOf`: every name that matches allows at least the values
    the schema allows, and `check_output` enforces the rest."""
    groups = [[p] for p in patterns]
    for pair in overlaps:
        texts = [_union(g) for g in groups]
        for a, b in ((a, b) for a in range(len(groups)) for b in range(len(groups)) if a != b):
            if pair == f"{texts[a]}/ and /{texts[b]}":
                groups[a] += groups[b]
                del groups[b]
                break
    out: dict[str, object] = {}
    for g in groups:
        subs = [patterns[p] for p in g]
        same = all(
            json.dumps(x, sort_keys=True) == json.dumps(subs[0], sort_keys=True) for x in subs
        )
        out[_union(g)] = subs[0] if same else {"anyOf": subs}
    return out


def _union(patterns: list[str]) -> str:
    return patterns[0] if len(patterns) == 1 else "|".join(f"(?:{p})" for p in patterns)


def ref_cycles(root: object) -> object:
    """`root` rewritten so that no keyword intersects a `$ref` into a cycle of references: the
    shapes llguidance refuses ("circular references with sibling keys"), as it intersects a
    definition while still compiling it.

    Such a node is a `$ref` with assertions beside it (from 2019-09 they apply beside it; up to
    draft 7 they are ignored, as jsonschema and `check_output` ignore them, and are dropped), or
    an `allOf`, or an `anyOf`/`oneOf` beside other keywords, with a member that refers into a
    cycle. It becomes a plain `$ref` to a new definition: the node with those references
    replaced by their targets, inlined once (`{"$ref": X, k: v}` -> `{k: v, "allOf": [X]}`); the
    references inside the targets stay references, one definition per distinct node, so the
    cycles now run through plain `$ref`s. Exact. Only local JSON pointers are followed; nothing
    changes in a schema with nested `$id`s (which move the base they resolve against) or whose
    inlining nests deeper than MAX_INLINE_DEPTH."""
    if not isinstance(root, dict):
        return root
    cyclic = _cyclic_refs(root)
    if not cyclic or _has_nested_id(root):
        return root
    cls = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)
    legacy = cls in LEGACY_DRAFTS
    defs: dict[str, object] = {}
    names: dict[str, str] = {}  # a node as JSON -> its definition's name

    def siblings(x: dict[str, object]) -> dict[str, object]:
        return {k: v for k, v in x.items() if k != "$ref" and k not in BESIDE_REF}

    def cyclic_ref(x: object) -> bool:
        return isinstance(x, dict) and x.get("$ref") in cyclic

    def intersects(x: object) -> bool:
        if not isinstance(x, dict):
            return False
        if cyclic_ref(x):
            return not legacy and bool(siblings(x))
        for comb in APPLICATORS:
            members = x.get(comb)
            if isinstance(members, list) and (comb == "allOf" or set(x) - BESIDE_REF - {comb}):
                if any(cyclic_ref(m) or intersects(m) for m in members):
                    return True
        return False

    def walk(x: object) -> object:
        """`x` where it stands: a node that intersects a cycle becomes a `$ref`."""
        if isinstance(x, list):
            return [walk(v) for v in x]
        if not isinstance(x, dict):
            return x
        if legacy and cyclic_ref(x):
            x = {k: v for k, v in x.items() if k not in siblings(x)}
        if not intersects(x):
            return children(x)
        key = json.dumps(x, sort_keys=True)
        if key not in names:
            names[key] = name = f"ref-cycle-{len(names)}"
            defs[name] = flat(x, 0)
        return {"$ref": f"#/$defs/{names[key]}"}

    def flat(x: object, depth: int) -> object:
        """`x` with no reference into a cycle at its top level (its targets inlined)."""
        if depth > MAX_INLINE_DEPTH:
            raise _TooDeep
        if not isinstance(x, dict):
            return walk(x)
        if cyclic_ref(x):
            ref = x["$ref"]
            assert isinstance(ref, str)
            target = flat(_resolve(root, ref), depth + 1)
            if legacy or not siblings(x):
                return target
            out = flat({k: v for k, v in x.items() if k != "$ref"}, depth + 1)
            assert isinstance(out, dict)
            return {**out, "allOf": [*out.get("allOf", []), target]}
        out = children(x, skip=APPLICATORS)
        for comb in APPLICATORS:
            if isinstance(x.get(comb), list):
                out[comb] = [flat(m, depth + 1) for m in x[comb]]  # type: ignore[union-attr]
        return out

    def children(x: dict[str, object], skip: tuple[str, ...] = ()) -> dict[str, object]:
        out: dict[str, object] = {}
        for k, v in x.items():
            if k in DATA_KEYWORDS or k in skip:
                out[k] = v
            elif k in NAMED_SUBSCHEMAS and isinstance(v, dict):
                out[k] = {name: walk(s) for name, s in v.items()}
            else:
                out[k] = walk(v)
        return out

    try:
        out = walk(root)
    except _TooDeep:
        return root
    assert isinstance(out, dict)
    if defs:
        out["$defs"] = {**out.get("$defs", {}), **defs}
    return out


class _TooDeep(Exception):
    pass


def _cyclic_refs(root: dict[str, object]) -> set[str]:
    """The local `$ref`s of `root` whose target can reach itself through `$ref`s (definitions
    are reached only through references: a target's own are not followed)."""
    inside: dict[str, set[str]] = {}
    todo = sorted(_refs_in(root, skip_defs=False))
    while todo:
        ref = todo.pop()
        if ref not in inside:
            inside[ref] = _refs_in(_resolve(root, ref), skip_defs=True)
            todo += inside[ref] - inside.keys()
    cyclic = set()
    for start in inside:
        seen, stack = set(), list(inside[start])
        while stack and start not in seen:
            r = stack.pop()
            if r not in seen:
                seen.add(r)
                stack += inside.get(r, ())
        if start in seen:
            cyclic.add(start)
    return cyclic


def _refs_in(node: object, skip_defs: bool) -> set[str]:
    skip = frozenset(DATA_KEYWORDS) | ({"definitions", "$defs"} if skip_defs else set())
    return {x["$ref"] for x in _schemas(node, skip)
            if isinstance(x.get("$ref"), str) and x["$ref"].startswith("#")}


def _schemas(node: object, skip: frozenset[str]) -> Iterator[dict]:
    """Every schema object in `node` (a schema or a list of them), `node` itself first, not
    looking under the keys in `skip`. In a map of names to schemas (`properties`, `$defs`,
    ...) the values are schemas and the names are not."""
    stack: list[tuple[object, bool]] = [(node, False)]  # (node, a map of names to schemas)
    while stack:
        x, names = stack.pop()
        if isinstance(x, list):
            stack += [(v, False) for v in x]
        elif isinstance(x, dict) and names:
            stack += [(v, False) for v in x.values()]
        elif isinstance(x, dict):
            yield x
            stack += [(v, k in NAMED_SUBSCHEMAS) for k, v in x.items() if k not in skip]


def _resolve(root: object, ref: str) -> object:
    """The subschema a local JSON pointer `#/a/b` names in `root`; `{}` when it names none."""
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return {}
    return node


def _has_nested_id(root: dict[str, object]) -> bool:
    """Whether a subschema below `root` sets its own base URI (`$id`, or draft 4's `id`)."""
    below = itertools.islice(_schemas(root, frozenset(DATA_KEYWORDS)), 1, None)  # not root
    return any(isinstance(x.get("$id"), str) or isinstance(x.get("id"), str) for x in below)


def rewrite_schema(
    node: object,
    drop_keys: frozenset[str] = frozenset(),
    drop_formats: frozenset[str] = frozenset(),
    overlaps: tuple[str, ...] = (),
    cycles: bool = False,
) -> object:
    """`node` with ECMA `pattern`s, without the keywords `drop_keys` and without the
    `"format"`s named in `drop_formats`, in every subschema; the `patternProperties` that
    `overlaps` names merged (`merge_patterns`); with `cycles`, no keyword intersecting a
    `$ref` into a cycle (`ref_cycles`); dependencies as `anyOf`s (`dependencies_as_any_of`);
    up to draft 7, without the keywords beside a `$ref` (that draft ignores them)."""
    cls = jsonschema.validators.validator_for(node, default=jsonschema.Draft202012Validator)
    live = frozenset(DEPENDENCY_KEYS) & cls.VALIDATORS.keys()
    legacy = cls in LEGACY_DRAFTS

    def walk(x: object) -> object:
        if isinstance(x, list):
            return [walk(v) for v in x]
        if not isinstance(x, dict):
            return x
        if legacy and isinstance(x.get("$ref"), str):
            # Up to draft 7 a `$ref`'s siblings are ignored; llguidance would apply them.
            x = {k: v for k, v in x.items() if k == "$ref" or k in BESIDE_REF}
        x = dependencies_as_any_of(x, live)
        out: dict[str, object] = {}
        for k, v in x.items():
            if k in drop_keys or (k == "format" and isinstance(v, str) and v in drop_formats):
                continue
            if k in DATA_KEYWORDS:
                out[k] = v
            elif k == "pattern" and isinstance(v, str):
                out[k] = ascii_digits(v)
            elif k == "patternProperties" and isinstance(v, dict):
                pp = {ascii_digits(p): walk(s) for p, s in v.items()}
                out[k] = merge_patterns(pp, overlaps) if overlaps and len(pp) > 1 else pp
            elif k == "oneOf" and isinstance(v, list) and (disjoint := disjoint_one_of(v)):
                out[k] = walk(disjoint)
            elif k in NAMED_SUBSCHEMAS and isinstance(v, dict):
                out[k] = {name: walk(s) for name, s in v.items()}
            else:
                out[k] = walk(v)
        return out

    return walk(ref_cycles(node) if cycles else node)
