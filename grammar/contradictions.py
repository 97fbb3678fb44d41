"""Contradictions in a JSON schema: keywords that together leave no value, found before any
backend compiles the schema, and refused with a message naming the keywords and where they are.

`check_schema` looks where every valid value must pass: the root, its `allOf` branches and the
definitions their `$ref`s name, its required properties, and so on down. A contradiction
elsewhere (in an optional property, one anyOf branch) only rules that part out: real schemas
have such dead parts (an optional property whose `enum` fails its `type`), and their other
values are still valid. `check_conjuncts` reads the schemas that must all hold at one place and
raises `GrammarError` on:
- `type`s with no value in common;
- `enum`s and `const`s with no value in common, or whose values all fail the `type`;
- bounds that exclude each other: `minimum` above `maximum` (or equal, one exclusive), no integer
  between them for an integer, `minLength` above `maxLength`, `minItems` above `maxItems`,
  `minProperties` above `maxProperties` (or below the `required` count), `minContains` above
  `maxContains`; only where `type` allows that kind of value (a string's bounds do not bind an
  integer);
- a `required` property that `additionalProperties: false` forbids, or whose own schema nothing
  satisfies (`false`, `not: {}`).

Where it must hold, a schema that is `false` or `not: {}`, or whose every anyOf (oneOf) branch is
contradictory, is refused too. A property that is not required may be `false` or `not: {}`:
that forbids it (an idiom).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

from grammar.spec import GrammarError, JSONSchema

Path = tuple[str, ...]
Part = tuple[object, Path]  # a schema that must hold, and where it is
Obj = tuple[dict[str, Any], Path]  # one that is an object
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated",
                         "readOnly", "writeOnly"})  # fmt: skip
MAX_VISITS = 1_024  # places `check_schema` looks at; past them it stops looking
MAX_DEPTH = 48  # and how deep it follows required properties and anyOf branches
TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")
# Bound keywords: (lower, upper, the kind of value they bind).
LENGTHS = (
    ("minLength", "maxLength", "string"),
    ("minItems", "maxItems", "array"),
    ("minProperties", "maxProperties", "object"),
    ("minContains", "maxContains", "array"),
)


def pointer(path: Path) -> str:
    """`path` as a JSON pointer; `(root)` for the root."""
    if not path:
        return "(root)"
    return "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in path)


class Contradiction(GrammarError):
    """Keywords of a JSON schema that leave no value where one must pass: a 400."""

    def __init__(self, at: Path, what: str, param: str | None):
        super().__init__(
            f"contradictory JSON schema at {pointer(at)}: {what}; no value can satisfy it", param
        )
        self.at, self.what = at, what


def refuse(at: Path, what: str, param: str | None) -> Contradiction:
    return Contradiction(at, what, param)


def types_of(value: object) -> list[str] | None:
    """A `type` keyword's types; None when absent or not a valid `type`."""
    if isinstance(value, str) and value in TYPES:
        return [value]
    if isinstance(value, list) and value and all(isinstance(t, str) and t in TYPES for t in value):
        return list(value)
    return None


def meet(a: list[str], b: list[str]) -> list[str]:
    """The types both `a` and `b` allow ("integer" is within "number")."""
    out = [t for t in a if t in b or (t == "integer" and "number" in b)]
    return out + [t for t in b if t == "integer" and "number" in a and t not in out]


def allows(types: list[str] | None, kind: str) -> bool:
    return types is None or kind in types or (kind == "number" and "integer" in types)


def has_type(value: object, types: list[str]) -> bool:
    """Whether the JSON `value` is of one of `types` (1.0 counts as an integer)."""
    if value is None:
        return "null" in types
    if isinstance(value, bool):
        return "boolean" in types
    if isinstance(value, int | float):
        whole = isinstance(value, int) or value.is_integer()
        return "number" in types or ("integer" in types and whole)
    kinds: dict[type, str] = {str: "string", list: "array", dict: "object"}
    return kinds.get(type(value)) in types


def value_key(value: object) -> object:
    """A hashable key under which JSON values are equal iff JSON Schema says they are (1 == 1.0,
    but true != 1)."""
    if isinstance(value, bool) or value is None:
        return ("c", value)
    if isinstance(value, int | float):
        return ("n", value)
    if isinstance(value, list):
        return ("l", tuple(value_key(v) for v in value))
    if isinstance(value, dict):
        return ("d", frozenset((k, value_key(v)) for k, v in value.items()))
    return ("s", value)


def path_of(pointer_text: str) -> Path:
    """The path of a JSON pointer (`/a/b`), percent- and `~`-decoded."""
    tokens = unquote(pointer_text).split("/")[1:]
    return tuple(t.replace("~1", "/").replace("~0", "~") for t in tokens)


def lookup(root: object, path: Path) -> object | None:
    """The value at `path` in `root`; None where there is none."""
    x = root
    for token in path:
        if isinstance(x, dict) and token in x:
            x = x[token]
        elif isinstance(x, list) and token.isdigit() and int(token) < len(x):
            x = x[int(token)]
        else:
            return None
    return x


def unsatisfiable(schema: object, nested: bool = True) -> str | None:
    """Why nothing satisfies `schema` when that is plain from its top (`false`, `not: {}`, an
    empty enum; `nested`: an allOf branch so, every anyOf/oneOf branch so); None otherwise."""
    if schema is False:
        return "is `false`"
    if not isinstance(schema, dict):
        return None
    n = schema.get("not")
    if n is True or (isinstance(n, dict) and n.keys() <= ANNOTATIONS):
        return f"is `not: {_show(n)}`"
    if schema.get("enum") == []:
        return "has an empty `enum`"
    if not nested:
        return None
    branches = schema.get("allOf")
    if isinstance(branches, list):
        for b in branches:
            if why := unsatisfiable(b):
                return f"has an allOf branch that {why}"
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches and all(map(unsatisfiable, branches)):
            return f"has no {key} branch that can hold"
    return None


def _show(value: object) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 80 else text[:77] + "..."


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_schema(
    root: JSONSchema, param: str | None, legacy: bool, opaque: Callable[[], bool]
) -> None:
    """Raise GrammarError on a contradiction where every valid value must pass (see the module's
    docstring). `legacy`: a `$ref`'s siblings are ignored (up to draft 7); `opaque()`: `#/...`
    pointers may not be read from the root (a nested `$id`), so `$ref`s are not followed."""
    if isinstance(root, dict):
        _MustHold(root, param, legacy, opaque).visit([(root, ())], ())


class _MustHold:
    def __init__(
        self, root: dict[str, object], param: str | None, legacy: bool, opaque: Callable[[], bool]
    ):
        self.root, self.param, self.legacy, self.opaque = root, param, legacy, opaque
        self.seen: set[frozenset[Path]] = set()
        self.visits = 0

    def visit(self, parts: list[Part], at: Path, depth: int = 0) -> None:
        """Check the schemas `parts`, which must all hold at `at`, then where they lead."""
        parts = self._expand(parts)
        key = frozenset(p for _, p in parts)
        self.visits += 1
        if key in self.seen or self.visits > MAX_VISITS or depth > MAX_DEPTH:
            return
        self.seen.add(key)
        try:
            types = check_conjuncts(parts, at, self.param)
            for s, p in parts:
                if why := unsatisfiable(s, nested=False):  # its branches are parts too
                    raise refuse(p, f"the schema there {why}", self.param)
            for s, p in parts:
                for key_ in ("anyOf", "oneOf"):
                    if isinstance(s, dict) and isinstance(s.get(key_), list) and s[key_]:
                        self._some_branch(parts, s[key_], (*p, key_), at, depth)
        except Contradiction:
            self.seen.discard(key)
            raise
        if not allows(types, "object"):
            return
        for name in _required(parts):
            sub = [(s["properties"][name], (*p, "properties", name)) for s, p in parts
                   if isinstance(s, dict) and isinstance(s.get("properties"), dict)
                   and name in s["properties"]]
            if sub:
                self.visit(sub, sub[0][1], depth + 1)

    def _some_branch(self, parts: list[Part], branches: list[object], where: Path,
                     at: Path, depth: int) -> None:
        """Raise when no branch of the anyOf (oneOf) at `where` can hold beside `parts`."""
        plain = [({k: v for k, v in s.items() if k not in ("anyOf", "oneOf")}, p)
                 if isinstance(s, dict) else (s, p) for s, p in parts]
        first: Contradiction | None = None
        for i, b in enumerate(branches):
            try:
                self.visit([*plain, (b, (*where, str(i)))], at, depth + 1)
                return
            except Contradiction as e:
                first = first or e
        assert first is not None
        raise refuse(at, f"no branch of the {where[-1]} at {pointer(where[:-1])} can hold "
                         f"(branch 0, at {pointer(first.at)}: {first.what})", self.param)

    def _expand(self, parts: list[Part]) -> list[Part]:
        """`parts` with their allOf branches and the local definitions their `$ref`s name."""
        out: list[Part] = []
        seen: set[Path] = set()
        todo = list(parts)
        while todo and len(out) < 256:
            s, p = todo.pop(0)
            if p in seen:
                continue
            seen.add(p)
            if isinstance(s, dict):
                ref = s.get("$ref")
                if isinstance(ref, str) and (target := self._resolve(ref)) is not None:
                    todo.append(target)
                if self.legacy and "$ref" in s:
                    continue  # its siblings are ignored
                if isinstance(s.get("allOf"), list):
                    todo += [(b, (*p, "allOf", str(i))) for i, b in enumerate(s["allOf"])]
            out.append((s, p))
        return out

    def _resolve(self, ref: str) -> Part | None:
        if not (ref == "#" or ref.startswith("#/")) or self.opaque():
            return None
        path = path_of(ref[1:])
        target = lookup(self.root, path)
        return (target, path) if isinstance(target, dict | bool) else None


def _required(parts: list[Part]) -> list[str]:
    out: dict[str, None] = {}
    for s, _ in parts:
        names = s.get("required") if isinstance(s, dict) else None
        if isinstance(names, list):
            out.update((n, None) for n in names if isinstance(n, str))
    return list(out)


def check_conjuncts(parts: list[Part], at: Path, param: str | None) -> list[str] | None:
    """Raise GrammarError when the schemas of `parts`, which must all hold at `at`, contradict
    each other (or one contradicts itself); else return the types they allow (None: any).
    Parts that are not objects are skipped."""
    objs: list[Obj] = [(s, p) for s, p in parts if isinstance(s, dict)]
    types = _check_types(objs, at, param)
    _check_values(objs, types, at, param)
    if allows(types, "number"):
        _check_numbers(objs, types, at, param)
    contains = any("contains" in s for s, _ in objs)  # min/maxContains bind nothing without
    for lo_key, hi_key, kind in LENGTHS:
        if allows(types, kind) and (contains or lo_key != "minContains"):
            _check_length(objs, lo_key, hi_key, at, param)
    if allows(types, "object"):
        _check_required(objs, at, param)
    return types


def _check_types(objs: list[Obj], at: Path, param: str | None) -> list[str] | None:
    types: list[str] | None = None
    seen: list[tuple[object, Path]] = []
    for s, p in objs:
        t = types_of(s.get("type"))
        if t is None:
            continue
        types = t if types is None else meet(types, t)
        if not types:
            (before, where), *_ = seen[-1:] or [(t, p)]
            raise refuse(at, f"type {_show(before)} at {pointer(where)} and type "
                             f"{_show(s['type'])} at {pointer(p)} have no value in common", param)
        seen.append((s["type"], p))
    return types


def _check_values(objs: list[Obj], types: list[str] | None, at: Path, param: str | None) -> None:
    values: list[object] | None = None
    last = ""
    for s, p in objs:
        for key in ("const", "enum"):
            if key not in s or (key == "enum" and not isinstance(s[key], list)):
                continue
            vals = [s[key]] if key == "const" else s[key]
            if values is not None:
                keys = {value_key(v) for v in vals}
                values = [v for v in values if value_key(v) in keys]
                if not values:
                    raise refuse(at, f"{last} and {key} {_show(s[key])} at {pointer(p)} have "
                                     "no value in common", param)
            else:
                values = list(vals)
            last = f"{key} {_show(s[key])} at {pointer(p)}"
    if values and types is not None and not any(has_type(v, types) for v in values):
        raise refuse(at, f"{last}: no value has type {_show(types)}", param)


def _check_numbers(objs: list[Obj], types: list[str] | None, at: Path, param: str | None) -> None:
    # (bound, exclusive, what, where) from every part; draft-04 exclusives are booleans.
    lows: list[tuple[float, bool, str, Path]] = []
    highs: list[tuple[float, bool, str, Path]] = []
    for s, p in objs:
        for key, ex_key, out in (("minimum", "exclusiveMinimum", lows),
                                 ("maximum", "exclusiveMaximum", highs)):
            v, ex = s.get(key), s.get(ex_key)
            if isinstance(v, int | float) and not isinstance(v, bool):
                what = f"{key} {v}" + (f" ({ex_key}: true)" if ex is True else "")
                out.append((v, ex is True, what, p))
            if isinstance(ex, int | float) and not isinstance(ex, bool):
                out.append((ex, True, f"{ex_key} {ex}", p))
    for lo, lo_ex, lo_what, lo_at in lows:
        for hi, hi_ex, hi_what, hi_at in highs:
            if lo > hi or (lo == hi and (lo_ex or hi_ex)):
                raise refuse(at, f"{lo_what} at {pointer(lo_at)} and {hi_what} at "
                                 f"{pointer(hi_at)} leave no number between them", param)
    if lows and highs and types == ["integer"]:
        first = max(((math.floor(v) + 1 if ex else math.ceil(v)), w, p) for v, ex, w, p in lows)
        last = min(((math.ceil(v) - 1 if ex else math.floor(v)), w, p) for v, ex, w, p in highs)
        if first[0] > last[0]:
            raise refuse(at, f"{first[1]} at {pointer(first[2])} and {last[1]} at "
                             f"{pointer(last[2])} leave no integer between them", param)


def _check_length(objs: list[Obj], lo_key: str, hi_key: str, at: Path, param: str | None) -> None:
    lows = [(s[lo_key], p) for s, p in objs if _number(s.get(lo_key))]
    highs = [(s[hi_key], p) for s, p in objs if _number(s.get(hi_key))]
    if lows and highs:
        lo, lo_at = max(lows, key=lambda x: x[0])
        hi, hi_at = min(highs, key=lambda x: x[0])
        if lo > hi:
            raise refuse(at, f"{lo_key} {lo} at {pointer(lo_at)} is above {hi_key} {hi} at "
                             f"{pointer(hi_at)}", param)


def _check_required(objs: list[Obj], at: Path, param: str | None) -> None:
    required: dict[str, Path] = {}
    for s, p in objs:
        names = s.get("required")
        if isinstance(names, list):
            required.update((n, p) for n in names if isinstance(n, str) and n not in required)
    if not required:
        return
    caps = [(s["maxProperties"], p) for s, p in objs if _number(s.get("maxProperties"))]
    if caps:
        cap, cap_at = min(caps, key=lambda x: x[0])
        if len(required) > cap:
            raise refuse(at, f"required names {len(required)} properties but maxProperties at "
                             f"{pointer(cap_at)} is {cap}", param)
    for s, p in objs:
        props = s.get("properties")
        props = props if isinstance(props, dict) else {}
        closed = s.get("additionalProperties") is False and "patternProperties" not in s
        for name, where in required.items():
            if name in props:
                if why := unsatisfiable(props[name]):
                    path = pointer((*p, "properties", name))
                    raise refuse(at, f"the required property {name!r} (required at "
                                     f"{pointer(where)}) {why} at {path}", param)
            elif closed:
                raise refuse(at, f"the required property {name!r} (required at "
                                 f"{pointer(where)}) is not in properties and "
                                 f"additionalProperties is false at {pointer(p)}", param)
