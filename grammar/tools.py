"""Tool calls as a constraint: OpenAI `tools` / `tool_choice` / `parallel_tool_calls` ->
a `tool_calls` ConstraintSpec the engine runs like any other grammar.

Pure Python (no torch): the gateway validates tools here and answers a 400 naming the problem.

The constraint (xgrammar structural tag, built by `structural_tag`), in the call format the
model's chat template teaches (grammar/tool_parser.py):
- `required` / a named tool: the whole output is one call (or several, joined by the format's
  separator, when parallel calls are allowed) to an allowed tool, arguments following its schema;
- `auto`: free text (never containing the format's trigger, e.g. `<tool_call>`) until the model
  writes the trigger; from there the call is constrained the same way.
- `none`: no constraint at all (`tool_constraint` returns None).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NotRequired, TypedDict

import jsonschema

from grammar.any_order import any_order_rules, lexemes
from grammar.spec import (
    JSON_MAX_WHITESPACE,
    MAX_SPEC_BYTES,
    ConstraintSpec,
    GrammarError,
    JSONSchema,
    check_json_schema,
)
from grammar.tool_parser import (
    FORMATS,
    HERMES,
    NAME,
    CallFormat,
    ParsedCall,
    ToolCallParser,
    arguments_error,
)

Mode = Literal["none", "auto", "required"]
# A function declared without `parameters` takes none: its arguments are `{}`. (An open object
# let a model under tool_choice "required" write one endless key.)
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, object]  # a JSON schema for the arguments object

    def openai(self) -> dict[str, object]:
        fn: dict[str, object] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    """The validated tool fields of one request."""

    tools: tuple[Tool, ...]  # all offered tools (rendered in the prompt)
    mode: Mode
    allowed: tuple[str, ...]  # the tools the output may call (one for a named tool)
    parallel: bool


class _AllowedTool(TypedDict):
    name: str
    parameters: dict[str, object]


class _Payload(TypedDict):
    """A `tool_calls` spec's payload, as JSON (`tool_constraint` writes it)."""

    format: NotRequired[str]  # a `CallFormat` name (default: Hermes)
    mode: Mode
    parallel: bool
    tools: list[_AllowedTool]


def parse_tools(
    tools: object, tool_choice: object = None, parallel: object = None, flat: bool = False,
    schema_key: str = "parameters",
) -> ToolChoice | None:
    """Validate the request's tool fields; None when no tools are offered. A tool is chat
    completions' `{"type": "function", "function": {"name", "description", "parameters"}}`,
    or with `flat` the Responses API's `{"type": "function", "name", ...}`; `schema_key`: the
    key of the arguments' schema (the Messages API's tools hold it as `input_schema`).

    Raises GrammarError (param: `tools[i]...`, `tool_choice`) for a parameters object that is
    not a JSON schema, duplicate or malformed names, or a tool_choice naming no offered tool.
    """
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise GrammarError("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise GrammarError("tools must be a list", "tools")
    parsed: list[Tool] = []
    for i, t in enumerate(tools):
        parsed.append(_tool(t, f"tools[{i}]", flat, schema_key))
    seen: set[str] = set()
    for i, t in enumerate(parsed):
        if t.name in seen:
            q = f"tools[{i}].name" if flat else f"tools[{i}].function.name"
            raise GrammarError(f"duplicate tool name {t.name!r}", q)
        seen.add(t.name)
    if parallel is not None and not isinstance(parallel, bool):
        raise GrammarError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    mode, allowed = _choice(tool_choice, [t.name for t in parsed])
    named = isinstance(tool_choice, dict)  # a named tool: exactly one call to it
    return ToolChoice(tuple(parsed), mode, allowed, parallel is not False and not named)


def tool_constraint(choice: ToolChoice | None, fmt: CallFormat = HERMES) -> ConstraintSpec | None:
    """The constraint for `choice` in format `fmt` (None when calls are off: no tools or
    tool_choice none)."""
    if choice is None or choice.mode == "none":
        return None
    by_name = {t.name: t for t in choice.tools}
    payload: _Payload = {
        "format": fmt.name,
        "mode": choice.mode,
        "parallel": choice.parallel,
        "tools": [{"name": n, "parameters": by_name[n].parameters} for n in choice.allowed],
    }
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    if len(text.encode()) > MAX_SPEC_BYTES:
        raise GrammarError(f"tools are over the {MAX_SPEC_BYTES} byte limit", "tools")
    return ConstraintSpec("tool_calls", text, param="tools")


def structural_tag(spec: ConstraintSpec) -> dict[str, object]:
    """xgrammar's structural tag (JSON form) for a `tool_calls` spec."""
    payload, fmt = _payload(spec), call_format(spec)
    tags = [
        {
            "type": "tag",
            "begin": f"{fmt.head}{t['name']}{fmt.args_head}",
            "content": {"type": "json_schema", "json_schema": t["parameters"],
                        "max_whitespace_cnt": JSON_MAX_WHITESPACE},
            "end": fmt.end,
        }
        for t in payload["tools"]
    ]
    single = not payload["parallel"]
    tag_format: dict[str, object]
    if payload["mode"] == "required":
        tag_format = {"type": "tags_with_separator", "tags": tags, "separator": fmt.separator,
                      "at_least_one": True, "stop_after_first": single}
    else:
        tag_format = {"type": "triggered_tags", "triggers": [fmt.trigger], "tags": tags,
                      "at_least_one": False, "stop_after_first": single}
    return {"type": "structural_tag", "format": tag_format}


def tool_calls_lark(
    spec: ConstraintSpec,
    rewrite: Callable[[object], object],
    json_options: dict[str, object],
    any_order: bool = False,
) -> str | None:
    """The `required` / named-tool constraint as a Lark grammar with embedded JSON schemas
    (llguidance's `%json`, which enforces `required` and `anyOf` branches exactly where
    xgrammar's structural tags are looser). Each tool's schema goes through `rewrite`; with
    `any_order`, arguments take their keys in any order (`grammar.any_order`), and None where
    no tool's arguments would differ.
    ValueError for `auto`: free text until a trigger needs xgrammar's triggered tags."""
    payload, fmt = _payload(spec), call_format(spec)
    if payload["mode"] != "required":
        raise ValueError("only xgrammar's triggered tags express tool_choice 'auto'")
    rules, names, shared = [], [], []
    for i, t in enumerate(payload["tools"]):
        schema = rewrite(t["parameters"])
        schema = {} if schema is True else schema
        if not isinstance(schema, dict):
            raise ValueError(f"the parameters of {t['name']!r} are not an object schema")
        head = json.dumps(f"{t['name']}{fmt.args_head}")
        rules.append(f"call_{i}: {head} args_{i}")
        written = any_order_rules(schema, json_options, f"t{i}_") if any_order else None
        if written is None:
            rules.append(f"args_{i}: %json {json.dumps({**schema, 'x-guidance': json_options})}")
        else:
            rules += [f"args_{i}: {written[0]}", *written[1]]
            shared = lexemes(JSON_MAX_WHITESPACE)
        names.append(f"call_{i}")
    sep = " SEP" if fmt.separator else ""
    calls = f"call ({sep} call)*" if payload["parallel"] else "call"
    if any_order and not shared:
        return None
    end = f" {json.dumps(fmt.end)}" if fmt.end else ""  # Lark has no empty literal
    return "\n".join([
        f"start: {calls}",
        f"call: {json.dumps(fmt.head)} ({' | '.join(names)}){end}",
        *([f"SEP: {json.dumps(fmt.separator)}"] if fmt.separator else []),
        *shared,
        *rules,
    ])


def check_tool_output(spec: ConstraintSpec, text: str) -> str | None:
    """None if a finished output is in the call format, every call names an allowed tool and
    its arguments validate against that tool's schema; else a one-line reason."""
    payload = _payload(spec)
    schemas = {t["name"]: t["parameters"] for t in payload["tools"]}
    parser = tool_parser(spec)
    parser.feed(text, final=True)
    out = parser.result
    if out.malformed:
        return out.malformed
    if payload["mode"] == "required" and not out.calls:
        return "no tool call in the output"
    if not payload["parallel"] and len(out.calls) > 1:
        return "several tool calls while parallel_tool_calls is false"
    for call in out.calls:
        if call.name not in schemas:
            return f"a call to {call.name!r}, which is not an allowed tool"
        why = arguments_error(call, schemas[call.name], validate_instance)
        if why:
            return why
    return None


def valid_calls(spec: ConstraintSpec, calls: list[ParsedCall]) -> list[ParsedCall]:
    """The leading calls that are complete, name an allowed tool and validate: what a response
    may return as calls (an output cut by max_tokens keeps the calls before the cut)."""
    schemas = {t["name"]: t["parameters"] for t in _payload(spec)["tools"]}
    out = []
    for call in calls:
        if call.name not in schemas or arguments_error(call, schemas[call.name],
                                                       validate_instance):
            break
        out.append(call)
    return out


def validate_instance(schema: JSONSchema, value: object) -> str | None:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    error = jsonschema.exceptions.best_match(
        cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(value)
    )
    if error is None:
        return None
    where = "/".join(str(x) for x in error.absolute_path) or "(root)"
    return f"at {where}: {error.message}"


def tool_parser(spec: ConstraintSpec) -> ToolCallParser:
    """The parser for a `tool_calls` spec's output, in its call format; forced (calls only, no
    text ever) under `required` or a named tool."""
    return ToolCallParser(call_format(spec), forced=_payload(spec)["mode"] == "required")


def call_format(spec: ConstraintSpec) -> CallFormat:
    """The call format a `tool_calls` spec constrains to."""
    return FORMATS[_payload(spec).get("format", HERMES.name)]


def _payload(spec: ConstraintSpec) -> _Payload:
    if spec.kind != "tool_calls" or not isinstance(spec.payload, str):
        raise ValueError(f"not a tool_calls constraint: {spec.kind}")
    return spec.parsed  # parsed once per spec: read-only


def _tool(t: object, p: str, flat: bool = False, schema_key: str = "parameters") -> Tool:
    if not isinstance(t, dict):
        raise GrammarError(f"{p} must be an object", p)
    if t.get("type") != "function":
        raise GrammarError(f"{p}.type must be 'function'; got {t.get('type')!r}", f"{p}.type")
    fn, f = (t, p) if flat else (t.get("function"), f"{p}.function")  # f: fn's param
    if not isinstance(fn, dict):
        raise GrammarError(f"{f} must be an object", f)
    name = fn.get("name")
    if not isinstance(name, str) or NAME.fullmatch(name) is None:
        raise GrammarError(f"{f}.name must match ^[a-zA-Z0-9_-]{{1,64}}$; got {name!r}",
                           f"{f}.name")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise GrammarError(f"{f}.description must be a string", f"{f}.description")
    params = fn[schema_key] if schema_key in fn else copy.deepcopy(NO_PARAMETERS)
    q = f"{f}.{schema_key}"
    if not isinstance(params, dict):
        raise GrammarError(f"{q} must be a JSON schema object", q)
    if params.get("type", "object") != "object":
        raise GrammarError(f"{q} must describe an object (type 'object')", q)
    check_json_schema(params, q)
    return Tool(name, desc, params)


def _choice(choice: object, names: list[str]) -> tuple[Mode, tuple[str, ...]]:
    if choice is None or choice == "auto":
        return "auto", tuple(names)
    if choice == "none":
        return "none", tuple(names)
    if choice == "required":
        return "required", tuple(names)
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise GrammarError("tool_choice.function.name must be a string", "tool_choice")
        if name not in names:
            raise GrammarError(f"tool_choice names {name!r}, which is not among the tools",
                               "tool_choice")
        return "required", (name,)
    raise GrammarError(
        "tool_choice must be 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}', "tool_choice",
    )
