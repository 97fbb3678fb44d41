"""Tool calls without a server: request validation, the call grammar (xgrammar structural tag
walked with the SmolLM2 tokenizer), the parser (any chunking gives the same result), the
output check and the fallback prompt."""

from __future__ import annotations

import json
import random

import pytest

from grammar.spec import GrammarError
from grammar.tool_parser import (
    HERMES,
    LLAMA3_JSON,
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


def _spec(tool_choice="required", parallel=None, tools=(ADD, NOW), fmt=HERMES):
    return tool_constraint(parse_tools(list(tools), tool_choice, parallel), fmt)


# -- request validation -----------------------------------------------------------------


def test_modes_and_allowed_tools() -> None:
    assert parse_tools(None, None) is None
    assert tool_constraint(parse_tools([ADD], "none")) is None
    auto = parse_tools([ADD, NOW])
    assert (auto.mode, auto.allowed, auto.parallel) == ("auto", ("add", "now"), True)
    named = parse_tools([ADD, NOW], {"type": "function", "function": {"name": "now"}}, True)
    assert (named.mode, named.allowed, named.parallel) == ("required", ("now",), False)
    assert parse_tools([ADD], "required", False).parallel is False
    # A tool without parameters takes none: `{}` and nothing else.
    assert json.loads(_spec().payload)["tools"][1]["parameters"] == {
        "type": "object", "properties": {}, "additionalProperties": False}


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


@pytest.fixture(scope="module", params=["llguidance", "xgrammar"])
def compiler(request, smollm2_dir):
    """The serving chain (llguidance first: required and named calls compile there, `auto`
    falls through to xgrammar), and xgrammar alone (its structural tags for every mode)."""
    from transformers import AutoTokenizer

    from grammar.compiler import GrammarCompiler

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    chain = ["llguidance", "xgrammar"] if request.param == "llguidance" else ["xgrammar"]
    with GrammarCompiler(tok, len(tok), backends=chain) as c:
        yield tok, c


def _accepts(compiler, spec, text: str) -> bool:
    tok, c = compiler
    m = c.compile(spec).matcher()
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    return all(m.accept(t) for t in ids) and m.is_terminated()


CALL_ADD = render_call("add", '{"a": 1, "b": 2}')
CALL_NOW = render_call("now", "{}")
FORMATS = pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON], ids=lambda f: f.name)


def _text(template: str, fmt) -> str:
    """A case's text in `fmt`: {add}, {now}, {bad_add} (a wrong argument type), {sub} (a tool
    not offered), {sep} (the call separator), {trigger}."""
    return template.format(
        add=fmt.render("add", '{"a": 1, "b": 2}'), now=fmt.render("now", "{}"),
        bad_add=fmt.render("add", '{"a": "1", "b": 2}'), sub=fmt.render("sub", '{"a": 1}'),
        sep=fmt.separator, trigger=fmt.trigger)


@FORMATS
@pytest.mark.parametrize(
    ("choice", "parallel", "template", "ok"),
    [
        ("required", None, "{add}", True),
        ("required", None, "{add}{sep}{now}", True),
        ("required", False, "{add}{sep}{now}", False),
        ("required", None, "Sure. {add}", False),
        ("required", None, "no call", False),
        ("required", None, "{bad_add}", False),
        ("required", None, "{sub}", False),
        ({"type": "function", "function": {"name": "now"}}, None, "{add}", False),
        ({"type": "function", "function": {"name": "now"}}, None, "{now}", True),
        ("auto", None, "Just text.", True),
        ("auto", None, "Let me add. {add}", True),
        ("auto", False, "{add}{sep}{now}", False),
        ("auto", None, "{trigger}oops", False),
    ],
)
def test_grammar_admits_exactly_the_call_format(compiler, fmt, choice, parallel, template,
                                                ok) -> None:
    spec, text = _spec(choice, parallel, fmt=fmt), _text(template, fmt)
    first = compiler[1].backends[0] if choice != "auto" else "xgrammar"
    assert compiler[1].compile(spec).backend == first
    assert _accepts(compiler, spec, text) is ok
    if ok:
        assert check_tool_output(spec, text) is None


# -- the parser and the check -----------------------------------------------------------


@FORMATS
def test_any_chunking_gives_the_whole_text_result(fmt) -> None:
    args = '{"a": {"x": "}\\"]"}, "b": [2, "{"]}'  # braces and quotes inside strings
    text = "Let me see <b> \n" + fmt.render("add", args) + fmt.separator + fmt.render("now", "{}")
    whole = parse_tool_output(text, fmt)
    assert whole.content == "Let me see <b>" and whole.malformed is None
    assert [(c.name, c.arguments, c.complete) for c in whole.calls] == [
        ("add", args, True), ("now", "{}", True)]
    rng = random.Random(0)
    for _ in range(200):
        parser, events, i = ToolCallParser(fmt), [], 0
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
    llama = _spec(fmt=LLAMA3_JSON)
    assert "call format" in check_tool_output(llama, '{"name": "add", "arguments": {}}')
    assert "call format" in check_tool_output(llama, '{"name": "now", "parameters": {}]')


def _events(text: str, fmt, forced: bool, size: int) -> tuple[list, ToolCallParser]:
    """The parser's events for `text` fed `size` characters at a time, then the end."""
    parser = ToolCallParser(fmt, forced)
    events = [e for i in range(0, len(text), size) for e in parser.feed(text[i:i + size])]
    return events + parser.feed("", final=True), parser


@FORMATS
def test_a_marker_cut_at_the_end_is_never_text_when_forced(fmt) -> None:
    """max_tokens cut the next call inside its opening marker (or the separator before it):
    forced (`required`, a named tool) that is no text, streamed or whole; `auto` releases it
    as the text it is (free text may hold a prefix of the trigger, as vLLM's parsers read it)."""
    call = fmt.render("add", '{"a": 1, "b": 2}')
    cuts = [fmt.separator[:k] for k in range(1, len(fmt.separator))]
    cuts += [fmt.separator + fmt.trigger[:k] for k in range(1, len(fmt.trigger))]
    for cut in cuts:
        for size in (1, 3, len(call) + len(cut)):
            events, parser = _events(call + cut, fmt, True, size)
            assert not [e for e in events if isinstance(e, Text)], cut
            out = parser.result
            assert (out.content, out.malformed) == (None, None), cut
            assert [(c.name, c.complete) for c in out.calls] == [("add", True)]
            events, parser = _events(call + cut, fmt, False, size)
            text = cut.removeprefix(fmt.separator).strip()  # a whole separator is dropped
            assert "".join(e.text for e in events if isinstance(e, Text)) == text
            assert parser.result.content == (text or None)
        assert valid_calls(_spec(fmt=fmt), parse_tool_output(call + cut, fmt, True).calls)


@FORMATS
def test_forced_text_is_malformed_never_emitted(fmt) -> None:
    call = fmt.render("now", "{}")
    for text in ("Sure. " + call, call + fmt.separator + "done", fmt.trigger[:3] + "x"):
        events, parser = _events(text, fmt, True, 2)
        assert not [e for e in events if isinstance(e, Text)]
        assert parser.result.malformed == "text outside the tool calls"
        assert check_tool_output(_spec(fmt=fmt), text) == "text outside the tool calls"
    whole = parse_tool_output(" \n" + call + "\n", fmt, True)  # whitespace is not text
    assert (whole.content, whole.malformed, len(whole.calls)) == (None, None, 1)


# -- the fallback prompt ----------------------------------------------------------------


def test_fallback_prompt_renders_tools_calls_and_results() -> None:
    from gateway.openai.params import chat_messages
    from gateway.openai.schemas import ChatCompletionRequest
    from gateway.openai.tools import render_messages, resolve_tools

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
    messages, tools = render_messages(chat_messages(body), resolve_tools(body), native=False)
    assert tools is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools")
    assert '"name": "add"' in messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    assert messages[2]["content"] == render_call("add", '{"a": 2, "b": 3}') + "\n" + render_call(
        "add", '{"a": 2, "b": 3}')
    assert messages[3]["content"] == ("<tool_response>\n5\n</tool_response>\n"
                                      "<tool_response>\n5\n</tool_response>")
    native, tools = render_messages(chat_messages(body), resolve_tools(body), native=True)
    assert tools is not None and native[2]["tool_calls"][0]["function"]["arguments"] == {
        "a": 2, "b": 3}
    assert native[3] == {"role": "tool", "content": "5", "tool_call_id": "c1"}


# -- native templates -------------------------------------------------------------------

# A template in the style of Llama 3.1's JSON tool calling (tools listed in the system turn,
# calls as {"name", "parameters"} objects, results in the `ipython` role).
LLAMA_STYLE_TEMPLATE = """{{- bos_token }}
{%- for m in messages %}
{%- if m.role == 'system' or (loop.first and tools) %}
<|start_header_id|>system<|end_header_id|>
{%- if tools %}
Respond with {"name": function name, "parameters": dictionary of arguments}.
{%- for t in tools %}
{{ t | tojson }}
{%- endfor %}
{%- endif %}
{%- if m.role == 'system' %}{{ m.content }}{% endif %}<|eot_id|>
{%- endif %}
{%- if m.role == 'assistant' and m.tool_calls %}
<|start_header_id|>assistant<|end_header_id|>
{%- for tc in m.tool_calls %}
{{- '{"name": "' + tc.function.name + '", "parameters": ' }}
{{- (tc.function.arguments | tojson) + '}' }}
{%- endfor %}<|eot_id|>
{%- elif m.role == 'tool' %}
<|start_header_id|>ipython<|end_header_id|>{{ m.content }}<|eot_id|>
{%- elif m.role != 'system' %}
<|start_header_id|>{{ m.role }}<|end_header_id|>{{ m.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}"""


def test_native_template_sets_the_call_format(smollm2_dir) -> None:
    from transformers import AutoTokenizer

    from gateway.openai.params import EngineFacts, chat_input, plan_chat
    from gateway.openai.schemas import ChatCompletionRequest
    from gateway.openai.tokenizer import GatewayTokenizer
    from grammar.tools import call_format

    hf = AutoTokenizer.from_pretrained(smollm2_dir)
    assert GatewayTokenizer(hf).call_format is None  # SmolLM2: the fallback prompt
    hf.chat_template = LLAMA_STYLE_TEMPLATE
    tok = GatewayTokenizer(hf)
    assert tok.call_format is LLAMA3_JSON
    call = {"id": "c1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    body = ChatCompletionRequest.model_validate({
        "model": "m", "tools": [ADD, NOW], "tool_choice": "required", "messages": [
            {"role": "user", "content": "2+3?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "5"},
            {"role": "user", "content": "And the time?"},
        ]})
    job = plan_chat(chat_input(body), tok, EngineFacts(8192, lambda ids, p: None, None),
                    None).jobs[0]
    prompt = hf.decode(job.prompt_ids)
    assert '{"name": "add", "parameters": {"a": 2, "b": 3}}' in prompt
    assert '"name": "now"' in prompt and "ipython<|end_header_id|>5" in prompt
    assert call_format(job.params.constraint) is LLAMA3_JSON
    assert check_tool_output(job.params.constraint, LLAMA3_JSON.render("now", "{}")) is None
    hf.chat_template = "{{ tools }}{% for m in messages %}<tool_call>{{ m.content }}{% endfor %}"
    assert GatewayTokenizer(hf).call_format is HERMES
