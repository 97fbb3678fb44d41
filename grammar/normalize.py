"""The JSON schema every backend compiles: the request's schema with its meaning, and only its
meaning, kept; contradictions refused first (grammar/contradictions.py).

- Annotations (`title`, `description`, `default`, `examples`, `$comment`, `deprecated`,
  `readOnly`, `writeOnly`; `$schema` below the root) constrain nothing and are dropped, so no
  backend can read them as constraints. `$id` and the root's `$schema` stay: they decide where
  `$ref`s point and which draft the keywords follow.
- `allOf` branches are merged into their parent where the keywords allow it (grammar/merge.py);
  a branch that cannot be merged stays in `allOf`. llguidance generates an object's properties
  in the order it meets them (keys in order, allOf branches where the allOf is): a branch merges
  only where that order stays the same.
- A `$ref` is kept as it is; a branch that is only a `$ref` to a local definition is merged
  (a copy of the definition) when the definition is small and not recursive. A node that some
  `$ref`'s JSON pointer goes into keeps its shape there.

`normalize_spec` is called once per compile, by `GrammarCompiler`, before any backend.
"""

from __future__ import annotations

import json
from dataclasses import replace
from functools import cached_property

import jsonschema

from grammar.contradictions import (
    ANNOTATIONS,
    Part,
    Path,
    check_schema,
    lookup,
    path_of,
)
from grammar.merge import KEEPS_ALL_OF, REFS, absorb, assemble
from grammar.spec import (
    DATA_KEYWORDS,
    ConstraintSpec,
    GrammarError,
    JSONSchema,
    more_nodes_than,
)

ONE_SCHEMA = frozenset({"additionalProperties", "additionalItems", "contains", "not", "if", "then",
                        "else", "propertyNames", "unevaluatedItems", "unevaluatedProperties",
                        "contentSchema", "items"})  # fmt: skip
SCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "definitions", "$defs",
                           "dependentSchemas", "dependencies"})  # fmt: skip
MAX_INLINED_NODES = 256  # a definition merged in place of a `$ref` branch is at most this big


def normalize_spec(spec: ConstraintSpec) -> ConstraintSpec:
    """`spec` with its JSON schema (or each tool's parameters) normalized; the same object when
    nothing changed. Raises GrammarError (param: the spec's) on a contradiction. A schema this
    cannot read (nested past the recursion limit, say) goes to the backends as it is."""
    try:
        return _normalize_spec(spec)
    except GrammarError:
        raise
    except Exception:
        return spec


def _normalize_spec(spec: ConstraintSpec) -> ConstraintSpec:
    if spec.kind == "json_schema":
        schema = spec.schema()
        out = normalize_schema(schema, spec.param)
        return spec if out is schema else replace(spec, payload=_dumps(out))
    if spec.kind == "tool_calls":
        assert isinstance(spec.payload, str)
        payload = json.loads(spec.payload)
        changed = False
        for tool in payload["tools"]:
            try:
                params = normalize_schema(tool["parameters"], spec.param)
            except GrammarError as e:
                raise GrammarError(f"tool {tool['name']!r}: {e.message}", e.param) from None
            changed |= params is not tool["parameters"]
            tool["parameters"] = params
        return replace(spec, payload=_dumps(payload)) if changed else spec
    return spec


def normalize_schema(schema: JSONSchema, param: str | None = None) -> JSONSchema:
    """`schema` normalized (the same object when nothing changed); raises GrammarError naming
    the keywords and the JSON pointer of a contradiction."""
    if not isinstance(schema, dict):
        if schema is False:
            raise GrammarError("the JSON schema is `false`: no value can satisfy it", param)
        return schema
    n = _Normalizer(schema)
    check_schema(schema, param, n.legacy, lambda: n.opaque)
    out = n.node(schema, ())
    assert isinstance(out, dict)
    return out


def _dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class _Normalizer:
    """One schema's normalization. Subschemas are normalized children first; each node is
    memoized by its path (a `$ref` branch's definition may be normalized before the walk gets
    there)."""

    def __init__(self, root: dict[str, object]):
        self.root = root
        cls = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)
        # Up to draft 7 a `$ref` makes its siblings ignored.
        self.legacy = cls in (jsonschema.Draft3Validator, jsonschema.Draft4Validator,
                              jsonschema.Draft6Validator, jsonschema.Draft7Validator)
        self.refs_below: dict[Path, set[Path]] = {}
        self.done: dict[Path, object] = {}
        self.active: set[Path] = set()

    @cached_property
    def _refs(self) -> tuple[set[Path], bool]:
        return ref_targets(self.root)

    @cached_property
    def opaque(self) -> bool:
        """Whether some `$ref` may point where `ref_targets` cannot tell: nothing is merged."""
        return self._refs[1]

    @cached_property
    def pinned(self) -> set[Path]:
        """The paths some `$ref` points to or through: their shape is kept."""
        return {t[:i] for t in self._refs[0] for i in range(1, len(t) + 1)}

    def node(self, x: object, path: Path) -> object:
        if not isinstance(x, dict):
            return x
        if path in self.done:
            return self.done[path]
        if self.legacy and "$ref" in x:  # the rest is ignored; left as it is
            return x
        self.active.add(path)
        out: dict[str, object] = {}
        changed = False
        for k, v in x.items():
            if k in ANNOTATIONS or (k == "$schema" and path and "$id" not in x):
                changed = True
                continue
            t = type(v)
            if t is not dict and t is not list and t is not bool:
                out[k] = v
                continue
            nv = self._child(k, v, path)
            changed |= nv is not v
            out[k] = nv
        if isinstance(out.get("allOf"), list) and not self.opaque:
            merged = self._merge_all_of(out, path)
            changed |= merged is not out
            out = merged
        self.active.discard(path)
        self.done[path] = result = out if changed else x
        return result

    def _child(self, k: str, v: object, path: Path) -> object:
        if k in DATA_KEYWORDS:
            return v
        if k in NAMED_SCHEMAS and isinstance(v, dict):
            out = {n: self.node(s, (*path, k, n)) for n, s in v.items()}
            return v if all(out[n] is v[n] for n in v) else out
        if k in SCHEMA_LISTS and isinstance(v, list):
            items = [self.node(s, (*path, k, str(i))) for i, s in enumerate(v)]
            return v if all(a is b for a, b in zip(items, v, strict=True)) else items
        if k in ONE_SCHEMA:
            return self.node(v, (*path, k))
        return v

    # -- allOf ---------------------------------------------------------------------------

    def _merge_all_of(self, node: dict[str, object], path: Path) -> dict[str, object]:
        """`node` with the allOf branches that can merge merged, each only where llguidance's
        order of the properties stays the same."""
        if (*path, "allOf") in self.pinned or KEEPS_ALL_OF & node.keys():
            return node
        order = self._order(node)
        keys = list(node)
        pre, post = keys[: keys.index("allOf")], keys[keys.index("allOf") + 1 :]
        base = {k: v for k, v in node.items() if k != "allOf"}
        early: list[str] = []  # keys the branches before the first kept one brought
        late: list[str] = []  # and the later ones
        kept: list[object] = []
        branches: list[object] = node["allOf"]  # type: ignore[assignment]
        for i, b in enumerate(branches):
            target, where = self._resolve(b, (*path, "allOf", str(i))) or (b, path)
            if target is True or target == {}:
                continue
            trial, trial_kept = dict(base), list(kept)
            if isinstance(target, dict) and absorb(
                trial, target, path, where, trial_kept, self._both
            ):
                new = [k for k in trial if k not in base]
                rest = trial_kept + branches[i + 1 :]
                if kept:
                    cand = assemble(trial, pre, early, rest, late + new, post)
                else:
                    cand = assemble(trial, pre, early + new, rest, late, post)
                if self._keeps_order(cand, order):
                    base, kept = trial, trial_kept
                    (late if kept else early).extend(new)
                    continue
            kept.append(b)
        out = assemble(base, pre, early, kept, late, post)
        return self._in_order(out, order)

    def _order(self, s: object, depth: int = 0) -> list[str]:
        """The property names of `s` in the order llguidance meets them (first ones)."""
        return list(dict.fromkeys(self._names(s, depth)))

    def _names(self, s: object, depth: int) -> list[str]:
        if not isinstance(s, dict) or depth > 8:
            return []
        out: list[str] = []
        for k, v in s.items():
            if k == "properties" and isinstance(v, dict):
                out += v
            elif k in ("allOf", "anyOf", "oneOf") and isinstance(v, list):
                for b in v:
                    out += self._names(b, depth + 1)
            elif k == "$ref" and (target := self._local(v)) is not None:
                out += self._names(lookup(self.root, target), depth + 1)
        return out

    def _in_order(self, s: dict[str, object], order: list[str]) -> dict[str, object]:
        """`s` with its `properties` in `order` (meaning the same)."""
        props = s.get("properties")
        if not isinstance(props, dict) or len(props) < 2:
            return s
        rank = {n: i for i, n in enumerate(order)}
        names = sorted(props, key=lambda n: rank.get(n, len(rank)))
        if names == list(props):
            return s
        return {**s, "properties": {n: props[n] for n in names}}

    def _keeps_order(self, cand: dict[str, object], order: list[str]) -> bool:
        return self._order(self._in_order(cand, order)) == order

    def _resolve(self, b: object, path: Path) -> Part | None:
        """`b` itself, or for a branch that is only a `$ref` (up to draft 7, any `$ref`
        branch) the normalized local definition it names; None where that does not resolve
        here (remote, recursive, too big)."""
        if not isinstance(b, dict) or "$ref" not in b:
            return b, path
        if not self.legacy and len(b) > 1:
            return b, path
        target = self._local(b["$ref"])
        if target is None or target in self.active or self._recursive(target, path):
            return None
        x = lookup(self.root, target)
        if not isinstance(x, dict | bool) or more_nodes_than(x, MAX_INLINED_NODES):
            return None
        return self.node(x, target), target

    def _local(self, ref: object) -> Path | None:
        """The path of a `#/$defs/...` or `#/definitions/...` reference (not resolved under a
        nested `$id`: the schema has none), else None."""
        if self.opaque or not isinstance(ref, str) or not ref.startswith("#/"):
            return None
        path = path_of(ref[1:])
        return path if path[:1] in (("$defs",), ("definitions",)) and len(path) > 1 else None

    def _recursive(self, target: Path, site: Path) -> bool:
        """Whether the definition at `target` refers, through any chain of `$ref`s, to itself,
        to a node around it or to a node around `site` (where it would be merged)."""
        seen, todo = {target}, [target]
        while todo:
            for r in self._refs_below(todo.pop()):
                if target[: len(r)] == r or site[: len(r)] == r:
                    return True
                if r not in seen:
                    seen.add(r)
                    todo.append(r)
        return False

    def _refs_below(self, path: Path) -> set[Path]:
        if path not in self.refs_below:
            targets, opaque = ref_targets(lookup(self.root, path))
            self.refs_below[path] = targets | ({()} if opaque else set())
        return self.refs_below[path]

    def _both(self, a: object, a_at: Path, b: object, b_at: Path) -> object | None:
        """A schema meaning `a` and `b` (both normalized), merged as far as it goes; None when
        the place `a` is at cannot change (a `$ref` points into it)."""
        if a_at in self.pinned:
            return None
        if a is True or a == {}:
            return b
        if b is True or b == {} or a is False:
            return a
        if b is False:
            return b
        if not isinstance(a, dict) or not isinstance(b, dict):
            return None
        if self.legacy and "$ref" in a:  # a sibling of its `$ref` would be ignored
            return {"allOf": [a, b]}
        both = {"allOf": [a, b]}
        base = {k: v for k, v in a.items() if k != "allOf"}
        kept = list(a.get("allOf", []))  # type: ignore[call-overload]
        if KEEPS_ALL_OF & base.keys() or not absorb(base, b, a_at, b_at, kept, self._both):
            return both
        if kept:
            base["allOf"] = kept
        order = self._order(both)
        return self._in_order(base, order) if self._keeps_order(base, order) else both


_REF_OR_ID = frozenset({*REFS, "$id", "id"})


def ref_targets(node: object) -> tuple[set[Path], bool]:
    """The paths (from `node`) the JSON-pointer `$ref`s under `node` point to, and whether some
    `$ref` may point where this cannot tell (another resource's pointer, a nested `$id`)."""
    targets: set[Path] = set()
    opaque = False
    stack = [node]
    push = stack.append
    while stack:  # a hot loop on large schemas: `type(...) is` over isinstance
        x = stack.pop()
        if type(x) is list:
            for v in x:
                if type(v) is dict or type(v) is list:
                    push(v)
            continue
        assert isinstance(x, dict)
        for k, v in x.items():
            t = type(v)
            if t is str:
                if k not in _REF_OR_ID:
                    continue
                if k in ("$id", "id"):  # a new base URI below the root (`id` up to draft 4)
                    opaque |= x is not node and not v.startswith("#")
                elif v.startswith("#/") or v == "#":
                    targets.add(path_of(v[1:]))
                elif "#/" in v or not v.startswith("#"):
                    opaque = True
            elif (t is dict or t is list) and k not in DATA_KEYWORDS:
                push(v)
    return targets, opaque

