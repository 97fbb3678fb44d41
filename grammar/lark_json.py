"""JSON written in Lark for llguidance: the punctuation and scalar lexemes, key literals, and
`patternProperties` regexes as key lexemes. `grammar.any_order` builds its rules from these."""

from __future__ import annotations

import json
import re

from grammar.rewrite import ascii_digits

# Punctuation lexemes, `_` where whitespace may go. Whitespace is part of the lexemes, never
# an %ignore'd one: llguidance fails on an ignored lexeme right before a `%json` leaf. Each
# place takes it on one side only, and empty containers are one lexeme, so no more of it passes
# than llguidance's own JSON grammar lets through.
PUNCTUATION = {"LBRACE": r"\{_", "RBRACE": r"_\}", "EMPTY_OBJECT": r"\{_\}", "LBRACK": r"\[_",
               "RBRACK": r"_\]", "EMPTY_ARRAY": r"\[_\]", "COMMA": "_,_", "COLON": "_:_"}
SCALARS = {"string": "STRING", "integer": "INTEGER", "number": "NUMBER",
           "boolean": '"true" | "false"', "null": '"null"'}  # fmt: skip
INTEGER = r"/-?(?:0|[1-9][0-9]*)/"
NUMBER = r"/-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?/"
STRING = r'/"(?:[^"\\\x00-\x1f\x7f]|\\["\\\/bfnrt]|\\u[0-9a-fA-F]{4})*"/'
# Key patterns written as lexemes over the key's JSON text: plain characters, classes,
# groups and repeats, `\d`, escaped punctuation, `^` first and `$` last; no escapes in keys.
SIMPLE_PATTERN = re.compile(r"\^?(?:[A-Za-z0-9_\-.*+?()\[\]{},:/@ ]|\\[d.\-/])*\$?")


def lexemes(max_ws: int) -> list[str]:
    """The lexemes the rules use, with up to `max_ws` spaces where JSON allows whitespace."""
    ws = f"[ ]{{0,{max_ws}}}"
    return [*(f"{name}: /{regex.replace('_', ws)}/" for name, regex in PUNCTUATION.items()),
            f"STRING: {STRING}", f"INTEGER: {INTEGER}", f"NUMBER: {NUMBER}"]  # fmt: skip


def scalars(types: list[object]) -> str | None:
    """The Lark body of a value of these JSON scalar types, None if one is not a scalar."""
    if not types or not all(isinstance(t, str) and t in SCALARS for t in types):
        return None
    if "number" in types:  # integers are numbers: one lexeme for both
        types = [t for t in types if t != "integer"]
    return " | ".join(SCALARS[t] for t in dict.fromkeys(types))  # type: ignore[index]


def key_regex(pattern: str) -> str | None:
    """A `patternProperties` regex (which searches the key) as the content of a key lexeme
    over its JSON text, for simple patterns (SIMPLE_PATTERN); None for others."""
    if not SIMPLE_PATTERN.fullmatch(pattern) or "|" in pattern or pattern.endswith("\\$"):
        return None
    head = "" if pattern.startswith("^") else ".*"
    body = pattern.removeprefix("^")
    tail = ".*"
    if body.endswith("$"):
        body, tail = body[:-1], ""
    if "^" in body or "$" in body or '"' in body:
        return None
    body = ascii_digits(body.replace("\\/", "/"))
    return f"{head}(?:{body}){tail}".replace("/", "\\/")


def literal(key: str) -> str:
    """A Lark literal of the key as JSON writes it (`"a"`, quotes included)."""
    return json.dumps(json.dumps(key, ensure_ascii=False), ensure_ascii=False)
