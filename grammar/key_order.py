"""A document's `"$schema"` key, first or anywhere, under llguidance's fixed property order.

llguidance generates an object's declared properties in their `properties` order and the
undeclared ones after all of them. Configuration documents begin with `"$schema"` (179 of the
214 MaskBench dev instances that have one), and schemas rarely declare it, so
`{"$schema": ..., "name": ...}` was refused wherever a declared property was required (or
followed it). Declaring `"$schema"` first instead would refuse the documents that end with it
(35 there). `schema_key_first` allows both: the root becomes
`anyOf: [the root with "$schema" declared first, the root]`, the two meaning the same
(`"$schema"` declared with the schema it had as an undeclared property); the definitions stay
at the top, where their `$ref`s point.
"""

from __future__ import annotations

from grammar.contradictions import types_of
from grammar.normalize import bigger_than, ref_targets

# Where a root has more (objects and arrays, definitions aside), it is left as it is: it is
# compiled twice.
MAX_ROOT_NODES = 2_000
# Keywords that stay on the new root: definitions and what identifies the document.
TOP = ("$schema", "$id", "id", "$defs", "definitions", "$anchor", "$dynamicAnchor",
       "$recursiveAnchor", "$vocabulary", "$comment")  # fmt: skip
# A root with one of these is left as it is: their meaning depends on where they are, or (min
# and maxProperties) llguidance reads them only where every declared property is required.
KEEP = ("$ref", "$dynamicRef", "$recursiveRef", "unevaluatedProperties", "minProperties",
        "maxProperties")  # fmt: skip


def schema_key_first(root: object) -> object:
    """`root` allowing a `"$schema"` property first as well as where it allowed it; `root`
    itself where that cannot be said simply (see the module's docstring)."""
    if not isinstance(root, dict) or any(k in root for k in KEEP):
        return root
    props = root.get("properties")
    if not isinstance(props, dict) or not props or next(iter(props)) == "$schema":
        return root
    types = types_of(root.get("type"))
    if types is not None and "object" not in types:
        return root
    if "$schema" in props:
        first = props["$schema"]
    else:
        first = root.get("additionalProperties", True)
        if first is False or "patternProperties" in root:
            return root
        first = {} if first is True else first
    targets, opaque = ref_targets(root)
    if opaque or any(t and t[0] not in ("$defs", "definitions") for t in targets):
        return root  # a `$ref` points into the root's own keywords, which move
    body = {k: v for k, v in root.items() if k not in TOP}
    if bigger_than(body, MAX_ROOT_NODES):
        return root
    rest = {k: v for k, v in props.items() if k != "$schema"}
    first_body = {**body, "properties": {"$schema": first, **rest}}
    return {**{k: root[k] for k in TOP if k in root}, "anyOf": [first_body, body]}
