"""grammar/normalize.py and grammar/contradictions.py: allOf merged into its parent, annotations
dropped, contradictions refused with the keywords and a JSON pointer; over the MaskBench dev set,
the normalized schemas accept exactly the instances the originals do; over HTTP, a
contradictory `response_format` is a 400."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import jsonschema
import openai
import pytest

from grammar.contradictions import Contradiction
from grammar.normalize import normalize_schema, normalize_spec
from grammar.spec import GrammarError, parse_response_format
from tests.maskbench import MASKBENCH

if TYPE_CHECKING:
    from tests.conftest import GatewayServer

D4 = "http://json-schema.org/draft-04/schema#"
D7 = "http://json-schema.org/draft-07/schema#"


def valid(schema: object, value: object) -> bool:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema).is_valid(value)


# -- merges -----------------------------------------------------------------------------------

MERGES = [
    # (schema, normalized)
    ({"allOf": [{"type": "number"}, {"type": ["integer", "string"]}]}, {"type": "integer"}),
    ({"type": ["string", "null"], "allOf": [{"type": ["null", "integer"]}]}, {"type": "null"}),
    ({"minimum": 1, "maximum": 9, "allOf": [{"minimum": 3, "exclusiveMaximum": 8}]},
     {"minimum": 3, "maximum": 9, "exclusiveMaximum": 8}),
    ({"allOf": [{"minLength": 2, "maxLength": 9}, {"minLength": 4, "maxLength": 6}]},
     {"minLength": 4, "maxLength": 6}),
    ({"minItems": 1, "allOf": [{"maxItems": 3}, {"minItems": 2}]}, {"minItems": 2, "maxItems": 3}),
    ({"allOf": [{"minProperties": 1}, {"minProperties": 2, "maxProperties": 4}]},
     {"minProperties": 2, "maxProperties": 4}),
    ({"enum": ["a", "b", "c"], "allOf": [{"enum": ["c", "a", "z"]}]}, {"enum": ["a", "c"]}),
    ({"enum": [1, 2], "allOf": [{"const": 2}]}, {"const": 2}),
    ({"required": ["a"], "allOf": [{"required": ["b", "a"]}]}, {"required": ["a", "b"]}),
    ({"properties": {"a": {"type": "string"}},
      "allOf": [{"properties": {"a": {"maxLength": 3}, "b": {"type": "integer"}}}]},
     {"properties": {"a": {"type": "string", "maxLength": 3}, "b": {"type": "integer"}}}),
    ({"allOf": [{"pattern": "^a"}, {"pattern": "^a", "minLength": 2}]},
     {"pattern": "^a", "minLength": 2}),
    # additionalProperties is relative to its own node's properties: merged when they agree
    ({"properties": {"a": {}, "b": {}}, "additionalProperties": False,
      "allOf": [{"properties": {"a": {"type": "string"}}, "required": ["a"]}]},
     {"properties": {"a": {"type": "string"}, "b": {}}, "additionalProperties": False,
      "required": ["a"]}),
    ({"allOf": [{"properties": {"a": {}}, "additionalProperties": False}]},
     {"properties": {"a": {}}, "additionalProperties": False}),
    # keywords the parent lacks are copied (with the ones they depend on)
    ({"type": "object", "allOf": [{"if": {"required": ["a"]}, "then": {"required": ["b"]}}]},
     {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}),
    ({"allOf": [{"uniqueItems": False}, {"uniqueItems": True}]}, {"uniqueItems": True}),
    # `true` and `{}` branches (annotations only, too) say nothing
    ({"type": "string", "allOf": [True, {}, {"description": "d", "title": "t"}]},
     {"type": "string"}),
    # nested allOfs flatten
    ({"allOf": [{"allOf": [{"minimum": 1}, {"maximum": 5}]}]}, {"minimum": 1, "maximum": 5}),
    # a branch that is only a `$ref` to a (non-recursive) local definition is merged
    ({"$defs": {"named": {"properties": {"name": {"type": "string"}}}},
      "allOf": [{"$ref": "#/$defs/named"}, {"required": ["name"]}]},
     {"$defs": {"named": {"properties": {"name": {"type": "string"}}}},
      "properties": {"name": {"type": "string"}}, "required": ["name"]}),
    # annotations are dropped wherever they are keywords, not where they are names
    ({"$schema": D7, "title": "T", "$comment": "c", "type": "object",
      "properties": {"title": {"type": "string", "description": "d", "examples": ["x"],
                               "default": "x", "deprecated": True, "readOnly": True,
                               "writeOnly": False}},
      "required": ["title"]},
     {"$schema": D7, "type": "object", "properties": {"title": {"type": "string"}},
      "required": ["title"]}),
]  # fmt: skip


@pytest.mark.parametrize("schema, expected", MERGES)
def test_merges(schema, expected) -> None:
    assert normalize_schema(schema) == expected


KEPT = [
    # (schema, what stays in allOf)
    ({"pattern": "^a", "allOf": [{"pattern": "b$"}]}, [{"pattern": "b$"}]),
    # a's additionalProperties would now forbid b: unsound to merge
    ({"properties": {"a": {}}, "additionalProperties": False,
      "allOf": [{"properties": {"b": {}}}]}, [{"properties": {"b": {}}}]),
    ({"properties": {"x": {}}, "allOf": [{"properties": {"a": {}}, "additionalProperties": False}]},
     [{"properties": {"a": {}}, "additionalProperties": False}]),
    ({"if": {"minimum": 1}, "then": {"maximum": 2}, "allOf": [{"if": {"type": "string"}}]},
     [{"if": {"type": "string"}}]),
    ({"not": {"const": 1}, "allOf": [{"not": {"const": 2}}]}, [{"not": {"const": 2}}]),
    # a recursive definition is not inlined
    ({"$defs": {"tree": {"properties": {"kids": {"items": {"$ref": "#/$defs/tree"}}}}},
      "allOf": [{"$ref": "#/$defs/tree"}, {"required": ["kids"]}]}, [{"$ref": "#/$defs/tree"}]),
    # a `$ref` with siblings is not resolved
    ({"$defs": {"a": {"type": "object"}},
      "allOf": [{"$ref": "#/$defs/a", "required": ["x"]}]},
     [{"$ref": "#/$defs/a", "required": ["x"]}]),
]  # fmt: skip


@pytest.mark.parametrize("schema, kept", KEPT)
def test_what_cannot_merge_stays_in_all_of(schema, kept) -> None:
    assert normalize_schema(schema)["allOf"] == kept


def names(s: object) -> list[str]:
    """Property names in the order llguidance meets them: keys in order, branches in place."""
    out: list[str] = []
    if isinstance(s, dict):
        for k, v in s.items():
            if k == "properties":
                out += v
            elif k in ("allOf", "anyOf", "oneOf"):
                for b in v:
                    out += names(b)
    return list(dict.fromkeys(out))


def props(*keys: str) -> dict[str, object]:
    return {k: {"type": "integer"} for k in keys}


@pytest.mark.parametrize("schema, merged", [
    # sorted keys put allOf before properties: the branch's names come first
    ({"allOf": [{"properties": props("b")}], "properties": props("a")},
     {"properties": props("b", "a")}),
    ({"properties": props("a"), "allOf": [{"properties": props("b", "a")}]},
     {"properties": props("a", "b")}),
    # c merged into properties would come before b: that branch stays
    ({"allOf": [{"properties": props("a")}, {"anyOf": [{"properties": props("b")}]},
                {"properties": props("c")}]},
     {"properties": props("a"), "anyOf": [{"properties": props("b")}],
      "allOf": [{"properties": props("c")}]}),
    # after a branch that stays, what the later ones bring goes after it
    ({"$defs": {"t": {"properties": {"t": {"$ref": "#/$defs/t"}}}},
      "allOf": [{"$ref": "#/$defs/t"}, {"properties": props("z")}]},
     {"$defs": {"t": {"properties": {"t": {"$ref": "#/$defs/t"}}}},
      "allOf": [{"$ref": "#/$defs/t"}], "properties": props("z")}),
])  # fmt: skip
def test_merges_keep_the_order_properties_are_generated_in(schema, merged) -> None:
    out = normalize_schema(schema)
    assert out == merged and list(out) == list(merged)
    assert names(out) == names(schema)


def test_a_ref_into_an_all_of_keeps_it() -> None:
    schema = {"allOf": [{"type": "string"}, {"minLength": 2}],
              "$defs": {"b": {"$ref": "#/allOf/1"}}}  # fmt: skip
    assert normalize_schema(schema) == schema
    schema = {"properties": {"a": {"type": "string"}},
              "allOf": [{"properties": {"a": {"minLength": 1}}}],
              "$defs": {"b": {"$ref": "#/properties/a"}}}  # fmt: skip
    assert normalize_schema(schema)["properties"]["a"] == {"type": "string"}


def test_siblings_of_a_draft7_ref_are_left_alone() -> None:
    # Up to draft 7 a `$ref`'s siblings are ignored: contradictory ones are no contradiction.
    schema = {"$schema": D7, "definitions": {"a": {"type": "object"}},
              "properties": {"x": {"$ref": "#/definitions/a", "description": "kept",
                                   "allOf": [{"type": "string"}, {"type": "integer"}]}},
              "required": ["x"]}  # fmt: skip
    assert normalize_schema(schema)["properties"]["x"] == schema["properties"]["x"]


def test_draft4_exclusive_bounds_merge_only_when_they_agree() -> None:
    schema = {"$schema": D4, "maximum": 5, "exclusiveMaximum": True, "allOf": [{"maximum": 4}]}
    assert normalize_schema(schema)["allOf"] == [{"maximum": 4}]
    schema = {"$schema": D4, "minimum": 5, "allOf": [{"maximum": 9, "exclusiveMaximum": True}]}
    assert normalize_schema(schema) == {"$schema": D4, "minimum": 5, "maximum": 9,
                                        "exclusiveMaximum": True}


def test_an_unchanged_schema_is_the_same_object() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}}
    assert normalize_schema(schema) is schema
    spec = parse_response_format({"type": "json_schema", "json_schema": {"schema": schema}})
    assert spec is not None and normalize_spec(spec) is spec


def test_normalize_spec_rewrites_the_payload_only() -> None:
    schema = {"allOf": [{"type": "object"}, {"required": ["a"]}], "description": "x"}
    spec = parse_response_format({"type": "json_schema", "json_schema": {"schema": schema}})
    assert spec is not None
    out = normalize_spec(spec)
    assert out.schema() == {"type": "object", "required": ["a"]}
    assert (out.kind, out.param) == (spec.kind, spec.param)


# -- contradictions ---------------------------------------------------------------------------

CONTRADICTIONS = [
    # (schema, words the message names: keywords and the JSON pointer)
    ({"allOf": [{"type": "string"}, {"type": "integer"}]},
     ["type", '"string"', "/allOf/0", '"integer"', "/allOf/1", "(root)"]),
    ({"type": "integer", "minimum": 10, "maximum": 5}, ["minimum 10", "maximum 5", "(root)"]),
    ({"minimum": 1, "allOf": [{"exclusiveMaximum": 1}]},
     ["minimum 1", "exclusiveMaximum 1", "/allOf/0"]),
    ({"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 2},
     ["exclusiveMinimum 1", "exclusiveMaximum 2", "no integer"]),
    ({"$schema": D4, "minimum": 3, "exclusiveMinimum": True, "maximum": 3},
     ["minimum 3 (exclusiveMinimum: true)", "maximum 3"]),
    ({"type": "object", "properties": {"name": {"type": "string", "minLength": 5,
                                                "maxLength": 2}}, "required": ["name"]},
     ["minLength 5", "maxLength 2", "/properties/name"]),
    ({"allOf": [{"minItems": 3}, {"maxItems": 1}]}, ["minItems 3", "maxItems 1", "/allOf/1"]),
    ({"minProperties": 2, "maxProperties": 1}, ["minProperties 2", "maxProperties 1"]),
    ({"contains": {"type": "integer"}, "minContains": 3, "maxContains": 1},
     ["minContains 3", "maxContains 1"]),
    ({"required": ["a", "b"], "maxProperties": 1}, ["required", "maxProperties", "1"]),
    ({"enum": ["a", "b"], "const": "c"}, ["const", '"c"', "enum", "(root)"]),
    ({"allOf": [{"enum": [1, 2]}, {"enum": [3]}]}, ["enum [1, 2]", "enum [3]", "/allOf/1"]),
    ({"type": "string", "enum": [1, 2, None]}, ["enum", "type", '"string"']),
    ({"enum": [True], "allOf": [{"const": 1}]}, ["enum [true]", "const 1"]),  # true != 1
    ({"not": {}}, ["not: {}", "(root)"]),
    ({"not": True}, ["not: true", "(root)"]),
    ({"allOf": [{"type": "object"}, False]}, ["`false`", "/allOf/1"]),
    ({"type": "object", "properties": {"a": {"not": {}}}, "required": ["a"]},
     ["required", "'a'", "not: {}", "/properties/a"]),
    ({"type": "object", "properties": {"a": False}, "required": ["a"]},
     ["required", "'a'", "`false`", "/properties/a"]),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": False,
      "required": ["b"]}, ["required", "'b'", "additionalProperties"]),
    # down required properties and through `$ref`s
    ({"$defs": {"n": {"type": "integer", "minimum": 5, "maximum": 1}},
      "properties": {"p": {"properties": {"q": {"$ref": "#/$defs/n"}}, "required": ["q"]}},
      "required": ["p"]}, ["minimum 5", "maximum 1", "/$defs/n"]),
    ({"properties": {"a": {"type": "string"}}, "required": ["a"],
      "allOf": [{"properties": {"a": {"type": "integer"}}}]},
     ["type", "/properties/a", "/allOf/0/properties/a"]),
    ({"type": "object", "anyOf": [{"type": "string"}, {"type": "array"}]},
     ["anyOf", "type", '"object"', "/anyOf/0"]),
]  # fmt: skip


@pytest.mark.parametrize("schema, words", CONTRADICTIONS)
def test_contradictions_are_refused(schema, words) -> None:
    with pytest.raises(Contradiction) as e:
        normalize_schema(schema, "response_format.json_schema.schema")
    assert e.value.param == "response_format.json_schema.schema"
    assert "contradictory JSON schema at " in e.value.message
    for word in words:
        assert word in e.value.message, (word, e.value.message)


NOT_CONTRADICTIONS = [
    # forbidding an optional property is an idiom
    {"type": "object", "properties": {"a": {"not": {}}, "b": False, "c": {"not": True}}},
    # a contradiction in an optional place only rules that place out (real schemas have them:
    # an optional property whose enum fails its type)
    {"type": "object", "properties": {"a": {"type": "object", "enum": ["x", "y"]}}},
    {"properties": {"a": {"minimum": 5, "maximum": 1}}},
    {"anyOf": [{"allOf": [{"type": "string"}, {"type": "integer"}]}, {"type": "null"}]},
    {"type": "array", "items": {"not": {}}},
    {"not": {"allOf": [{"type": "string"}, {"type": "integer"}]}},
    # bounds of a kind the type excludes bind nothing
    {"type": "string", "minimum": 5, "maximum": 1},
    {"type": "integer", "minLength": 5, "maxLength": 1},
    {"type": "string", "required": ["a"], "maxProperties": 0},
    {"type": "array", "minContains": 3, "maxContains": 1},  # no `contains`: they bind nothing
    # equal bounds, both inclusive; 1.0 is an integer
    {"type": "integer", "minimum": 1, "maximum": 1, "enum": [1.0]},
]  # fmt: skip


@pytest.mark.parametrize("schema", NOT_CONTRADICTIONS)
def test_satisfiable_schemas_are_not_refused(schema) -> None:
    normalize_schema(schema)


def test_a_contradiction_in_a_spec_keeps_its_param() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "allOf": [{"type": "string"}, {"type": "integer"}]}}}
    spec = parse_response_format(fmt)
    assert spec is not None
    with pytest.raises(GrammarError) as e:
        normalize_spec(spec)
    assert e.value.param == "response_format.json_schema.schema"


# -- the MaskBench dev set --------------------------------------------------------------------

MAX_INSTANCES = 8  # per case


@pytest.mark.skipif(not MASKBENCH.is_dir(), reason="needs the MaskBench dev set")
def test_dev_set_instances_keep_their_validity() -> None:
    """No case is refused (each has valid instances); and for every case with an allOf, what
    the normalized schema accepts is what the original does, on the instances listed (those
    whose label jsonschema agrees with)."""
    checked = changed = 0
    for path in sorted(MASKBENCH.glob("*.json")):
        text = path.read_text()
        case = json.loads(text)
        schema = case["schema"]
        out = normalize_schema(schema)
        if out is schema or '"allOf"' not in text:
            continue
        changed += 1
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        before, after = cls(schema), cls(out)
        for test in case["tests"][:MAX_INSTANCES]:
            try:
                if before.is_valid(test["data"]) != test["valid"]:
                    continue  # the label or Python's regex dialect disagrees: not a reference
            except Exception:  # a pattern Python's `re` does not read, a remote `$ref`
                continue
            assert after.is_valid(test["data"]) == test["valid"], (path.name, test)
            checked += 1
    assert changed > 100 and checked > 300, (changed, checked)


# -- over HTTP ---------------------------------------------------------------------------------


@pytest.mark.parametrize("schema, words", [
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, ["allOf", "type"]),
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 10, "maximum": 5}},
      "required": ["n"]}, ["minimum 10", "maximum 5", "/properties/n"]),
])  # fmt: skip
def test_contradictions_are_400_over_http(gateway_server: GatewayServer, schema, words) -> None:
    client = openai.OpenAI(base_url=gateway_server.base_url, api_key=gateway_server.api_key,
                           max_retries=0, timeout=300)
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=gateway_server.model, messages=[{"role": "user", "content": "hi"}],
            max_tokens=5, response_format=fmt,  # type: ignore[arg-type]
        )
    assert e.value.status_code == 400
    err = e.value.body
    assert isinstance(err, dict) and err["type"] == "invalid_request_error"
    assert err["param"] == "response_format.json_schema.schema"
    assert "contradictory JSON schema" in err["message"]
    for word in words:
        assert word in err["message"], (word, err["message"])
