"""Tool calls without a server: request validation, the call grammar (xgrammar structural tag
walked with the SmolLM2 tokenizer), the parser (any chunking gives the same result), the
output check and the fallback prompt."""

from __future__ import annotations

import json
import random

import pytest

from grammar.spec import GrammarError
from grammar.tool_parser import (
    Arguments,
    CallStart,
    Text,
    ToolCallParser,
    parse_tool_output,
    render_call,
)
from grammar.tools import check_tool_output, parse_tools, tool_constraint, valid_calls

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}}
NOW = {"type": "function", "function": {"name": "now"}}


def _spec(tool_choice="required", parallel=None, tools=(ADD, NOW)):
    return tool_constraint(parse_tools(list(tools), tool_choice, parallel))


# -- request validation -----------------------------------------------------------------


def test_modes_and_allowed_tools() -> None:
    assert parse_tools(None, None) is None
    assert tool_constraint(parse_tools([ADD], "none")) is None
    auto = parse_tools([ADD, NOW])
    assert (auto.mode, auto.allowed, auto.parallel) == ("auto", ("add", "now"), True)
    named = parse_tools([ADD, NOW], {"type": "function", "function": {"name": "now"}}, True)
    assert (named.mode, named.allowed, named.parallel) == ("required", ("now",), False)
    assert parse_tools([ADD], "required", False).parallel is False
    assert json.loads(_spec().payload)["tools"][1]["parameters"] == {
        "type": "object", "properties": {}}


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}], None,
         "tools[0].function.parameters"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
         None, "tools[0].function.parameters"),
        ([ADD, ADD], None, "tools[1].function.name"),
        ([{"type": "function", "function": {"name": "a.b"}}], None, "tools[0].function.name"),
        ([{"type": "retrieval"}], None, "tools[0].type"),
        ([ADD], {"type": "function", "function": {"name": "sub"}}, "tool_choice"),
        ([ADD], "always", "tool_choice"),
        ([], "required", "tool_choice"),
    ],
)
def test_bad_tools_name_the_field(tools, choice, param) -> None:
    with pytest.raises(GrammarError) as e:
        parse_tools(tools, choice)
    assert e.value.param == param


# -- the grammar ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiler(smollm2_dir):
    from transformers import AutoTokenizer

    from grammar.compiler import GrammarCompiler

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    with GrammarCompiler(tok, len(tok), backends=["llguidance", "xgrammar"]) as c:
        yield tok, c


def _accepts(compiler, spec, text: str) -> bool:
    tok, c = compiler
    m = c.compile(spec).matcher()
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    return all(m.accept(t) for t in ids) and m.is_terminated()


CALL_ADD = render_call("add", '{"a": 1, "b": 2}')
CALL_NOW = render_call("now", "{}")


@pytest.mark.parametrize(
    ("choice", "parallel", "text", "ok"),
    [
        ("required", None, CALL_ADD, True),
        ("required", None, CALL_ADD + "\n" + CALL_NOW, True),
        ("required", False, CALL_ADD + "\n" + CALL_NOW, False),
        ("required", None, "Sure. " + CALL_ADD, False),
        ("required", None, "no call", False),
        ("required", None, render_call("add", '{"a": "1", "b": 2}'), False),
        ("required", None, render_call("sub", '{"a": 1, "b": 2}'), False),
        ({"type": "function", "function": {"name": "now"}}, None, CALL_ADD, False),
        ({"type": "function", "function": {"name": "now"}}, None, CALL_NOW, True),
        ("auto", None, "Just text.", True),
        ("auto", None, "Let me add. " + CALL_ADD, True),
        ("auto", False, CALL_ADD + "\n" + CALL_NOW, False),
        ("auto", None, "<tool_call>oops", False),
    ],
)
def test_grammar_admits_exactly_the_call_format(compiler, choice, parallel, text, ok) -> None:
    spec = _spec(choice, parallel)
    assert compiler[1].compile(spec).backend == "xgrammar"  # the one that speaks tool calls
    assert _accepts(compiler, spec, text) is ok
    if ok:
        assert check_tool_output(spec, text) is None


# -- the parser and the check -----------------------------------------------------------


def test_any_chunking_gives_the_whole_text_result() -> None:
    text = "Let me see <b> \n" + render_call("add", '{"a": {"x": "}"}, "b": 2}') + "\n" + CALL_NOW
    whole = parse_tool_output(text)
    assert whole.content == "Let me see <b>"
    assert [(c.name, c.arguments, c.complete) for c in whole.calls] == [
        ("add", '{"a": {"x": "}"}, "b": 2}', True), ("now", "{}", True)]
    rng = random.Random(0)
    for _ in range(200):
        parser, events, i = ToolCallParser(), [], 0
        while i < len(text):
            n = rng.randint(1, 8)
            events += parser.feed(text[i:i + n])
            i += n
        events += parser.feed("", final=True)
        assert parser.result == whole
        assert "".join(e.text for e in events if isinstance(e, Text)) == whole.content
        assert [e.name for e in events if isinstance(e, CallStart)] == ["add", "now"]
        args = "".join(e.text for e in events if isinstance(e, Arguments) and e.index == 0)
        assert args == whole.calls[0].arguments


def test_check_and_valid_calls() -> None:
    spec = _spec()
    cut = CALL_ADD + "\n" + render_call("add", '{"a": 1, "b": 2}')[:-20]
    assert "incomplete" in check_tool_output(spec, cut)
    assert [c.name for c in valid_calls(spec, parse_tool_output(cut).calls)] == ["add"]
    assert "not an allowed tool" in check_tool_output(spec, render_call("sub", "{}"))
    assert "invalid" in check_tool_output(spec, render_call("add", '{"a": 1}'))
    assert "no tool call" in check_tool_output(spec, "")
    assert check_tool_output(_spec("auto"), "plain text") is None
    assert "parallel" in check_tool_output(_spec("required", False), CALL_NOW + "\n" + CALL_NOW)


# -- the fallback prompt ----------------------------------------------------------------


def test_fallback_prompt_renders_tools_calls_and_results() -> None:
    from gateway.schemas import ChatCompletionRequest
    from gateway.tools import render_messages

    call = {"id": "c1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    body = ChatCompletionRequest.model_validate({
        "model": "m", "tools": [ADD, NOW], "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+3?"},
            {"role": "assistant", "content": None, "tool_calls": [call, {**call, "id": "c2"}]},
            {"role": "tool", "tool_call_id": "c1", "content": "5"},
            {"role": "tool", "tool_call_id": "c2", "content": "5"},
        ]})
    messages, tools = render_messages(body, native=False)
    assert tools is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools")
    assert '"name": "add"' in messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    assert messages[2]["content"] == render_call("add", '{"a": 2, "b": 3}') + "\n" + render_call(
        "add", '{"a": 2, "b": 3}')
    assert messages[3]["content"] == ("<tool_response>\n5\n</tool_response>\n"
                                      "<tool_response>\n5\n</tool_response>")
    native, tools = render_messages(body, native=True)
    assert tools is not None and native[2]["tool_calls"][0]["function"]["arguments"] == {
        "a": 2, "b": 3}
    assert native[3] == {"role": "tool", "content": "5", "tool_call_id": "c1"}
