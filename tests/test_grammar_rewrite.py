"""grammar/rewrite.py: each rewrite on the MaskBench dev cases that motivated it, and a property
test over the dev split: on every case a rewrite changes, the rewritten schema still accepts
every valid instance (jsonschema), and the case passes through the real GrammarCompiler."""

from __future__ import annotations

import itertools
import json
from functools import cache

import jsonschema
import pytest
import torch

from grammar.backend import BackendError
from grammar.backends.llguidance import LLGuidanceBackend
from grammar.bench import refused_at
from grammar.compiler import GrammarCompiler
from grammar.rewrite import (
    BESIDE_REF,
    DEPENDENCY_KEYS,
    LEGACY_DRAFTS,
    _cyclic_refs,
    _resolve,
    dependencies_as_any_of,
    disjoint_one_of,
    merge_patterns,
    ref_cycles,
    rewrite_schema,
)
from grammar.spec import GrammarError, parse_structured_outputs
from grammar.validate import check_output
from grammar.vocab import TokenVocab
from tests.maskbench import MASKBENCH

needs_dev = pytest.mark.skipif(not MASKBENCH.is_dir(), reason="needs the MaskBench dev set")

# llguidance fixes the order of an object's properties to the schema's `properties` order, then
# the undeclared ones; these cases list a valid instance's keys in another order (the Glaive
# schemas' keys are sorted), which no rewrite can fix. The property test feeds those instances
# in the schema's order.
PROPERTY_ORDER = {
    "Glaiveai2K---calculate_area_3547f407",
    "Glaiveai2K---calculate_area_57a2de86",
    "Glaiveai2K---calculate_volume_82c6c066",
    "JsonSchemaStore---dart-test",  # an undeclared "$schema" key first
}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from engine.config import default_cache_dir
    from engine.runner.loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(None, default_cache_dir()))


@pytest.fixture(scope="module")
def backends(tokenizer) -> dict[str, LLGuidanceBackend]:
    vocab = TokenVocab.from_tokenizer(tokenizer, len(tokenizer))
    return {
        "llguidance": LLGuidanceBackend(vocab),
        "llguidance-relaxed": LLGuidanceBackend(vocab, relaxed=True),
    }


def case(name: str) -> dict:
    return json.loads((MASKBENCH / f"{name}.json").read_text())


def valid(schema: object, value: object) -> bool:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema).is_valid(value)


def grammar_accepts(backend: LLGuidanceBackend, tokenizer, schema: object, value: object) -> bool:
    spec = parse_structured_outputs({"json": schema})
    matcher = backend.load(backend.compile(spec))()
    ids = tokenizer.encode(json.dumps(value), add_special_tokens=False)
    bitmask = torch.zeros(1, (len(tokenizer) + 31) // 32, dtype=torch.int32)
    return refused_at(matcher, ids, tokenizer.eos_token_id, bitmask, []) is None


def nodes(x: object):
    """Every dict below `x` (schemas, and some maps of names: enough to find keywords)."""
    if isinstance(x, dict):
        yield x
        x = list(x.values())
    if isinstance(x, list):
        for v in x:
            yield from nodes(v)


# -- oneOf ---------------------------------------------------------------------------------


@cache
def required_one_ofs() -> list[list[dict]]:
    """Every `oneOf` of `required` lists in the dev split, once."""
    seen: dict[str, list[dict]] = {}
    for path in sorted(MASKBENCH.glob("*.json")):
        if '"oneOf"' in (text := path.read_text()):
            for node in nodes(json.loads(text)["schema"]):
                one_of = node.get("oneOf")
                if isinstance(one_of, list) and disjoint_one_of(one_of) is not None:
                    seen[json.dumps(one_of, sort_keys=True)] = one_of
    return list(seen.values())


@needs_dev
def test_one_of_rewrite_is_exact_on_every_dev_one_of():
    """The rewritten branches accept exactly what the oneOf does, read as oneOf or as anyOf
    (as backends read it): every subset of the keys involved, and non-objects."""
    assert len(required_one_ofs()) >= 8
    for branches in required_one_ofs():
        out = disjoint_one_of(branches)
        keys = sorted({k for b in branches for k in b["required"]})
        subsets = itertools.chain.from_iterable(
            itertools.combinations(keys, n) for n in range(len(keys) + 1)
        )
        for value in [*({k: 1 for k in s} for s in subsets), 1, "x", None, []]:
            want = valid({"oneOf": branches}, value)
            assert valid({"oneOf": out}, value) == want == valid({"anyOf": out}, value), value


@needs_dev
def test_one_of_rewrite_accepts_what_the_old_one_refused(backends, tokenizer):
    """calculate_area: `dimensions` is oneOf [{length, width}, {radius}]. {length, radius}
    matches the second branch alone; the old rewrite forbade length there."""
    schema = rewrite_schema(case("Glaiveai2K---calculate_area_3547f407")["schema"])
    both = {"dimensions": {"length": 3, "radius": 10}, "shape": "circle"}  # schema's key order
    three = {"dimensions": {"length": 3, "radius": 10, "width": 2}, "shape": "circle"}
    assert valid(schema, both) and not valid(schema, three)
    assert grammar_accepts(backends["llguidance"], tokenizer, schema, both)
    assert not grammar_accepts(backends["llguidance"], tokenizer, schema, three)


@needs_dev
def test_contradictory_one_of_is_refused(backends):
    """calculate_area_f88fb53c's `measurements` requires length, width and radius, and is
    oneOf [{length, width}, {radius}]: every object matches both branches. Each rewritten
    branch forbids a key the schema requires, so llguidance sees that nothing is valid."""
    dims = case("Glaiveai2K---calculate_area_f88fb53c")["schema"]["properties"]["measurements"]
    full = {"length": 1, "width": 2, "radius": 3}
    assert not valid(dims, full) and not valid(rewrite_schema(dims), full)
    with pytest.raises(BackendError, match="Unsatisfiable"):
        backends["llguidance"].compile(parse_structured_outputs({"json": dims}))


# -- patternProperties ---------------------------------------------------------------------

OVERLAP = {
    "type": "object",
    "patternProperties": {"^.{1,3}$": {"type": "integer"}, "a": {"type": "number"}},
    "additionalProperties": False,
}


def test_overlapping_patterns_compile_as_their_union(backends, tokenizer):
    """llguidance refuses overlapping patterns; merged, every name that matches either is
    allowed the values of either, and check_output enforces both where both match."""
    backend = backends["llguidance"]
    _, rewrite = backend.compile_schemas(parse_structured_outputs({"json": OVERLAP}))
    assert rewrite(OVERLAP)["patternProperties"] == {
        "(?:^.{1,3}$)|(?:a)": {"anyOf": [{"type": "integer"}, {"type": "number"}]}
    }
    for value, ok in [({"ab": 2}, True), ({"abcd": 1.5}, True), ({"xyz": 1}, True),
                      ({"abcd": "x"}, False), ({"xyzw": 1}, False)]:  # fmt: skip
        assert valid(OVERLAP, value) == ok == grammar_accepts(backend, tokenizer, OVERLAP, value)
    spec = parse_structured_outputs({"json": OVERLAP})
    assert grammar_accepts(backend, tokenizer, OVERLAP, {"ab": 1.5})  # looser than the schema
    assert "is not of type 'integer'" in check_output(spec, '{"ab": 1.5}')


def test_final_check_reads_patterns_python_re_cannot():
    """`\\p{L}` is ECMA and Rust regex, not Python's `re`: check_output used to skip the whole
    output on such a patternProperties key; it now matches names with `regex`."""
    letters = {**OVERLAP["patternProperties"], "^\\p{L}+$": {"type": "string"}}
    spec = parse_structured_outputs({"json": {**OVERLAP, "patternProperties": letters}})
    assert check_output(spec, '{"xyz": 1}') is not None  # a name of letters: a string
    assert check_output(spec, '{"ab": 1.5}') is not None  # `^.{1,3}$`: an integer
    assert check_output(spec, '{"1234": 1}') is not None  # no pattern: additional, refused
    assert check_output(spec, '{"12": 1, "éééé": "x"}') is None


def test_overlapping_patterns_with_one_subschema_merge_exactly():
    same = {"type": "string"}
    assert merge_patterns({"^x": same, "y$": same, "^z": {}}, ("^x/ and /y$",)) == {
        "(?:^x)|(?:y$)": same,
        "^z": {},
    }


@needs_dev
def test_overlapping_patterns_of_a_dev_case(backends):
    """o83286's devices: unanchored `netdir_...`, `netdrv_...` and `net_...` patterns."""
    schema = case("Github_medium---o83286")["schema"]
    _, rewrite = backends["llguidance-relaxed"].compile_schemas(
        parse_structured_outputs({"json": schema})
    )
    assert len(rewrite.keywords["overlaps"]) == 2
    devices = rewrite(schema)["properties"]["devices"]["patternProperties"]
    assert list(devices) == [
        "(?:netdir_(projects|work|scratch|share))|(?:netdrv_([a-z]+))|(?:net_[a-z]+[0-9]+)"
    ]


# -- $ref cycles with keywords beside them -------------------------------------------------

NODE = {
    "type": "object",
    "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {}}},
}
TREES = [
    {"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}, {"v": 4}]},
    {"v": 1, "kids": [{"kids": []}]},  # a kid without v
    {"v": 1, "kids": [{"v": 2, "kids": [None]}]},
    {"v": 1, "kids": [{"v": "x"}]},
]


def tree(items: dict, dialect: str = "https://json-schema.org/draft/2020-12/schema") -> dict:
    node = json.loads(json.dumps(NODE))
    node["properties"]["kids"]["items"] = items
    return {"$schema": dialect, "$ref": "#/$defs/node", "$defs": {"node": node}}


ITEMS = [
    {"$ref": "#/$defs/node", "required": ["v"]},  # a $ref with a keyword beside it
    {"allOf": [{"$ref": "#/$defs/node"}], "required": ["v"]},
    {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}], "type": ["object", "null"]},
]


@pytest.mark.parametrize("items", ITEMS)
def test_ref_cycles_compile_exactly(backends, tokenizer, items: dict):
    schema = tree(items)
    backend = backends["llguidance"]
    _, rewrite = backend.compile_schemas(parse_structured_outputs({"json": schema}))
    assert rewrite.keywords["cycles"]  # llguidance refused it as it was
    for value in TREES:
        assert valid(ref_cycles(schema), value) == valid(schema, value), value
        assert grammar_accepts(backend, tokenizer, schema, value) == valid(schema, value), value


def test_ref_cycles_up_to_draft_7_ignore_keywords_beside_a_ref(backends, tokenizer):
    schema = tree(ITEMS[0], "http://json-schema.org/draft-07/schema#")
    assert ref_cycles(schema)["$defs"]["node"]["properties"]["kids"]["items"] == {
        "$ref": "#/$defs/node"
    }
    value = TREES[1]  # valid: draft 7 ignores `required` beside the $ref
    assert valid(schema, value)
    assert grammar_accepts(backends["llguidance"], tokenizer, schema, value)


@needs_dev
@pytest.mark.parametrize("name", ["Github_ultra---o39449", "JsonSchemaStore---renovate-schema"])
def test_ref_cycles_of_dev_cases(backends, name: str):
    """Draft-04 schemas with `{"$ref": ..., "type": "object"}` inside their cycles: strict
    llguidance compiles them, with no keyword left beside a `$ref` (draft 4 ignores them)."""
    schema = case(name)["schema"]
    _, rewrite = backends["llguidance"].compile_schemas(parse_structured_outputs({"json": schema}))
    assert any("$ref" in n and set(n) - BESIDE_REF - {"$ref"} for n in nodes(schema))
    assert not any("$ref" in n and set(n) - BESIDE_REF - {"$ref"} for n in nodes(rewrite(schema)))


def test_keywords_beside_a_ref_count_from_draft_2019_on(backends, tokenizer):
    """Up to draft 7 a `$ref` makes its siblings ignored (jsonschema agrees); llguidance
    applied them, refusing valid documents (Github_hard---o13693, drupal-libraries)."""
    llg = backends["llguidance"]
    defs = {"a": {"type": "object", "properties": {"x": {"type": "integer"}}}}
    for draft, ok in [("http://json-schema.org/draft-07/schema#", True),
                      ("https://json-schema.org/draft/2019-09/schema", False)]:
        schema = {"$schema": draft, "definitions": defs, "$defs": defs,
                  "properties": {"p": {"$ref": "#/definitions/a", "required": ["x"]}}}
        for value, want in [({"p": {}}, ok), ({"p": {"x": 1}}, True), ({"p": {"x": "s"}}, False)]:
            assert valid(schema, value) is want, (draft, value)
            assert grammar_accepts(llg, tokenizer, schema, value) is want, (draft, value)


# -- dependencies --------------------------------------------------------------------------

DEPENDENT = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "properties": {"card": {"type": "string"}, "billing": {"type": "string"},
                   "vip": {"type": "boolean"}, "level": {"type": "integer"}},
    "dependencies": {"card": ["billing"], "vip": {"required": ["level"],
                                                  "properties": {"level": {"minimum": 3}}}},
    "additionalProperties": False,
}  # fmt: skip


def test_dependencies_become_any_ofs_only_where_their_draft_defines_them():
    out = rewrite_schema(DEPENDENT)
    assert isinstance(out, dict) and "dependencies" not in out
    assert out["allOf"][0] == {"anyOf": [{"properties": {"card": False}},
                                         {"required": ["card", "billing"]}]}  # fmt: skip
    later = {**DEPENDENT, "$schema": "https://json-schema.org/draft/2020-12/schema"}
    assert rewrite_schema(later) == later  # an unknown keyword there: it asserts nothing
    current = {"type": "object", "dependentRequired": {"a": ["b"]}}
    assert rewrite_schema(current)["allOf"] == [  # type: ignore[index]
        {"anyOf": [{"properties": {"a": False}}, {"required": ["a", "b"]}]}]
    many = {"dependentRequired": {str(i): ["x"] for i in range(5)}}
    assert dependencies_as_any_of(many, frozenset({"dependentRequired"})) == many


def test_dependencies_are_enforced_by_strict_llguidance(backends, tokenizer):
    llg = backends["llguidance"]
    for value, ok in [
        ({"card": "4111", "billing": "x"}, True),
        ({"billing": "x"}, True),
        ({"card": "4111"}, False),  # card without billing
        ({"vip": True, "level": 5}, True),
        ({"vip": True}, False),  # vip without level
        ({"vip": True, "level": 1}, False),  # its schema's minimum
        ({"level": 1}, True),  # no vip: no minimum
    ]:
        assert valid(DEPENDENT, value) is ok, value
        assert grammar_accepts(llg, tokenizer, DEPENDENT, value) is ok, value


def _no_false_subschemas(x: object) -> object:
    """`x` with `properties: {A: false}` written `{A: {"not": {}}}` (drafts 4 and 3 have no
    boolean schemas; the rewrite writes them for llguidance)."""
    if isinstance(x, list):
        return [_no_false_subschemas(v) for v in x]
    if not isinstance(x, dict):
        return x
    out = {k: _no_false_subschemas(v) for k, v in x.items()}
    props = out.get("properties")
    if isinstance(props, dict):
        out["properties"] = {n: {"not": {}} if v is False else v for n, v in props.items()}
    return out


# -- the property test ---------------------------------------------------------------------


def changed_cases(
    backends: tuple[LLGuidanceBackend, ...],
) -> dict[str, tuple[dict, object, bool, bool]]:
    """The dev cases whose schema a rewrite touches when llguidance compiles it (strict, else
    relaxed, as the chain): name -> (case, the rewritten schema, whether the case should pass
    whole, whether the rewrite is exact: no keyword dropped by the relaxed mode). Cases that
    only the dependencies or `$ref`-siblings rewrites touch need not pass whole: many fail on
    property order or on keywords the relaxed mode drops."""
    out = {}
    for path in sorted(MASKBENCH.glob("*.json")):
        text = path.read_text()
        if not any(k in text for k in ('"oneOf"', '"patternProperties"', '"$ref"', '"depend')):
            continue
        data = json.loads(text)
        schema = data["schema"]
        one_of = any(
            isinstance(n.get("oneOf"), list) and disjoint_one_of(n["oneOf"]) for n in nodes(schema)
        )
        patterns = any(len(n.get("patternProperties") or ()) > 1 for n in nodes(schema))
        cycles = isinstance(schema, dict) and bool(_cyclic_refs(schema))
        legacy = jsonschema.validators.validator_for(schema, default=None) in LEGACY_DRAFTS
        beside = legacy and any("$ref" in n and set(n) - BESIDE_REF - {"$ref"}
                                for n in nodes(schema))  # fmt: skip
        depends = any(k in n for n in nodes(schema) for k in DEPENDENCY_KEYS)
        if not (one_of or patterns or cycles or beside or depends):
            continue
        try:
            spec = parse_structured_outputs({"json": schema})
        except GrammarError:
            continue
        for backend in backends:
            try:
                _, rewrite = backend.compile_schemas(spec)
            except BackendError:
                continue
            kw = rewrite.keywords  # type: ignore[attr-defined]
            whole = bool(one_of or kw["overlaps"]
                         or (kw["cycles"] and ref_cycles(schema) != schema))
            if whole or beside or depends:
                out[path.stem] = (data, rewrite(schema), whole, not kw["drop_keys"])
            break
    return out


def in_schema_order(value: object, schema: object, root: object) -> object:
    """`value` with each object's keys in the order llguidance fixes: its schema's declared
    `properties` (through `$ref`s and `allOf`s), then the undeclared ones."""
    parts = schema_parts(schema, root)
    if isinstance(value, list):
        items = next((p["items"] for p in parts if isinstance(p.get("items"), dict)), None)
        return [in_schema_order(v, items, root) for v in value]
    if not isinstance(value, dict):
        return value
    props = {k: v for p in parts for k, v in (p.get("properties") or {}).items()}
    extra = next((p["additionalProperties"] for p in parts
                  if isinstance(p.get("additionalProperties"), dict)), None)  # fmt: skip
    rank = {k: i for i, k in enumerate(props)}
    keys = sorted(value, key=lambda k: rank.get(k, len(rank)))
    return {k: in_schema_order(value[k], props.get(k, extra), root) for k in keys}


def schema_parts(schema: object, root: object, depth: int = 0) -> list[dict]:
    """`schema` and the schemas its `$ref` and `allOf` add to it, in order."""
    if not isinstance(schema, dict) or depth > 8:
        return []
    out = []
    if isinstance(schema.get("$ref"), str):
        out += schema_parts(_resolve(root, schema["$ref"]), root, depth + 1)
    out.append(schema)
    for member in schema.get("allOf") or []:
        out += schema_parts(member, root, depth + 1)
    return out


@needs_dev
def test_every_changed_dev_case_keeps_its_valid_instances_and_passes(backends, tokenizer):
    cases = changed_cases((backends["llguidance"], backends["llguidance-relaxed"]))
    assert {"Github_medium---o83286", "Github_ultra---o39449"} <= cases.keys()
    assert {"JsonSchemaStore---renovate-schema", *PROPERTY_ORDER} <= cases.keys()
    assert {"Github_easy---o68333", "Github_hard---o13693"} <= cases.keys()
    for name, (data, rewritten, _, exact) in cases.items():
        readable = _no_false_subschemas(rewritten)  # drafts 3 and 4 have no boolean schemas
        for test in data["tests"]:
            before = valid(data["schema"], test["data"])
            if exact or before:  # an exact rewrite keeps every verdict, a relaxed one the valid
                assert valid(readable, test["data"]) == before, name
    cases = {n: c for n, c in cases.items() if c[2]}
    bitmask = torch.zeros(1, (len(tokenizer) + 31) // 32, dtype=torch.int32)
    stop = tokenizer.eos_token_id  # the vocab's stop token
    with GrammarCompiler(tokenizer, len(tokenizer), timeout_s=30) as compiler:
        futures = {n: compiler.submit(parse_structured_outputs({"json": d["schema"]}))
                   for n, (d, *_) in cases.items()}  # fmt: skip
        for name, (data, *_) in cases.items():
            grammar = futures[name].result()
            assert grammar.backend.startswith("llguidance"), name
            for k, test in enumerate(data["tests"]):
                value = test["data"]
                if name in PROPERTY_ORDER:
                    value = in_schema_order(value, data["schema"], data["schema"])
                ids = tokenizer.encode(json.dumps(value, ensure_ascii=False),
                                       add_special_tokens=False)  # fmt: skip
                ok = refused_at(grammar.matcher(), ids, stop, bitmask, []) is None
                assert ok == test["valid"], f"{name} instance {k}"
