"""Constraint specs: OpenAI `response_format` and vLLM `structured_outputs` -> `ConstraintSpec`.

Pure Python (no torch): the gateway parses and validates specs at the edge, so a malformed one
is a 400 before the request reaches the engine. Compilation happens later, in `compiler.py`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

import jsonschema
import referencing
import referencing.exceptions
from referencing.jsonschema import DRAFT202012

ConstraintKind = Literal["json_object", "json_schema", "regex", "grammar", "choice", "tool_calls"]
JSONSchema = dict[str, object] | bool  # as parsed from JSON

MAX_SPEC_BYTES = 4 << 20  # a schema, regex or grammar larger than this is refused at once
# Objects and arrays in one JSON schema. Checking a schema against its metaschema is pure Python
# at ~0.3 ms a node (5 s for 20,000 properties), and compiling one grows faster than its size;
# the MaskBench dev set's largest schema has 14,434.
MAX_SCHEMA_NODES = 16_384
# Whitespace between the tokens of JSON output, for every JSON constraint and backend: at most
# one space. Free whitespace lets a small model pad with newlines until max_tokens; fixed
# separators force non-canonical tokens (`:` then ` ` then `"`), which derail it.
JSON_MAX_WHITESPACE = 1

# vLLM `structured_outputs` options that tune a backend; accepted and ignored.
_VLLM_OPTIONS = {
    "disable_fallback",
    "disable_any_whitespace",
    "disable_additional_properties",
    "whitespace_pattern",
    "backend",
}


# Keywords whose values are instances, not subschemas: a "$ref" inside them is data.
DATA_KEYWORDS = ("enum", "const", "default", "examples")
# JSON Schema's keywords (drafts 3 to 2020-12) that constrain instances or hold subschemas;
# any other key is an annotation.
SCHEMA_KEYWORDS = frozenset(
    {"type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
     "exclusiveMinimum", "maxLength", "minLength", "pattern", "format", "maxItems", "minItems",
     "uniqueItems", "maxContains", "minContains", "contains", "items", "additionalItems",
     "prefixItems", "unevaluatedItems", "maxProperties", "minProperties", "required",
     "properties", "patternProperties", "additionalProperties", "unevaluatedProperties",
     "propertyNames", "dependencies", "dependentRequired", "dependentSchemas", "allOf", "anyOf",
     "oneOf", "not", "if", "then", "else", "$ref", "$dynamicRef", "$recursiveRef", "disallow",
     "extends", "divisibleBy", "contentEncoding", "contentMediaType", "$id", "id", "$anchor",
     "$dynamicAnchor", "$recursiveAnchor", "$defs", "definitions"}
)  # fmt: skip


class GrammarError(ValueError):
    """A constraint that cannot be parsed or compiled; the gateway answers a 400.

    `param` names the offending request field in OpenAI's dotted form, e.g.
    `response_format.json_schema.schema`.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class ConstraintSpec:
    """One validated constraint.

    `payload` by kind: json_schema -> the schema as compact JSON text (key order kept, since
    it fixes the order properties are generated in); regex / grammar -> the pattern or
    EBNF/GBNF text; choice -> the tuple of allowed strings; json_object -> None; tool_calls ->
    JSON text of the allowed tools and the call mode (built by `grammar.tools`).
    """

    kind: ConstraintKind
    payload: str | tuple[str, ...] | None = None
    name: str | None = field(default=None, compare=False)  # json_schema name, for messages
    param: str | None = field(default=None, compare=False)  # the request field it came from

    @cached_property
    def key(self) -> str:
        """A stable hash of what compilation depends on (kind and payload); computed once, as
        the gateway and the engine each look the spec up."""
        text = json.dumps([self.kind, self.payload], ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()

    @cached_property
    def parsed(self) -> Any:
        """The payload's JSON value, parsed once for every reader (json_schema: the schema;
        tool_calls: the tools and the call mode); None for the other kinds. Shared: read it,
        never change it."""
        if self.kind in ("json_schema", "tool_calls") and isinstance(self.payload, str):
            return json.loads(self.payload)
        return None

    def schema(self) -> JSONSchema:
        """The JSON schema to enforce (`parsed`: read-only); json_object means any JSON
        object."""
        if self.kind == "json_object":
            return {"type": "object"}
        if self.kind != "json_schema":
            raise ValueError(f"a {self.kind} constraint has no JSON schema")
        return self.parsed


def parse_constraint(
    response_format: dict[str, object] | None = None,
    structured_outputs: dict[str, object] | None = None,
) -> ConstraintSpec | None:
    """Parse a request's constraint fields; None when the request is unconstrained. The one
    reader of these fields: the gateway's planner calls it once per request
    (gateway/openai/params.py)
    and `SamplingParams` once per construction (the offline API); the engine gets the spec.

    Raises GrammarError when a field is malformed or both fields carry a constraint.
    """
    rf = parse_response_format(response_format) if response_format is not None else None
    so = parse_structured_outputs(structured_outputs) if structured_outputs is not None else None
    if rf is not None and so is not None:
        raise GrammarError(
            "give a constraint in response_format or structured_outputs, not both",
            "structured_outputs",
        )
    return rf or so


def parse_response_format(rf: object) -> ConstraintSpec | None:
    """Parse OpenAI's `response_format` (plus the regex/grammar/choice extensions).

    `{"type": "text"}` means unconstrained and returns None.
    """
    p = "response_format"
    if not isinstance(rf, dict):
        raise GrammarError(f"{p} must be an object, got {type(rf).__name__}", p)
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintSpec("json_object", param=p)
    if kind == "json_schema":
        js, q = rf.get("json_schema"), f"{p}.json_schema"
        if not isinstance(js, dict):
            raise GrammarError(f"{q} must be an object", q)
        return _named_schema(js, q)
    if kind == "regex":
        return ConstraintSpec("regex", _text(rf.get("regex"), f"{p}.regex"), param=f"{p}.regex")
    if kind == "grammar":
        text = _text(rf.get("grammar"), f"{p}.grammar")
        return ConstraintSpec("grammar", text, param=f"{p}.grammar")
    if kind == "choice":
        choices = _choices(rf.get("choices"), f"{p}.choices")
        return ConstraintSpec("choice", choices, param=f"{p}.choices")
    expected = "text, json_object, json_schema, regex, grammar, choice"
    raise GrammarError(f"{p}.type must be one of {expected}; got {kind!r}", f"{p}.type")


def parse_text_format(fmt: object, p: str = "text.format") -> ConstraintSpec | None:
    """Parse the Responses API's `text.format`: `{"type": "text"}` (None: free text),
    `{"type": "json_object"}` or `{"type": "json_schema", "name", "schema", "strict"}`."""
    if not isinstance(fmt, dict):
        raise GrammarError(f"{p} must be an object", p)
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintSpec("json_object", param=p)
    if kind == "json_schema":
        return _named_schema(fmt, p)
    shown = repr(kind) if len(repr(kind)) <= 64 else repr(kind)[:64] + "…"
    raise GrammarError(f"{p} of type {shown} is not supported; use 'text', 'json_object' or "
                       "'json_schema'.", f"{p}.type")


def _named_schema(js: dict[str, object], q: str) -> ConstraintSpec:
    """`{"name", "schema", "strict"}` at `q` (chat's `response_format.json_schema`, the
    Responses API's `text.format`) as a constraint."""
    name = js.get("name")
    if name is not None and not isinstance(name, str):
        raise GrammarError(f"{q}.name must be a string", f"{q}.name")
    if not isinstance(js.get("strict"), bool | None):
        raise GrammarError(f"{q}.strict must be a boolean", f"{q}.strict")
    if "schema" not in js:
        raise GrammarError(f"{q}.schema is required", f"{q}.schema")
    return _json_schema_spec(js["schema"], f"{q}.schema", name)


def parse_structured_outputs(so: object) -> ConstraintSpec | None:
    """Parse vLLM's `structured_outputs` extra field: exactly one of json / regex / choice /
    grammar / json_object."""
    p = "structured_outputs"
    if not isinstance(so, dict):
        raise GrammarError(f"{p} must be an object, got {type(so).__name__}", p)
    if "structural_tag" in so:
        raise GrammarError(f"{p}.structural_tag is not supported", f"{p}.structural_tag")
    order = ("json", "regex", "choice", "grammar", "json_object")
    unknown = set(so) - set(order) - _VLLM_OPTIONS
    if unknown:
        raise GrammarError(f"{p} has unknown fields: {sorted(unknown)}", p)
    given = [k for k in order if so.get(k) not in (None, False)]  # `{}` is a valid schema
    if len(given) != 1:
        raise GrammarError(
            f"{p} needs exactly one of json, regex, choice, grammar, json_object; got {given}", p
        )
    k = given[0]
    value, param = so[k], f"{p}.{k}"
    if k == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise GrammarError(f"{param} is not valid JSON: {e}", param) from e
        return _json_schema_spec(value, param, None)
    if k == "json_object":
        return ConstraintSpec("json_object", param=param)
    if k == "choice":
        return ConstraintSpec("choice", _choices(value, param), param=param)
    kind: ConstraintKind = "regex" if k == "regex" else "grammar"
    return ConstraintSpec(kind, _text(value, param), param=param)


def _text(value: object, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise GrammarError(f"{param} must be a non-empty string", param)
    if len(value.encode()) > MAX_SPEC_BYTES:
        raise GrammarError(f"{param} is over the {MAX_SPEC_BYTES} byte limit", param)
    return value


def _choices(value: object, param: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise GrammarError(f"{param} must be a non-empty list of strings", param)
    if not all(isinstance(c, str) for c in value):
        raise GrammarError(f"{param} must contain only strings", param)
    if sum(len(c.encode()) for c in value) > MAX_SPEC_BYTES:
        raise GrammarError(f"{param} is over the {MAX_SPEC_BYTES} byte limit", param)
    return tuple(value)


def parse_json_schema(schema: object, param: str, name: str | None = None) -> ConstraintSpec:
    """A JSON Schema given as `param` (e.g. the Messages API's `output_config.format.schema`)
    as a constraint; GrammarError naming `param` for one that is not a schema."""
    return _json_schema_spec(schema, param, name)


def _json_schema_spec(schema: object, param: str, name: str | None) -> ConstraintSpec:
    if schema is False:
        raise GrammarError(f"{param} is `false`: no value can satisfy it", param)
    if not isinstance(schema, dict | bool):
        raise GrammarError(f"{param} must be an object, got {type(schema).__name__}", param)
    text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    if len(text.encode()) > MAX_SPEC_BYTES:
        raise GrammarError(f"{param} is over the {MAX_SPEC_BYTES} byte limit", param)
    check_json_schema(schema, param)
    return ConstraintSpec("json_schema", text, name, param)


def check_json_schema(schema: JSONSchema, param: str) -> None:
    """Check `schema` against its metaschema and that its local `$ref`s resolve; first that it
    has at most MAX_SCHEMA_NODES objects and arrays (the check's cost grows with them)."""
    if more_nodes_than(schema, MAX_SCHEMA_NODES):
        raise GrammarError(
            f"the JSON schema has more than {MAX_SCHEMA_NODES} objects and arrays (the limit)",
            param,
        )
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema, format_checker=None)  # `pattern`s are ECMA-262, not Python
    except jsonschema.SchemaError as e:
        where = "/".join(str(x) for x in e.absolute_path) or "(root)"
        raise GrammarError(f"invalid JSON schema at {where}: {e.message}", param) from e
    if isinstance(schema, bool):
        return
    resource = referencing.Resource.from_contents(schema, default_specification=DRAFT202012)
    resolver = referencing.Registry().with_resource("", resource).resolver()
    for ref in _local_refs(schema):
        try:
            resolver.lookup(ref)
        except referencing.exceptions.Unresolvable as e:
            raise GrammarError(f"$ref {ref!r} does not resolve", param) from e


def more_nodes_than(node: object, limit: int) -> bool:
    """Whether `node` holds more than `limit` objects and arrays; stops counting past it."""
    count, stack = 0, [node]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
        else:
            continue
        count += 1
        if count > limit:
            return True
    return False


def _local_refs(node: object) -> set[str]:
    """The `#...` references in `node`, skipping subtrees that set their own `$id`."""
    refs: set[str] = set()
    stack = [node]
    while stack:
        x = stack.pop()
        if isinstance(x, list):
            stack.extend(x)
        elif isinstance(x, dict):
            if x is not node and isinstance(x.get("$id"), str):
                continue  # a new base URI: its refs resolve against that resource
            ref = x.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                refs.add(ref)
            stack.extend(v for k, v in x.items() if k not in DATA_KEYWORDS)
    return refs
