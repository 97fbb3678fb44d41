"""Tool-call output formats and their deterministic, incremental parser.

Three formats, each the one a family of chat templates teaches its models:

- `HERMES` (Qwen2.5, Hermes 2/3, Hermes-2-Pro-Mistral, and the generic fallback prompt), several
  calls separated by a newline:

      <tool_call>
      {"name": "<tool name>", "arguments": <JSON object>}
      </tool_call>

- `LLAMA3_JSON` (Llama 3.1-3.3's JSON tool calling), several calls separated by "; ":

      {"name": "<tool name>", "parameters": <JSON object>}

- `MISTRAL` (Mistral's v11+ templates: Mistral Small 3.2, Magistral, Devstral), calls back to
  back, `[TOOL_CALLS]` and `[ARGS]` being special tokens of the tokenizer:

      [TOOL_CALLS]<tool name>[ARGS]<JSON object>

The grammar (grammar/tools.py) makes any other shape impossible, so the parser never guesses:
it finds a call at its fixed header, reads the arguments as one JSON object (tracking strings
and nesting, so a brace inside a string never ends it) and expects the fixed end marker.
Streaming and non-streaming use the same parser: the streamed events concatenate to exactly
what one `feed(text, final=True)` returns.

A forced parser (tool_choice `required` or a named tool, whose grammar admits calls only) never
emits text: a marker cut short by `max_tokens` at the end (`<tool` after a call) is the start
of a call that never came, and is dropped. In `auto` mode the same held-back text is released
as text at the end: free text may contain a prefix of the trigger, and it never became one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


@dataclass(frozen=True)
class CallFormat:
    """A call is `head + name + args_head + <JSON object> + end`; calls are joined by
    `separator`. In `auto` mode free text runs until `trigger` (a prefix of `head`)."""

    name: str
    trigger: str
    head: str
    args_head: str
    end: str
    separator: str
    special: tuple[str, ...] = ()  # markers that are special tokens: decoded, never skipped

    def render(self, name: str, arguments: str) -> str:
        """One call in this format (for histories and the fallback prompt)."""
        return f"{self.head}{name}{self.args_head}{arguments}{self.end}"


HERMES = CallFormat("hermes", "<tool_call>", '<tool_call>\n{"name": "', '", "arguments": ',
                    "}\n</tool_call>", "\n")
LLAMA3_JSON = CallFormat("llama3_json", '{"name": "', '{"name": "', '", "parameters": ', "}",
                         "; ")
MISTRAL = CallFormat("mistral", "[TOOL_CALLS]", "[TOOL_CALLS]", "[ARGS]", "", "",
                     special=("[TOOL_CALLS]", "[ARGS]"))
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}


def template_call_format(template: object) -> CallFormat | None:
    """The call format a chat template renders tools and tool calls in itself; None when it
    knows no tools (the gateway then writes the generic fallback prompt)."""
    if not isinstance(template, str) or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template and "[ARGS]" in template:
        return MISTRAL
    if '"parameters": ' in template and "tool_call" in template:
        return LLAMA3_JSON
    return None


def marker_tokens(tokenizer: Any) -> dict[int, str]:
    """Special tokens of `tokenizer` that its call format writes (Mistral's `[TOOL_CALLS]`):
    id -> text. Decoding keeps their text and grammars may emit them, so calls parse."""
    fmt = template_call_format(getattr(tokenizer, "chat_template", None))
    if fmt is None or not fmt.special:
        return {}
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return {i: t.content for i, t in added.items() if t.content in fmt.special}


def render_call(name: str, arguments: str) -> str:
    """One call in the Hermes format."""
    return HERMES.render(name, arguments)


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class Arguments:
    index: int
    text: str  # a fragment of the call's arguments JSON


@dataclass(frozen=True)
class CallEnd:
    index: int


Event = Text | CallStart | Arguments | CallEnd


@dataclass
class ParsedCall:
    name: str
    arguments: str = ""  # the JSON text exactly as generated
    complete: bool = False


@dataclass
class ParsedOutput:
    content: str | None  # text outside the calls, trailing whitespace dropped; None if empty
    calls: list[ParsedCall] = field(default_factory=list)
    malformed: str | None = None  # why the text is not in the format (never with a grammar)


class ToolCallParser:
    """Splits generated text into content and calls, one delta at a time.

    Text that could still turn into a marker (a prefix of the trigger in content, of the end
    marker after the arguments) is held back until the next delta settles it; whitespace at the
    end of content is held until non-space text follows, so whitespace before a call and at the
    end is dropped in both modes alike. The separator right after a call is dropped too.

    `forced` (tool_choice `required` or a named tool): the output is calls only. Text other
    than whitespace makes it malformed and is never emitted; a marker still held back when the
    output ends (cut by `max_tokens`) is dropped, not released as text.
    """

    def __init__(self, fmt: CallFormat = HERMES, forced: bool = False) -> None:
        self.fmt, self.forced = fmt, forced
        self._buf = ""
        self._state = "text"  # text | head | args | end | sep | bad
        self._space = ""  # held-back trailing whitespace of content
        self._json = _ObjectScanner()
        self.result = ParsedOutput(None)

    def feed(self, text: str, final: bool = False) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while self._step(events, final):
            pass
        if final:  # what is left is a malformed rest or, forced, a marker cut short
            self._buf = ""
        return events

    def _step(self, events: list[Event], final: bool) -> bool:
        """Consume what can be decided now; True when progress allows another step."""
        buf, calls, fmt = self._buf, self.result.calls, self.fmt
        if self._state == "text":
            i = buf.find(fmt.trigger)
            n = i if i >= 0 else len(buf) - self._held(buf, fmt.trigger, final)
            if not self._text(buf[:n], events):
                return False
            self._buf = buf[n:]
            if i >= 0:
                self._state = "head"
            return i >= 0
        if self._state == "head":
            if len(buf) < len(fmt.head):
                return self._expect(fmt.head.startswith(buf) and not final, "a call header")
            if not buf.startswith(fmt.head):
                return self._expect(False, "a call header")
            j = buf.find(fmt.args_head, len(fmt.head))
            name = buf[len(fmt.head): j if j >= 0 else len(buf)]
            if j < 0:  # the name, maybe followed by the start of args_head, is still arriving
                name = name[: len(name) - _partial_suffix(name, fmt.args_head)]
                could_be = (not name or NAME.fullmatch(name) is not None) and not final
                return self._expect(could_be, "a tool name")
            if NAME.fullmatch(name) is None:
                return self._expect(False, "a tool name")
            calls.append(ParsedCall(name))
            events.append(CallStart(len(calls) - 1, name))
            self._buf, self._state = buf[j + len(fmt.args_head):], "args"
            self._json = _ObjectScanner()
            return True
        if self._state == "args":
            n = self._json.scan(buf)
            if n < 0:
                return self._expect(False, "a JSON object of arguments")
            if n > 0:
                calls[-1].arguments += buf[:n]
                events.append(Arguments(len(calls) - 1, buf[:n]))
            self._buf = buf[n:]
            if not self._json.done:
                return False
            self._state = "end"
            return True
        if self._state in ("end", "sep"):
            marker = fmt.end if self._state == "end" else fmt.separator
            if not buf.startswith(marker):
                if marker.startswith(buf) and (not final or self.forced):
                    return False  # a prefix of the marker: wait for more (forced: a cut)
                if self._state == "end":
                    return self._expect(False, f"{marker!r} after the arguments")
                self._state = "text"  # no separator: free text (or the end) follows
                return True
            self._buf = buf[len(marker):]
            if self._state == "end":
                calls[-1].complete = True
                events.append(CallEnd(len(calls) - 1))
            self._state = "sep" if self._state == "end" else "text"
            return True
        return False  # bad: the rest is ignored

    def _expect(self, could_still_match: bool, what: str) -> bool:
        if not could_still_match:
            self._fail(f"expected {what} in the {self.fmt.name} call format")
        return False

    def _fail(self, why: str) -> None:
        self._state = "bad"
        self.result.malformed = why

    def _held(self, text: str, marker: str, final: bool) -> int:
        """How much of the end of `text` to hold back as a possible start of `marker`: all of
        a proper prefix until the output ends; then nothing, but a forced output never lets
        it out (a call that was cut inside its marker)."""
        return _partial_suffix(text, marker) if self.forced or not final else 0

    def _text(self, text: str, events: list[Event]) -> bool:
        """Content outside the calls; False (malformed) for non-space text when forced."""
        if self.forced and text.strip():
            self._fail("text outside the tool calls")
            return False
        if not text:
            return True
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body):]
        if body:
            events.append(Text(body))
            self.result.content = (self.result.content or "") + body
        return True


def parse_tool_output(text: str, fmt: CallFormat = HERMES, forced: bool = False) -> ParsedOutput:
    """The whole output at once: what the streamed events add up to."""
    parser = ToolCallParser(fmt, forced)
    parser.feed(text, final=True)
    return parser.result


def arguments_error(
    call: ParsedCall,
    schema: dict[str, object] | bool,
    validate: Callable[[dict[str, object] | bool, object], str | None],
) -> str | None:
    """Why a parsed call's arguments are not a valid instance of `schema` (None: valid).
    `validate(schema, value)` returns a reason or None."""
    if not call.complete:
        return f"the call to {call.name!r} is incomplete"
    try:
        value = json.loads(call.arguments)
    except json.JSONDecodeError as e:
        return f"the arguments of {call.name!r} are not JSON: {e}"
    if not isinstance(value, dict):
        return f"the arguments of {call.name!r} are not a JSON object"
    why = validate(schema, value)
    return None if why is None else f"the arguments of {call.name!r} are invalid: {why}"


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class _ObjectScanner:
    """Finds where one JSON object ends, fed piece by piece: tracks nesting and strings (with
    escapes), so braces inside strings never count. Leading whitespace is allowed."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped, self.done = 0, False, False, False

    def scan(self, text: str) -> int:
        """How many characters of `text` belong to the object (all of them while it is open);
        -1 if the text does not start a JSON object."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif self.depth == 0 and ch != "{":
                if not ch.isspace():
                    return -1
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)
