"""Constraint specs: parsing OpenAI `response_format` and vLLM `structured_outputs`, and the
GrammarError (message + param) for every malformed shape. Pure Python, no tokenizer."""

from __future__ import annotations

import json

import pytest

from grammar.spec import (
    MAX_SPEC_BYTES,
    ConstraintSpec,
    GrammarError,
    parse_constraint,
    parse_response_format,
    parse_structured_outputs,
)

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


def test_response_format_kinds():
    assert parse_response_format({"type": "text"}) is None
    assert parse_response_format({"type": "json_object"}) == ConstraintSpec("json_object")
    spec = parse_response_format(
        {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}
    )
    assert spec.kind == "json_schema" and spec.name == "p"
    assert spec.schema() == SCHEMA
    assert list(spec.schema()["properties"]) == ["b", "a"]  # generation order is kept
    assert spec.param == "response_format.json_schema.schema"
    assert parse_response_format({"type": "regex", "regex": r"\d+"}) == ConstraintSpec(
        "regex", r"\d+"
    )
    g = parse_response_format({"type": "grammar", "grammar": 'root ::= "a"'})
    assert g == ConstraintSpec("grammar", 'root ::= "a"')
    c = parse_response_format({"type": "choice", "choices": ["yes", "no"]})
    assert c == ConstraintSpec("choice", ("yes", "no"))
    assert ConstraintSpec("json_object").schema() == {"type": "object"}


def test_structured_outputs_kinds():
    assert parse_structured_outputs({"json": SCHEMA}).schema() == SCHEMA
    assert parse_structured_outputs({"json": json.dumps(SCHEMA)}).schema() == SCHEMA
    assert parse_structured_outputs({"regex": "a+"}) == ConstraintSpec("regex", "a+")
    assert parse_structured_outputs({"choice": ["x"]}) == ConstraintSpec("choice", ("x",))
    assert parse_structured_outputs({"grammar": 'root ::= "a"'}).kind == "grammar"
    assert parse_structured_outputs({"json_object": True}).kind == "json_object"
    # vLLM's backend-tuning options are accepted alongside.
    spec = parse_structured_outputs({"regex": "a+", "disable_any_whitespace": True})
    assert spec.kind == "regex"


def test_parse_constraint_combines_both_fields():
    assert parse_constraint() is None
    assert parse_constraint({"type": "text"}, None) is None
    assert parse_constraint(None, {"regex": "a"}).kind == "regex"
    with pytest.raises(GrammarError, match="not both") as e:
        parse_constraint({"type": "json_object"}, {"regex": "a"})
    assert e.value.param == "structured_outputs"


def test_key_depends_on_kind_and_payload_only():
    a = parse_response_format({"type": "json_schema", "json_schema": {"name": "a", "schema": {}}})
    b = parse_structured_outputs({"json": {}})
    assert a.key == b.key and a == b
    assert ConstraintSpec("regex", "a").key != ConstraintSpec("grammar", "a").key
    assert ConstraintSpec("choice", ("a", "b")).key != ConstraintSpec("choice", ("b", "a")).key


BAD_RESPONSE_FORMATS = [
    ("nope", "response_format", "must be an object"),
    ({"type": "xml"}, "response_format.type", "must be one of"),
    ({}, "response_format.type", "must be one of"),
    ({"type": "json_schema"}, "response_format.json_schema", "must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema",
     "is required"),
    ({"type": "json_schema", "json_schema": {"name": 3, "schema": {}}},
     "response_format.json_schema.name", "must be a string"),
    ({"type": "json_schema", "json_schema": {"schema": []}}, "response_format.json_schema.schema",
     "must be an object"),
    ({"type": "json_schema", "json_schema": {"schema": False}},
     "response_format.json_schema.schema", "no value can satisfy"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}},
     "response_format.json_schema.strict", "must be a boolean"),
    ({"type": "regex"}, "response_format.regex", "non-empty string"),
    ({"type": "regex", "regex": ""}, "response_format.regex", "non-empty string"),
    ({"type": "grammar", "grammar": 5}, "response_format.grammar", "non-empty string"),
    ({"type": "choice", "choices": []}, "response_format.choices", "non-empty list"),
    ({"type": "choice", "choices": "ab"}, "response_format.choices", "non-empty list"),
    ({"type": "choice", "choices": ["a", 1]}, "response_format.choices", "only strings"),
    ({"type": "regex", "regex": "a" * (MAX_SPEC_BYTES + 1)}, "response_format.regex", "limit"),
]  # fmt: skip


@pytest.mark.parametrize("rf,param,message", BAD_RESPONSE_FORMATS)
def test_bad_response_format(rf, param: str, message: str):
    with pytest.raises(GrammarError, match=message) as e:
        parse_response_format(rf)
    assert e.value.param == param
    assert isinstance(e.value, ValueError)


BAD_STRUCTURED_OUTPUTS = [
    ([], "structured_outputs", "must be an object"),
    ({}, "structured_outputs", "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs", "exactly one"),
    ({"regex": "a", "colour": 1}, "structured_outputs", "unknown fields"),
    ({"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
    ({"structural_tag": "{}"}, "structured_outputs.structural_tag", "not supported"),
    ({"choice": [None]}, "structured_outputs.choice", "only strings"),
]


@pytest.mark.parametrize("so,param,message", BAD_STRUCTURED_OUTPUTS)
def test_bad_structured_outputs(so, param: str, message: str):
    with pytest.raises(GrammarError, match=message) as e:
        parse_structured_outputs(so)
    assert e.value.param == param


BAD_SCHEMAS = [
    ({"type": "strnig"}, "invalid JSON schema at type"),
    ({"type": "object", "properties": {"a": {"minLength": -1}}}, "properties/a/minLength"),
    ({"type": "object", "required": "a"}, "invalid JSON schema at required"),
    ({"$ref": "#/$defs/missing"}, "does not resolve"),
    ({"properties": {"a": {"$ref": "#/definitions/A"}}, "definitions": {}}, "does not resolve"),
]


@pytest.mark.parametrize("schema,message", BAD_SCHEMAS)
def test_malformed_schema_is_a_grammar_error(schema, message: str):
    with pytest.raises(GrammarError, match=message) as e:
        parse_structured_outputs({"json": schema})
    assert e.value.param == "structured_outputs.json"


def test_resolving_refs_and_data_that_looks_like_refs_are_fine():
    schema = {
        "$defs": {"A": {"type": "integer"}},
        "properties": {"a": {"$ref": "#/$defs/A"}, "b": {"const": {"$ref": "#/nowhere"}}},
    }
    assert parse_structured_outputs({"json": schema}).schema() == schema
    ecma = {"type": "string", "pattern": r"^\p{L}+$"}  # valid ECMA-262, not a Python regex
    assert parse_structured_outputs({"json": ecma}).schema() == ecma
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"A": {}},
              "items": {"$ref": "#/definitions/A"}}  # fmt: skip
    assert parse_structured_outputs({"json": draft7}).kind == "json_schema"
