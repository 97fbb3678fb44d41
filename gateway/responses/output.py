"""A response's output items and body, built the same way for a stream and a whole response.

`OutputBuilder` turns one choice's text into `message` and `function_call` items through the
tool-call parser the chat completions use (grammar/tool_parser.py), and a reasoning model's
reasoning into a `reasoning` item before them, and says each step as a Responses stream event
(`response.output_item.added`, `...output_text.delta`, ...). The non-streamed response feeds
the whole text at once into a builder, so both shapes agree. Events carry no
`sequence_number`; the stream numbers them as it sends them.
"""

from __future__ import annotations

import copy
import uuid

from gateway.responses.items import (
    Item,
    ResponsesRequest,
    function_call,
    new_id,
    output_message,
    output_text,
    reasoning_item,
)
from grammar.spec import ConstraintSpec
from grammar.tool_parser import Arguments, CallEnd, CallStart, Event, Text
from grammar.tools import tool_parser, valid_calls

Event_ = dict[str, object]  # one Responses stream event


class OutputBuilder:
    """The output items of one choice. `spec`: the choice's constraint when it is the
    tool-call format (its text is then split into text and calls), else None."""

    def __init__(self, spec: ConstraintSpec | None):
        self.spec = spec
        self.parser = tool_parser(spec) if spec is not None else None
        self.items: list[Item] = []
        self._open: int | None = None  # the output index still being written

    def feed(self, text: str, final: bool = False) -> list[Event_]:
        if self.parser is not None:
            parsed: list[Event] = self.parser.feed(text, final)
        else:
            parsed = [Text(text)] if text else []
        out: list[Event_] = []
        for e in parsed:
            if isinstance(e, Text):
                out += self._text(e.text)
            elif isinstance(e, CallStart):
                out += self._close("completed")
                item = function_call(new_id("fc"), f"call_{uuid.uuid4().hex[:24]}", e.name, "",
                                     "in_progress")
                out += self._add(item)
            elif isinstance(e, Arguments) and self._open is not None:
                item = self.items[self._open]
                item["arguments"] = str(item["arguments"]) + e.text
                out.append({"type": "response.function_call_arguments.delta",
                            "item_id": item["id"], "output_index": self._open,
                            "delta": e.text})
            elif isinstance(e, CallEnd):
                out += self._close("completed")
        return out

    def reason(self, text: str) -> list[Event_]:
        """Reasoning text (it all comes before the answer): one `reasoning` item."""
        if not text:
            return []
        out: list[Event_] = []
        if self._open is None or self.items[self._open]["type"] != "reasoning":
            out += self._close("completed")
            out += self._add(reasoning_item(new_id("rs"), "", "in_progress"))
        part = self._part()
        part["text"] = str(part["text"]) + text
        out.append({"type": "response.reasoning_text.delta", **self._where(), "delta": text})
        return out

    def finish(self, status: str) -> list[Event_]:
        """Close the item still open: `status` "completed", or "incomplete" when the output
        was cut (an unfinished call stays incomplete either way)."""
        return self._close(status)

    def final_items(self) -> list[Item]:
        """The items a whole response returns: only calls that are complete and validate
        (those before a cut), as chat completions return them."""
        if self.spec is None or self.parser is None:
            return self.items
        keep = len(valid_calls(self.spec, self.parser.result.calls))
        out, calls = [], 0
        for item in self.items:
            if item["type"] == "function_call":
                calls += 1
                if calls > keep:
                    continue
            out.append(item)
        return out

    @property
    def calls(self) -> list[Item]:
        return [i for i in self.final_items() if i["type"] == "function_call"]

    def _text(self, text: str) -> list[Event_]:
        out: list[Event_] = []
        if self._open is None or self.items[self._open]["type"] != "message":
            out += self._close("completed")
            # Added with no parts (as OpenAI's): the part comes in content_part.added, so a
            # client's running snapshot (the openai SDK's) holds it once.
            message = output_message(new_id("msg"), "", "in_progress")
            message["content"] = []
            out += self._add(message)
            message["content"] = [output_text("")]
            out.append({"type": "response.content_part.added", **self._where(),
                        "part": output_text("")})
        part = self._part()
        part["text"] = str(part["text"]) + text
        out.append({"type": "response.output_text.delta", **self._where(), "delta": text,
                    "logprobs": []})
        return out

    def _add(self, item: Item) -> list[Event_]:
        self.items.append(item)
        self._open = len(self.items) - 1
        return [{"type": "response.output_item.added", "output_index": self._open,
                 "item": copy.deepcopy(item)}]

    def _close(self, status: str) -> list[Event_]:
        if self._open is None:
            return []
        index, item = self._open, self.items[self._open]
        self._open = None
        out: list[Event_] = []
        if item["type"] == "message":
            self._open = index  # for _where / _part
            text = str(self._part()["text"])
            out.append({"type": "response.output_text.done", **self._where(), "text": text,
                        "logprobs": []})
            out.append({"type": "response.content_part.done", **self._where(),
                        "part": output_text(text)})
            self._open = None
        elif item["type"] == "reasoning":
            self._open = index
            out.append({"type": "response.reasoning_text.done", **self._where(),
                        "text": str(self._part()["text"])})
            self._open = None
        else:
            out.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                        "output_index": index, "name": item["name"],
                        "arguments": item["arguments"]})
            if self.parser is not None and not self.parser.result.calls[-1].complete:
                status = "incomplete"
        item["status"] = status
        out.append({"type": "response.output_item.done", "output_index": index,
                    "item": copy.deepcopy(item)})
        return out

    def _where(self) -> dict[str, object]:
        assert self._open is not None
        return {"item_id": self.items[self._open]["id"], "output_index": self._open,
                "content_index": 0}

    def _part(self) -> Item:
        assert self._open is not None
        content = self.items[self._open]["content"]
        assert isinstance(content, list)
        part: Item = content[0]
        return part


def response_body(
    body: ResponsesRequest,
    response_id: str,
    created_at: int,
    status: str,
    output: list[Item],
    usage: dict[str, object] | None = None,
    error: dict[str, object] | None = None,
    incomplete: str | None = None,
) -> dict[str, object]:
    """The Response object, as OpenAI shapes it."""
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "background": False, "error": error,
        "incomplete_details": None if incomplete is None else {"reason": incomplete},
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "model": body.model, "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "conversation": ({"id": body.conversation_id} if body.conversation is not None
                         else None),
        "reasoning": {"effort": body.reasoning.effort if body.reasoning else None,
                      "summary": None}, "store": body.store,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": body.text_format},
        "tool_choice": "auto" if body.tool_choice is None else body.tool_choice,
        "tools": [{"strict": True, **t} for t in body.tools or []],
        "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled",
        "usage": usage, "user": body.user, "metadata": body.metadata or {},
    }


def response_usage(chat_usage: dict[str, object]) -> dict[str, object]:
    """A chat completion's usage in the Responses shape."""
    prompt, completion = chat_usage["prompt_tokens"], chat_usage["completion_tokens"]
    cached = chat_usage.get("prompt_tokens_details") or {}
    reasoning = chat_usage.get("completion_tokens_details") or {}
    assert isinstance(cached, dict) and isinstance(reasoning, dict)
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached.get("cached_tokens", 0)},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": reasoning.get("reasoning_tokens", 0)},
            "total_tokens": chat_usage["total_tokens"]}
