"""The last line of defence: check a finished constrained output against its spec.

Backends silently ignore some keywords (string formats, uniqueItems, some minItems/allOf
shapes), so a grammar-complete output can still break its schema. The engine calls this on
every output that finished with "stop" and never reports a failing one as valid.
"""

from __future__ import annotations

import json
import re

import jsonschema

from grammar.spec import ConstraintSpec


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
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        error = jsonschema.exceptions.best_match(
            cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(value)
        )
        if error is not None:
            where = "/".join(str(x) for x in error.absolute_path) or "(root)"
            return f"output does not match the schema at {where}: {error.message}"
        return None
    if spec.kind == "regex":
        assert isinstance(spec.payload, str)
        try:
            ok = re.fullmatch(spec.payload, text) is not None
        except re.error:
            return None  # a dialect Python's `re` does not read; trust the matcher
        return None if ok else "output does not match the regex"
    if spec.kind == "choice":
        assert isinstance(spec.payload, tuple)
        return None if text in spec.payload else "output is not one of the choices"
    return None
