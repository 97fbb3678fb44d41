"""The last line of defence: check a finished constrained output against its spec.

Backends silently ignore some keywords (string formats, uniqueItems, some minItems/allOf
shapes), so a grammar-complete output can still break its schema. The engine calls this on
every output that finished with "stop" and never reports a failing one as valid.
"""

from __future__ import annotations

import functools
import json
import re

import jsonschema
import regex
from jsonschema.protocols import Validator

from grammar.spec import ConstraintSpec

# Patterns are checked with the `regex` module under this time limit: Python's backtracking
# `re` takes exponential time on patterns like `(a|a)*b|a*c`, and the check runs on the engine
# thread, so one request's pattern would stall every other request. `regex` also reads the
# `\p{L}` classes that ECMA-262 / Rust patterns use and `re` refuses.
PATTERN_TIMEOUT_S = 0.1


def check_output(spec: ConstraintSpec, text: str) -> str | None:
    """None if `text` satisfies `spec`, else a one-line reason.

    EBNF grammars have no independent checker: the matcher's termination is the proof.
    """
    if spec.kind == "tool_calls":
        from grammar.tools import check_tool_output

        return check_tool_output(spec, text)
    if spec.kind in ("json_object", "json_schema"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            return f"output is not JSON: {e}"
        schema = spec.schema()
        cls = with_safe_patterns(
            jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        )
        try:
            error = jsonschema.exceptions.best_match(
                cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(value)
            )
        except re.error:  # a key of unevaluatedProperties' patterns `re` does not read
            return None
        if error is not None:
            where = "/".join(str(x) for x in error.absolute_path) or "(root)"
            return f"output does not match the schema at {where}: {error.message}"
        return None
    if spec.kind == "regex":
        assert isinstance(spec.payload, str)
        ok = _matches(spec.payload, text, full=True)
        return None if ok is not False else "output does not match the regex"
    if spec.kind == "choice":
        assert isinstance(spec.payload, tuple)
        return None if text in spec.payload else "output is not one of the choices"
    return None


def _matches(pattern: str, text: str, full: bool) -> bool | None:
    """Whether `text` matches `pattern` (whole, or anywhere); None when Python cannot tell (a
    dialect `regex` does not read, or past the time limit): then the grammar matcher, an
    automaton that enforced the pattern token by token, is trusted."""
    find = regex.fullmatch if full else regex.search
    try:
        return find(pattern, text, timeout=PATTERN_TIMEOUT_S) is not None
    except (regex.error, TimeoutError):
        return None


@functools.cache
def with_safe_patterns(cls: type[Validator]) -> type[Validator]:
    """`cls` with its `pattern`, `patternProperties` and `additionalProperties` keywords
    matching names and strings by `_matches`. A name whose match Python cannot tell is
    trusted to the matcher alone (neither the pattern's subschema nor additionalProperties
    is checked on it), rather than the whole output."""

    def pattern(validator, patrn, instance, schema):  # noqa: ANN001, ANN202 - jsonschema's
        if validator.is_type(instance, "string") and _matches(patrn, instance, False) is False:
            yield jsonschema.ValidationError(f"{instance!r} does not match {patrn!r}")

    def pattern_properties(validator, patterns, instance, schema):  # noqa: ANN001, ANN202
        if not validator.is_type(instance, "object"):
            return
        for patrn, subschema in patterns.items():
            for name, value in instance.items():
                if _matches(patrn, name, False):
                    yield from validator.descend(value, subschema, path=name, schema_path=patrn)

    def additional_properties(validator, extra, instance, schema):  # noqa: ANN001, ANN202
        if not validator.is_type(instance, "object"):
            return
        names = schema.get("properties", {})
        patterns = schema.get("patternProperties", {})
        extras = [n for n in instance if n not in names
                  and all(_matches(p, n, False) is False for p in patterns)]  # fmt: skip
        if validator.is_type(extra, "object"):
            for name in extras:
                yield from validator.descend(instance[name], extra, path=name)
        elif extra is False and extras:
            listed = ", ".join(repr(n) for n in sorted(extras))
            yield jsonschema.ValidationError(f"additional properties are not allowed ({listed})")

    return jsonschema.validators.extend(
        cls,
        {
            "pattern": pattern,
            "patternProperties": pattern_properties,
            "additionalProperties": additional_properties,
        },
    )
