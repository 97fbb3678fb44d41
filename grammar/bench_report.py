"""`grammar-bench --report`: why each failing case fails, one line each, as a Markdown table.

The reasons are written where the bench finds the failure (`grammar.bench.check_case`), from
what it has at hand, so the report costs no second run:

- a valid instance refused: the first token the mask refused (its index in the instance's
  tokens, its text, and the JSON around it with `‸` at the refusal), the instance's end when
  the grammar still wanted more, and what jsonschema says when it disagrees with the case's
  label;
- an invalid instance accepted: the instance and jsonschema's reason it is invalid (its first
  error: keyword, path, message), or that jsonschema finds it valid (the label is wrong);
- a case that did not compile (or timed out): each backend's error.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import jsonschema

from grammar.validate import with_safe_patterns

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CONTEXT = 30  # characters of JSON shown on each side of a refused token
CARET = "‸"  # marks the refusal point in that JSON
MAX_MESSAGE = 160  # characters of a jsonschema message
MAX_REPR = 40  # characters of the instance's repr that opens it
MAX_INSTANCE = 100  # characters of an accepted invalid instance
MAX_REASON = 600  # characters of a whole reason (backend errors can run long)


def refused_valid(
    k: int,
    data: object,
    text: str,
    ids: list[int],
    at: int,
    tokenizer: PreTrainedTokenizerBase,
    schema: object,
) -> str:
    """Why valid instance `k` failed: the mask (or `accept`) refused token `at` of `ids`
    followed by the stop token. `text` is the instance as fed, `ids` its tokens."""
    offset = len(tokenizer.decode(ids[:at]))  # where the refused token starts in `text`
    if at < len(ids):
        token = f"token {at} {code(repr(tokenizer.decode(ids[at : at + 1])))}"
    else:
        token = f"its end (token {at}, the stop token: the grammar wants more)"
    reason = f"valid instance {k} refused at {token}: {code(around(text, offset))}"
    error = schema_error(schema, data)
    if error is not None:
        reason += f"; jsonschema finds it invalid too ({error}): the case's label disagrees"
    return reason


def accepted_invalid(k: int, data: object, text: str, schema: object) -> str:
    """Why invalid instance `k` failed: every token and the stop token were accepted."""
    error = schema_error(schema, data)
    why = f"jsonschema: {error}" if error else "jsonschema finds it valid: the label disagrees"
    return f"invalid instance {k} accepted: {code(clip(text, MAX_INSTANCE))}; {why}"


def schema_error(schema: object, value: object) -> str | None:
    """jsonschema's first reason `value` breaks `schema` as "keyword at path: message", or None
    when it finds `value` valid. Formats are checked, and patterns as `check_output` checks
    them at serving time (the `regex` module, under a time limit)."""
    cls = with_safe_patterns(
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    )
    try:
        validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
        error = next(iter(validator.iter_errors(value)), None)
    except Exception as e:  # an unresolvable $ref, a patternProperties key `re` cannot read...
        return f"jsonschema cannot check it ({type(e).__name__}: {clip(str(e), MAX_MESSAGE)})"
    if error is None:
        return None
    # Most messages open with the instance's repr, then the verdict: cut the repr first.
    message, head = error.message, repr(error.instance)
    if message.startswith(head) and len(head) > MAX_REPR:
        message = head[: MAX_REPR - 1] + "…" + message[len(head) :]
    return f"{error.validator} at {error.json_path}: {clip(message, MAX_MESSAGE)}"


def around(text: str, offset: int) -> str:
    """`text` within CONTEXT characters of `offset`, with CARET at `offset`."""
    lo, hi = max(0, offset - CONTEXT), min(len(text), offset + CONTEXT)
    before = ("…" if lo else "") + text[lo:offset]
    after = text[offset:hi] + ("…" if hi < len(text) else "")
    return before + CARET + after


def clip(s: str, n: int) -> str:
    """`s` on one line, cut to `n` characters."""
    s = re.sub(r"\s*\n\s*", " ", s)
    return s if len(s) <= n else s[: n - 1] + "…"


def code(s: str) -> str:
    """`s` as a Markdown code span: fenced by more backticks than any run of them in `s`."""
    fence = "`" * (max((len(r) for r in re.findall("`+", s)), default=0) + 1)
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    return f"{fence}{pad}{s}{pad}{fence}"


class Outcome(Protocol):
    """One case's result, as the report reads it (grammar/bench.py's `CaseResult`)."""

    name: str
    status: str
    backend: str | None
    detail: str


def markdown(results: Sequence[Outcome], backend: str) -> str:
    """The failing cases as a Markdown table (case | status | backend | reason), sorted by
    status then name, under a line of counts."""
    failed = sorted((r for r in results if r.status != "pass"), key=lambda r: (r.status, r.name))
    lines = [
        f"grammar-bench --backend {backend}: {len(results):,} cases, "
        f"{len(results) - len(failed):,} pass, {len(failed):,} fail.",
        "",
        "| case | status | backend | reason |",
        "|---|---|---|---|",
    ]
    for r in failed:
        cells = (r.name, r.status, r.backend or "—", clip(r.detail, MAX_REASON))
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"
