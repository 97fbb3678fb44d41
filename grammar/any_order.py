"""JSON objects whose properties may come in any order, for llguidance.

llguidance writes an object's declared properties in the order its schema lists them, and
undeclared ones after those. JSON Schema gives properties no order, and models (and MaskBench's
valid instances) often use another. `any_order_lark` writes the schema as a Lark grammar in
which objects take their members in any order, and the rest stays llguidance's own JSON
grammar (`%json` leaves):

- an object rule walks the set of keys written so far: each member is a declared property not
  yet written, a key its one `patternProperties` regex matches (simple regexes only), or an
  undeclared key (a string other than the declared names) where `additionalProperties` allows
  one; the object may close once every `required` key is in. Pattern and undeclared keys come
  only once the required keys are in (llguidance puts them after every declared one): a guide
  for the model, stricter than the schema. Exact when the object declares at
  most EXACT_UP_TO properties; above that only the required ones are tracked (2**MAX_TRACKED
  states at most), and an optional property may repeat, which JSON parsers read as its last
  value, checked by `check_output` like any other output;
- arrays of such objects, `anyOf`/`oneOf` over them (oneOf read as anyOf, as llguidance's
  `coerce_one_of`), an object beside a `oneOf` of fragments that only add properties and
  required keys (merged into each branch), `type` lists, and local `$ref`s (recursion included)
  become rules too;
- a subschema with no object of two or more properties below it is a leaf: scalar types and
  string enums as lexemes, the rest one `%json` leaf carrying the definitions its `$ref`s reach.
  llguidance never enters a `%json` leaf where an outer lexeme also matches, so a union keeps
  no leaf beside a rule whose values start the same way (`_Writer.starts`).

None when nothing in the schema gains, when it holds a `$ref` that is not a local definition,
or when the rules pass MAX_GRAMMAR_BYTES; the caller then compiles the schema as JSON.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from typing import Any

from grammar.lark_json import key_regex, lexemes, literal, scalars
from grammar.merge import OBJECT_KEYWORDS, merge_object_branch
from grammar.rewrite import _resolve
from grammar.spec import SCHEMA_KEYWORDS

EXACT_UP_TO = 3  # objects of this many properties or fewer track every key: no repeats
MAX_TRACKED = 5  # required keys an object rule tracks: at most 2**5 states
MAX_PROPERTIES = 128  # declared properties of an object written in any order
# llguidance compiles a Lark grammar ~3x slower than the JSON schema it stands for (median
# 6.6 against 1.9 ms over the dev split); above this size, the ordered JSON grammar is kept so
# that large schemas (Kubernetes, 100-350 KB of rules) do not pay 100-900 ms.
MAX_GRAMMAR_BYTES = 24_000
DEFS = ("$defs", "definitions")
MEMBERS = frozenset({"properties", "patternProperties", "additionalProperties"})
ARRAY_KEYS = frozenset({"type", "items", "minItems"})
UNIONS = ("anyOf", "oneOf")
TYPES = ("object", "string", "number", "integer", "boolean", "null", "array")
DATA = frozenset({"enum", "const", "default", "examples"})  # instances, not schemas
BASES = frozenset({"$id", "id", "$anchor", "$dynamicRef", "$dynamicAnchor", "$recursiveRef"})


def any_order_lark(schema: object, json_options: dict[str, Any], max_ws: int) -> str | None:
    """The Lark grammar of `schema` with its objects' members in any order (module doc), or
    None where it would not differ from llguidance's JSON grammar or cannot be written."""
    rules = any_order_rules(schema, json_options)
    if rules is None:
        return None
    return "\n".join([f"start: {rules[0]}", *lexemes(max_ws), *rules[1]])


def any_order_rules(
    schema: object, json_options: dict[str, Any], prefix: str = ""
) -> tuple[str, list[str]] | None:
    """(the start rule, every rule) of `schema` written as in `any_order_lark`, the rule names
    starting with `prefix` (lowercase), for a grammar that also holds `lexemes`; or None."""
    if not isinstance(schema, dict) or not _local_refs_only(schema):
        return None
    writer = _Writer(schema, json_options, prefix)
    if not writer.gains(schema):
        return None
    try:
        return writer.rule(schema), writer.lines
    except _TooLarge:
        return None


def _local_refs_only(node: object, root: bool = True) -> bool:
    """Whether every `$ref` below `node` points into the root's definitions, and no subschema
    below the root sets a base URI (a fragment-only `id` does not): a leaf carries those
    definitions along, and any other target would mean something else inside a leaf. (A
    property named like a keyword makes this answer False: only a missed chance.)"""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref" and (not isinstance(v, str) or _def_name(v) is None):
                return False
            if k in BASES and isinstance(v, str) and not root and not v.startswith("#"):
                return False
            if k not in DATA and not _local_refs_only(v, root=False):
                return False
    elif isinstance(node, list):
        return all(_local_refs_only(v, root=False) for v in node)
    return True


def _def_name(ref: str) -> tuple[str, str] | None:
    """("$defs" or "definitions", name) of a `#/$defs/name...` reference, else None."""
    parts = ref.split("/")
    if len(parts) < 3 or parts[0] != "#" or parts[1] not in DEFS:
        return None
    return parts[1], _unescape(parts[2])


def _unescape(segment: str) -> str:
    return urllib.parse.unquote(segment).replace("~1", "/").replace("~0", "~")


class _TooLarge(Exception):
    """The rules passed MAX_GRAMMAR_BYTES."""


class _Writer:
    """Writes rules for the nodes of one schema; `lines` holds them in order."""

    def __init__(self, root: dict[str, Any], json_options: dict[str, Any], prefix: str):
        self.root = root
        self.prefix = prefix
        self.options = json_options
        self.lines: list[str] = []
        self._names: dict[tuple[int, bool], str] = {}  # (id(node), written out) -> its rule
        self._keep: list[object] = []  # nodes named by id: kept alive
        self._gains: dict[int, bool] = {}
        self._alternatives: dict[int, list[object] | None] = {}
        self._leaves: dict[str, str] = {}  # a leaf's body -> its rule
        self.size = 0  # bytes in `lines`

    def add(self, line: str) -> None:
        self.lines.append(line)
        self.size += len(line)
        if self.size > MAX_GRAMMAR_BYTES:
            raise _TooLarge

    def _new_name(self) -> str:
        self._count = getattr(self, "_count", -1) + 1
        return f"{self.prefix}r{self._count}"

    # -- what each node is ------------------------------------------------------------------

    def keys(self, node: dict[str, Any]) -> set[str]:
        """The keywords of `node` that constrain instances (ids: annotations, refs being local)."""
        keys = set(node) & SCHEMA_KEYWORDS - {"$id", "id", "$anchor"}
        return keys - set(DEFS) if node is self.root else keys

    def kind(self, node: object) -> str:
        """One of "object", "array", "any_of", "ref" or "leaf"."""
        if not isinstance(node, dict):
            return "leaf"
        keys = self.keys(node)
        if keys == {"$ref"}:
            return "ref"
        if self.alternatives(node) is not None:
            return "any_of"
        if keys & MEMBERS and keys <= OBJECT_KEYWORDS and node.get("type", "object") == "object":
            return "object" if self.fields(node) is not None else "leaf"
        if keys <= ARRAY_KEYS and node.get("type") in ("array", ["array"]) and \
                isinstance(node.get("items"), dict) and node.get("minItems", 0) in (0, 1):
            return "array"
        return "leaf"

    def alternatives(self, node: dict[str, Any]) -> list[object] | None:
        """The branches of a union this can write: an `anyOf`/`oneOf` alone; an object whose
        `type` lists other types too (the object, and the other types); an object beside an
        `anyOf`/`oneOf` of object fragments (the object merged with each)."""
        if id(node) not in self._alternatives:
            self._keep.append(node)
            self._alternatives[id(node)] = self._union(node)
        return self._alternatives[id(node)]

    def _union(self, node: dict[str, Any]) -> list[object] | None:
        keys = self.keys(node)
        union = [k for k in UNIONS if k in keys]
        if len(union) == 1 and keys == set(union) and isinstance(node[union[0]], list):
            return list(node[union[0]])
        kind = node.get("type")
        if isinstance(kind, list) and "object" in kind and keys <= OBJECT_KEYWORDS and \
                keys & MEMBERS and set(kind) <= set(TYPES):
            others = [t for t in kind if t != "object"]
            return [{**node, "type": "object"}, *([{"type": others}] if others else [])]
        if len(union) != 1 or not keys - {union[0]} <= OBJECT_KEYWORDS or \
                node.get("type", "object") != "object":  # fmt: skip
            return None
        out: list[object] = []
        for branch in node[union[0]] if isinstance(node[union[0]], list) else ():
            plain = {k: v for k, v in node.items() if k in OBJECT_KEYWORDS}  # no defs, no ids
            merged = merge_object_branch(plain, self.resolve(branch))
            if merged is None:
                return None
            out.append(merged)
        return out or None

    def fields(self, node: dict[str, Any]) -> tuple[dict[str, Any], set[str], Any, Any] | None:
        """(properties a member may carry, the required ones, the undeclared keys' schema or
        False, the one key pattern (its lexeme's content regex, its schema) or None), or None
        where the object cannot be written here."""
        props, required = node.get("properties", {}), node.get("required", [])
        extra = node.get("additionalProperties", True)
        patterns = node.get("patternProperties", {})
        if not isinstance(props, dict) or not isinstance(required, list) or \
                not all(isinstance(r, str) for r in required) or \
                not isinstance(extra, dict | bool) or len(props) > MAX_PROPERTIES or \
                not isinstance(patterns, dict) or len(patterns) > 1:
            return None
        pattern = None
        for regex, schema in patterns.items():
            content = key_regex(regex)
            if content is None or any(re.search(regex, k) for k in (*props, *required)):
                return None  # a declared key under a pattern meets both subschemas
            pattern = (content, schema)
        allowed = {k: v for k, v in props.items() if v is not False}
        for name in required:  # a required undeclared key is a property of the extras' schema
            if name not in props and extra is not False:
                allowed[name] = extra
        if not set(required) <= set(allowed):
            return None  # no instance: llguidance reports it
        tracked = set(required) | (set(allowed) if len(allowed) <= EXACT_UP_TO else set())
        if len(tracked) > MAX_TRACKED:
            return None
        return allowed, set(required), extra, pattern

    def target(self, ref: str) -> object:
        return _resolve(self.root, ref)

    def children(self, node: Any) -> list[object]:
        kind = self.kind(node)
        if kind == "object":
            allowed, _, extra, pattern = self.fields(node)  # type: ignore[misc]
            return [*allowed.values(), extra, *(pattern[1:] if pattern else ())]
        if kind == "array":
            return [node["items"]]
        if kind == "any_of":
            return self.alternatives(node)  # type: ignore[return-value]
        if kind == "ref":
            return [self.target(node["$ref"])]
        return []

    def gains(self, node: object) -> bool:
        """Whether an object of two or more properties is written below `node` (so it is worth
        a rule rather than one leaf)."""
        key = id(node)
        if key not in self._gains:
            self._gains[key] = False  # a cycle back here adds nothing
            self._keep.append(node)
            own = self.kind(node) == "object" and len(self.fields(node)[0]) >= 2  # type: ignore
            gains = own or any(self.gains(c) for c in self.children(node))
            if gains and self.kind(node) == "any_of":
                gains = not self.starts(self.leaves(node)) & self.starts(self.written(node))
            self._gains[key] = gains
        return self._gains[key]

    def written(self, node: Any) -> list[object]:
        """A union's branches written as rules of their own: those that gain, objects and
        arrays (so that no `%json` leaf starts like them), native leaves."""
        return [b for b in self.children(node) if self._own_rule(b)]

    def leaves(self, node: Any) -> list[object]:
        """A union's other branches: one `%json` leaf for them all."""
        return [b for b in self.children(node) if not self._own_rule(b)]

    def _own_rule(self, node: object) -> bool:
        target = self.resolve(node)
        return self.gains(target) or self.kind(target) in ("object", "array") or \
            _native(target) is not None  # fmt: skip

    def resolve(self, node: object) -> object:
        """`node`, or the node its `$ref`s lead to."""
        seen = set()
        while self.kind(node) == "ref" and id(node) not in seen:
            seen.add(id(node))
            node = self.target(node["$ref"])  # type: ignore[index]
        return node

    def starts(self, nodes: list[object]) -> set[str]:
        """The JSON types the values of `nodes` may have (where their text may start). A `%json`
        leaf beside a rule whose value starts the same way is never entered by llguidance (an
        outer lexeme wins the tie), so a union with such a pair stays one leaf."""
        out: set[str] = set()
        node: Any
        for node in nodes:
            kind = self.kind(node)
            if kind == "ref":
                out |= self.starts([self.target(node["$ref"])])
            elif kind == "any_of" and self.gains(node):
                out |= self.starts(self.children(node))
            elif kind == "array":
                out.add("array")
            elif kind == "object":
                out |= {"object"} if "type" in node else set(TYPES) - {"integer"}
            else:
                out |= _value_types(node)
        return out

    # -- rules ------------------------------------------------------------------------------

    def rule(self, node: Any, write: bool = False) -> str:
        """The rule for `node`, written once (a `$ref`'s target is one rule, however often it is
        referenced: recursion becomes a recursive rule; equal leaves share one rule). A node
        that does not gain is a leaf, unless `write` asks for its object or array rule."""
        node = self.resolve(node)
        write = write and self.kind(node) in ("object", "array")
        key = (id(node), write or self.gains(node))
        if key in self._names:
            return self._names[key]
        self._keep.append(node)
        if not key[1]:
            body = _native(node) or self.leaf(node)
            if body not in self._leaves:
                self._leaves[body] = self._new_name()
                self.add(f"{self._leaves[body]}: {body}")
            self._names[key] = self._leaves[body]
            return self._leaves[body]
        name = self._names[key] = self._new_name()
        kind = self.kind(node)
        if kind == "any_of":
            rules = [self.rule(b, write=True) for b in self.written(node)]
            if leaves := self.leaves(node):
                rules.append(self.rule({"anyOf": leaves} if len(leaves) > 1 else leaves[0]))
            body = " | ".join(rules)
        elif kind == "array":
            item = self.rule(node["items"])
            items = f"{item} (COMMA {item})*"
            body = f"LBRACK {items} RBRACK"
            if not node.get("minItems", 0):
                body += " | EMPTY_ARRAY"
        else:
            body = self.object_rule(name, node)
            if "type" not in node:  # object keywords constrain objects only
                body += " | " + self.leaf({"type": [t for t in TYPES if t != "object"]})
        self.add(f"{name}: {body}")
        return name

    def object_rule(self, name: str, node: dict[str, Any]) -> str:
        """Rules `{name}_s{mask}` for the members that may follow once the keys in `mask`
        (bits over the tracked keys) are written; returns the object's body."""
        allowed, required, extra, pattern = self.fields(node)  # type: ignore[misc]
        keys = list(allowed)
        tracked = [k for k in keys if k in required or len(keys) <= EXACT_UP_TO]
        bit = {k: 1 << i for i, k in enumerate(tracked)}
        need = sum(bit[k] for k in required)
        pairs = {k: f"{literal(k)} COLON {self.rule(v)}" for k, v in allowed.items()}
        names = " | ".join(map(literal, {**node.get("properties", {}), **allowed}))
        other = f" & ~({names})" if names else ""
        if pattern is not None:  # untracked keys: "" and "/" never name a property here
            self.add(f"{name.upper()}_PAT: STRING & /\"{pattern[0]}\"/{other}")
            pairs["/"] = f"{name.upper()}_PAT COLON {self.rule(pattern[1])}"
            other += f" & ~{name.upper()}_PAT"
        if extra is not False:
            self.add(f"{name.upper()}_KEY: STRING{other}")
            pairs[""] = f"{name.upper()}_KEY COLON {self.rule(extra)}"
        if not pairs:
            return "EMPTY_OBJECT"
        # Keys no state tracks (untracked properties, undeclared keys) are one shared rule.
        # Untracked properties are one shared rule; undeclared keys another, which comes only
        # once every required key is in (as llguidance's own grammar puts them after).
        members = {k: pair for k, pair in pairs.items() if k in bit}
        for group, keys in (("any", [k for k in pairs if k not in bit and k in allowed]),
                            ("undeclared", [k for k in ("/", "") if k in pairs])):
            if keys:
                self.add(f"{name}_{group}: " + " | ".join(pairs[k] for k in keys))
                members[group] = f"{name}_{group}"
        todo, seen = [0], {0}
        while todo:
            mask = todo.pop()
            alts = []
            for k, member in members.items():
                if mask & bit.get(k, 0) or (k == "undeclared" and mask & need != need):
                    continue
                after = mask | bit.get(k, 0)
                more = any(not after & bit.get(j, 0) for j in members)
                rest = f"{name}_s{after}"
                if more and after not in seen:
                    seen.add(after)
                    todo.append(after)
                if after & need != need:
                    alts.append(f"{member} COMMA {rest}")
                else:
                    alts.append(f"{member} (COMMA {rest})?" if more else member)
            self.add(f"{name}_s{mask}: " + " | ".join(alts))
        return f"LBRACE {name}_s0 RBRACE" + ("" if need else " | EMPTY_OBJECT")

    def leaf(self, node: object) -> str:
        """llguidance's JSON grammar for `node` (its annotations left out), with the root's
        draft and the definitions its references reach."""
        schema: dict[str, Any] = {"x-guidance": self.options}
        if isinstance(node, dict):
            schema = {**{k: v for k, v in node.items() if k in SCHEMA_KEYWORDS and k not in DEFS},
                      **schema}  # fmt: skip
        elif node is False:
            schema["not"] = {}
        if isinstance(self.root.get("$schema"), str):
            schema["$schema"] = self.root["$schema"]
        for where, name in self._reached(node):
            schema.setdefault(where, {})[name] = self.root[where][name]
        return "%json " + json.dumps(schema, ensure_ascii=False)

    def _reached(self, node: object) -> list[tuple[str, str]]:
        """The definitions (section, name) that `$ref`s below `node` reach, transitively."""
        out: list[tuple[str, str]] = []
        todo = [node]
        while todo:
            for ref in _refs(todo.pop()):
                where = _def_name(ref)
                if where and where not in out and where[1] in self.root.get(where[0], {}):
                    out.append(where)
                    todo.append(self.root[where[0]][where[1]])
        return out


def _value_types(node: object) -> set[str]:
    """The JSON types a leaf's values may have ("integer" counted as "number")."""
    if node is False:
        return set()
    if not isinstance(node, dict):
        return set(TYPES) - {"integer"}
    kind = node.get("type")
    if isinstance(kind, str | list) and set(node) & SCHEMA_KEYWORDS & {"anyOf", "oneOf", "allOf",
                                                                 "$ref"} == set():  # fmt: skip
        kinds = {kind} if isinstance(kind, str) else set(kind)
        return {"number" if t == "integer" else t for t in kinds}
    values = node.get("enum", [node["const"]] if "const" in node else None)
    if isinstance(values, list) and not set(node) & {"anyOf", "oneOf", "allOf", "$ref"}:
        names = {dict: "object", list: "array", str: "string", bool: "boolean",
                 type(None): "null", int: "number", float: "number"}  # fmt: skip
        return {names.get(type(v), "number") for v in values}
    return set(TYPES) - {"integer"}


def _native(node: object) -> str | None:
    """A Lark body for a leaf that needs no JSON grammar: scalar types, string enums."""
    if not isinstance(node, dict):
        return None
    keys = set(node) & SCHEMA_KEYWORDS - {"$id", "id", "$anchor"}
    if keys == {"type"}:
        return scalars(node["type"] if isinstance(node["type"], list) else [node["type"]])
    if keys in ({"enum"}, {"const"}):
        values = node["enum"] if keys == {"enum"} else [node["const"]]
        if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
            return " | ".join(literal(v) for v in dict.fromkeys(values))
    return None


def _refs(node: object) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        for k, v in node.items():
            if k not in DATA and k not in DEFS:
                found += _refs(v)
        return found
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []
