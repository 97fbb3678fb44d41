"""What one request may carry: checked before any work that grows with it.

Rendering the chat template, tokenising and checking JSON schemas cost time in proportion to
what a request carries, and that work is pure Python (it holds the GIL even off the event
loop). These bounds keep one request's share small; each refusal is a 400 naming the limit and
the parameter. The counts are checked once, on the body's parsed JSON before it is validated
(gateway/body.py); a session's or a response chain's history, put before the request's own
messages, is counted where it is (`check_history`). The prompt's length in tokens stays the
engine's check (`max_model_len`); a prompt with more than `PROMPT_CHARS_PER_TOKEN` characters
per token of the context cannot fit in practice and is refused before it is tokenised.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator

from gateway.errors import APIError, bad_request
from gateway.openai.schemas import ChatCompletionRequest, CompletionRequest

MAX_TOOLS = 128  # OpenAI's limit
MAX_MESSAGES = 2048
MAX_STOP_TOKEN_IDS = 1024  # each is compared with every sampled token
MAX_SCHEMA_BYTES = 128 * 1024  # the JSON of all the tools, or of the constraint field
MAX_SCHEMA_DEPTH = 32  # arrays and objects nested in one tool's parameters or one schema
PROMPT_CHARS_PER_TOKEN = 32  # English averages about 4; code and whitespace runs a few more


def check_counts(body: object) -> None:
    """How many tools, messages (a Responses request's `input` items) and stop token ids,
    without reading them (cheap). `body`: a request, or its parsed JSON before validation.
    (Each stop token id's range is the engine's check, which knows the vocabulary.)"""
    for param, limit in (("tools", MAX_TOOLS), ("messages", MAX_MESSAGES),
                         ("input", MAX_MESSAGES), ("stop_token_ids", MAX_STOP_TOKEN_IDS)):
        items = body.get(param) if isinstance(body, dict) else getattr(body, param, None)
        if isinstance(items, list):
            _at_most(len(items), limit, param)


def check_history(messages: int, param: str = "messages") -> None:
    """The bound on `messages` for a prompt of `messages` messages: a session's or a response
    chain's history and the request's own (which `check_counts` counted as it was read);
    `param`: the field the front end holds them in."""
    _at_most(messages, MAX_MESSAGES, param)


def check_schemas(body: ChatCompletionRequest | CompletionRequest) -> None:
    """Size and nesting of the tools and of `response_format` / `structured_outputs`, before
    they are parsed. Walks them: call it off the event loop."""
    fields: dict[str, object] = {"response_format": body.response_format,
                                 "structured_outputs": body.structured_outputs}
    if isinstance(body, ChatCompletionRequest):
        fields["tools"] = body.tools
    check_schema_fields(fields, _schemas(body))


def check_schema_fields(fields: dict[str, object],
                        schemas: Iterable[tuple[str, object]]) -> None:
    """The bounds of `check_schemas` for any front end: `fields` (param -> value) that hold
    schemas, each at most MAX_SCHEMA_BYTES of JSON, and each (param, schema) nested at most
    MAX_SCHEMA_DEPTH deep."""
    for param, value in fields.items():
        if value is None:
            continue
        size = len(json.dumps(value, ensure_ascii=False).encode())
        if size > MAX_SCHEMA_BYTES:
            raise _too_large(f"'{param}' is {size} bytes of JSON; the limit is "
                             f"{MAX_SCHEMA_BYTES}.", param)
    for param, schema in schemas:
        if _deeper_than(schema, MAX_SCHEMA_DEPTH):
            raise _too_large(f"'{param}' nests arrays and objects more than {MAX_SCHEMA_DEPTH} "
                             "levels deep; flatten it or use '$defs' and '$ref'.", param)


def check_prompt_chars(chars: int, max_model_len: int, param: str) -> None:
    """Refuse a prompt too long to fit the context, before tokenising it."""
    limit = max_model_len * PROMPT_CHARS_PER_TOKEN
    if chars > limit:
        raise bad_request(
            f"The prompt is {chars} characters long; this model's context of {max_model_len} "
            f"tokens takes at most {limit} ({PROMPT_CHARS_PER_TOKEN} a token). Shorten the "
            f"'{param}'.", param, code="context_length_exceeded")


def _schemas(body: ChatCompletionRequest | CompletionRequest) -> Iterator[tuple[str, object]]:
    """(param, JSON schema) for each schema the request carries, where it is where expected
    (anything else is the parser's to refuse)."""
    for i, tool in enumerate(getattr(body, "tools", None) or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict):
            yield f"tools[{i}].function.parameters", fn.get("parameters")
    js = (body.response_format or {}).get("json_schema")
    if isinstance(js, dict):
        yield "response_format.json_schema.schema", js.get("schema")
    yield "structured_outputs.json", (body.structured_outputs or {}).get("json")


def _deeper_than(value: object, limit: int) -> bool:
    """Whether `value` nests arrays and objects more than `limit` levels deep (a scalar: 0)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children)
    return False


def _at_most(n: int, limit: int, param: str) -> None:
    if n > limit:
        raise bad_request(f"Invalid '{param}': array too long. Expected an array with maximum "
                          f"length {limit}, but got an array with length {n} instead.", param,
                          code="array_above_max_length")


def _too_large(message: str, param: str) -> APIError:
    return bad_request(message, param, code="schema_too_large")
