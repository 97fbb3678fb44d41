"""The tool-call output format and its deterministic, incremental parser.

The model writes calls in the Hermes style (Qwen2.5, Hermes 2/3 and the generic fallback prompt
use it), several separated by a newline:

    <tool_call>
    {"name": "<tool name>", "arguments": <JSON object>}
    </tool_call>

The grammar (grammar/tools.py) makes any other shape impossible, so the parser never guesses:
it splits the text at fixed markers. Streaming and non-streaming use the same parser: the
streamed events concatenate to exactly what one `feed(text, final=True)` returns.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

TRIGGER = "<tool_call>"
CALL_HEAD = '<tool_call>\n{"name": "'
ARGS_HEAD = '", "arguments": '
CALL_END = "}\n</tool_call>"  # the wrapper object's brace, then the closing tag
SEPARATOR = "\n"
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def render_call(name: str, arguments: str) -> str:
    """One call in the model's format (for histories and the fallback prompt)."""
    return f"{CALL_HEAD}{name}{ARGS_HEAD}{arguments}{CALL_END}"


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

    Text that could still turn into a marker (a prefix of `<tool_call>` in content, of
    `}\\n</tool_call>` in arguments) is held back until the next delta settles it; whitespace
    at the end of content is held until non-space text follows, so whitespace before a call
    and at the end is dropped in both modes alike.
    """

    def __init__(self) -> None:
        self._buf = ""
        self._state = "text"  # text | head | args | bad
        self._space = ""  # held-back trailing whitespace of content
        self.result = ParsedOutput(None)

    def feed(self, text: str, final: bool = False) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while self._step(events, final):
            pass
        if final and self._state == "bad" and self._buf:
            self._buf = ""
        return events

    def _step(self, events: list[Event], final: bool) -> bool:
        """Consume what can be decided now; True when progress allows another step."""
        buf, calls = self._buf, self.result.calls
        if self._state == "text":
            i = buf.find(TRIGGER)
            if i >= 0:
                self._text(buf[:i], events)
                self._buf, self._state = buf[i:], "head"
                return True
            keep = 0 if final else _partial_suffix(buf, TRIGGER)
            self._text(buf[: len(buf) - keep], events)
            self._buf = buf[len(buf) - keep:]
            return False
        if self._state == "head":
            if len(buf) < len(CALL_HEAD):
                return self._expect(CALL_HEAD.startswith(buf) and not final, "a call header")
            if not buf.startswith(CALL_HEAD):
                return self._expect(False, "a call header")
            j = buf.find(ARGS_HEAD, len(CALL_HEAD))
            name = buf[len(CALL_HEAD): j if j >= 0 else len(buf)]
            if j < 0:  # the name, maybe followed by the start of ARGS_HEAD, is still arriving
                name = name[: len(name) - _partial_suffix(name, ARGS_HEAD)]
                could_be = (not name or NAME.fullmatch(name) is not None) and not final
                return self._expect(could_be, "a tool name")
            if NAME.fullmatch(name) is None:
                return self._expect(False, "a tool name")
            calls.append(ParsedCall(name))
            events.append(CallStart(len(calls) - 1, name))
            self._buf, self._state = buf[j + len(ARGS_HEAD):], "args"
            return True
        if self._state == "args":
            call, index = calls[-1], len(calls) - 1
            j = buf.find(CALL_END)
            end = j if j >= 0 else len(buf) - (0 if final else _partial_suffix(buf, CALL_END))
            if end > 0:
                call.arguments += buf[:end]
                events.append(Arguments(index, buf[:end]))
            if j < 0:
                self._buf = buf[end:]
                return False
            call.complete = True
            events.append(CallEnd(index))
            self._buf, self._state = buf[j + len(CALL_END):], "text"
            return True
        return False  # bad: the rest is ignored

    def _expect(self, could_still_match: bool, what: str) -> bool:
        if not could_still_match:
            self._state = "bad"
            self.result.malformed = f"expected {what} after {TRIGGER!r}"
        return False

    def _text(self, text: str, events: list[Event]) -> None:
        if not text:
            return
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body):]
        if body:
            events.append(Text(body))
            self.result.content = (self.result.content or "") + body


def parse_tool_output(text: str) -> ParsedOutput:
    """The whole output at once: what the streamed events add up to."""
    parser = ToolCallParser()
    parser.feed(text, final=True)
    return parser.result


def arguments_error(call: ParsedCall, schema: dict | bool, validate) -> str | None:
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
