"""How the keywords of two schemas that must both hold combine into one schema (an allOf
branch merged into its parent): `type`s and `enum`s intersected, bounds tightened, `required`
united, `properties` merged (a property in both becomes the two schemas' merge, by `both`),
`uniqueItems` or'ed, keywords the parent lacks copied with those they depend on
(`if`/`then`/`else`, `items`/`prefixItems`, draft 4's `exclusiveMinimum: true` with its
`minimum`). `additionalProperties` is read against its own node's `properties`, so a branch
merges only where each side's names still cover the same properties. Where a keyword cannot
merge, nothing does: the branch stays in allOf. `merge_object_branch` is the simple case for
`grammar.any_order`: an object schema and one oneOf/anyOf branch of object keywords.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from grammar.contradictions import Path, meet, types_of, value_key
from grammar.spec import SCHEMA_KEYWORDS

if TYPE_CHECKING:
    from typing import Any

OBJECT_KEYWORDS = frozenset({"type", "properties", "required", "additionalProperties",
                             "patternProperties"})  # fmt: skip
# Merges two schemas (a's place, b's place); None where a's place cannot change.
Both = Callable[[object, Path, object, Path], object | None]
REFS = ("$ref", "$dynamicRef", "$recursiveRef")
# A branch with one of these is never merged: it names or scopes something where it is.
UNMERGEABLE = frozenset({*REFS, "$id", "id", "$anchor", "$dynamicAnchor", "$recursiveAnchor",
                         "$defs", "definitions", "$schema", "$vocabulary", "unevaluatedItems",
                         "unevaluatedProperties"})  # fmt: skip
# A parent with one of these takes no merge (its meaning depends on more than its keywords).
KEEPS_ALL_OF = frozenset({*REFS, "unevaluatedItems", "unevaluatedProperties"})
LOWER = frozenset({"minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties",
                   "minContains"})  # fmt: skip
UPPER = frozenset({"maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties",
                   "maxContains"})  # fmt: skip
# Keywords that only mean something together: merged as one, copied only where the parent has
# none of them.
GROUPS = (frozenset({"items", "prefixItems", "additionalItems"}),
          frozenset({"if", "then", "else"}),
          frozenset({"contains", "minContains", "maxContains"}))  # fmt: skip
# Up to draft 4, `exclusiveMinimum: true` modifies `minimum`: then each pair is one group.
LEGACY_BOUNDS = (frozenset({"minimum", "exclusiveMinimum"}),
                 frozenset({"maximum", "exclusiveMaximum"}))  # fmt: skip


def absorb(
    base: dict[str, object], b: dict[str, object], at: Path, b_at: Path,
    kept: list[object], both: Both,
) -> bool:
    """Merge branch `b` (at `b_at`) into `base` (the node at `at`, a private copy) and
    return True; or leave `base` untouched and return False where some keyword of `b`
    cannot merge."""
    if UNMERGEABLE & b.keys() or not _objects_agree(base, b):
        return False
    groups: tuple[frozenset[str], ...] = GROUPS
    if any(isinstance(s.get(k), bool) for s in (base, b)
           for k in ("exclusiveMinimum", "exclusiveMaximum")):
        groups += LEGACY_BOUNDS
    updates: dict[str, object] = {}
    for k, v in b.items():
        group = next((g for g in groups if k in g), None)
        if k == "allOf" or (k in base and same(base[k], v)):
            continue
        if group and group & base.keys():
            if not _same_group(base, b, group) and (k not in base or group in LEGACY_BOUNDS):
                return False
        if k not in base:
            updates[k] = v
            continue
        new = _meet(k, base[k], v, base, b, at, b_at, both)
        if new is None:
            return False
        updates[k] = new
    base.update(updates)
    enum = base.get("enum")
    if "const" in base and isinstance(enum, list):
        if value_key(base["const"]) in {value_key(v) for v in enum}:
            del base["enum"]  # it adds nothing to the const
    nested = b.get("allOf")
    if isinstance(nested, list):
        kept += nested
    return True


def _meet(
    k: str, old: object, new: object, base: dict[str, object],
    b: dict[str, object], at: Path, b_at: Path, both: Both,
) -> object | None:
    """The value of keyword `k` that means both `old` (the parent's) and `new` (a
    branch's); None where there is none to write."""
    if k == "type":
        a, c = types_of(old), types_of(new)
        types = meet(a, c) if a and c else None
        return (types[0] if len(types) == 1 else types) if types else None
    if k in LOWER or k in UPPER:
        if not isinstance(old, int | float) or not isinstance(new, int | float):
            return None  # (or a draft-04 boolean exclusive)
        if isinstance(old, bool) or isinstance(new, bool):
            return None
        return max(old, new) if k in LOWER else min(old, new)
    if k == "enum" and isinstance(old, list) and isinstance(new, list):
        keys = {value_key(v) for v in new}
        return [v for v in old if value_key(v) in keys] or None
    if k == "required" and isinstance(old, list) and isinstance(new, list):
        return old + [n for n in new if n not in old]
    if k == "uniqueItems" and isinstance(old, bool) and isinstance(new, bool):
        return old or new
    if k == "properties" and isinstance(old, dict) and isinstance(new, dict):
        return _meet_properties(old, new, at, b_at, both)
    if k == "additionalProperties":
        return both(old, (*at, k), new, (*b_at, k))
    if k == "items" and not (base.keys() | b.keys()) & {"prefixItems", "additionalItems"}:
        if isinstance(old, list) or isinstance(new, list):
            return None
        return both(old, (*at, k), new, (*b_at, k))
    return None

def _meet_properties(
    old: dict[str, object], new: dict[str, object], at: Path, b_at: Path, both: Both
) -> dict[str, object] | None:
    out = dict(old)
    for name, s in new.items():
        if name in out and not same(out[name], s):
            merged = both(out[name], (*at, "properties", name), s,
                                (*b_at, "properties", name))
            if merged is None:
                return None
            out[name] = merged
        else:
            out.setdefault(name, s)
    return out


def assemble(
    base: dict[str, object], pre: list[str], early: list[str], all_of: list[object],
    late: list[str], post: list[str],
) -> dict[str, object]:
    """A merged node: its keys before its allOf, those the merged branches before the first
    kept one brought, the kept branches, those the later ones brought, its keys after."""
    out = {k: base[k] for k in pre if k in base}
    out.update((k, base[k]) for k in early)
    if all_of:
        out["allOf"] = all_of
    out.update((k, base[k]) for k in late)
    out.update((k, base[k]) for k in post if k in base)
    return out


def _objects_agree(base: dict[str, object], b: dict[str, object]) -> bool:
    """Whether `b`'s object keywords can merge into `base`'s: `additionalProperties` is read
    against its own node's `properties` and `patternProperties`, so each side's must still
    cover the same names after the merge."""
    props_a, props_b = base.get("properties"), b.get("properties")
    names_a = set(props_a) if isinstance(props_a, dict) else set()
    names_b = set(props_b) if isinstance(props_b, dict) else set()
    pat_a, pat_b = base.get("patternProperties"), b.get("patternProperties")
    if _constrains(base.get("additionalProperties")):
        if not names_b <= names_a or pat_b not in (None, pat_a):
            return False
    if _constrains(b.get("additionalProperties")):
        if not names_a <= names_b or pat_a not in (None, pat_b):
            return False
    return True


def _constrains(ap: object) -> bool:
    return ap is not None and ap is not True and ap != {}


def _same_group(base: dict[str, object], b: dict[str, object], group: frozenset[str]) -> bool:
    return all(same(base.get(k), b.get(k)) for k in group)


def same(a: object, b: object) -> bool:
    """JSON equality (Python's `==` also has 1 == true, so it only rules out)."""
    return a is b or (a == b and value_key(a) == value_key(b))


def merge_object_branch(node: dict[str, Any], branch: object) -> dict[str, Any] | None:
    """`node` (an object schema) and a oneOf/anyOf branch of object keywords as one schema,
    merged by `absorb` where a property in both is trivially one of them; None where they
    do not merge that way."""
    if not isinstance(branch, dict) or not set(branch) & SCHEMA_KEYWORDS <= OBJECT_KEYWORDS:
        return None
    merged = dict(node)
    return merged if absorb(merged, branch, (), (), [], _trivially_both) else None


def _trivially_both(a: object, _at: Path, b: object, _b_at: Path) -> object | None:
    """A schema for `a` and `b` both, where one is trivially it; else None."""
    if a is False or b is False:
        return False
    if a in (True, {}) or same(a, b):
        return b
    return a if b in (True, {}) else None
