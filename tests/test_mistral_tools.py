"""Mistral's tool-call format (`[TOOL_CALLS]name[ARGS]{...}`, both markers special tokens):
the template is recognised, the markers survive decoding and may be emitted by the grammar,
and calls parse and validate over HTTP. The model is SmolLM2's weights behind a tokenizer with
the two markers and a Mistral v11-shaped template (tests/tiny_models.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from openai import OpenAI

from engine.core.detokenizer import Decoder
from grammar.tool_parser import MISTRAL, marker_tokens, parse_tool_output, template_call_format
from grammar.vocab import TokenVocab
from tests.conftest import GatewayServer, serve
from tests.test_tools_http import ADD, ASK, SCHEMAS, TOOLS
from tests.tiny_models import MISTRAL_IDS, save_mistral_tokenizer, smollm2_with_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(save_mistral_tokenizer(tmp_path_factory.mktemp("tok")))


def test_markers_are_kept_by_the_decoder_and_the_grammar_vocabulary(tokenizer):
    assert template_call_format(tokenizer.chat_template) is MISTRAL
    assert marker_tokens(tokenizer) == {i: t for t, i in MISTRAL_IDS.items()}
    text = '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}[TOOL_CALLS]add[ARGS]{"a": 3, "b": 4}'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(MISTRAL_IDS["[TOOL_CALLS]"]) == 2 and MISTRAL_IDS["[ARGS]"] in ids
    assert Decoder(tokenizer)(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) != text  # what a plain decode loses
    out = parse_tool_output(text, MISTRAL)
    assert out.malformed is None and out.content is None
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [
        ("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]
    vocab = TokenVocab.from_tokenizer(tokenizer, len(tokenizer))
    for marker, token_id in MISTRAL_IDS.items():
        assert vocab.tokens[token_id] == marker.encode()
    assert vocab.tokens[14] == b""  # other special tokens stay out of grammars


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[GatewayServer]:
    tmp = tmp_path_factory.mktemp("mistral-tools")
    model = smollm2_with_tokenizer(tmp / "smollm2-mistral", smollm2_dir, save_mistral_tokenizer)
    with serve(tmp, model=model) as server:
        yield server


@pytest.fixture(scope="module")
def client(server: GatewayServer) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0, timeout=300)


def _check_calls(calls) -> None:
    assert calls
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_calls_parse_and_validate(client: OpenAI, server: GatewayServer, choice):
    r = client.chat.completions.create(model=server.model, messages=ASK, tools=TOOLS,
                                       tool_choice=choice, max_tokens=48, temperature=0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls", msg
    assert msg.content is None
    _check_calls(msg.tool_calls)
    if isinstance(choice, dict):
        assert [c.function.name for c in msg.tool_calls] == ["add"]


def test_streamed_calls_add_up(client: OpenAI, server: GatewayServer):
    args: dict[int, str] = {}
    names: dict[int, str] = {}
    stream = client.chat.completions.create(
        model=server.model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=48,
        temperature=0.8, seed=3, stream=True)
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or []:
            if d.function.name:
                names[d.index] = d.function.name
            args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
    assert names
    for i, name in names.items():
        jsonschema.validate(json.loads(args[i]), SCHEMAS[name])


def test_history_with_calls_renders_natively(client: OpenAI, server: GatewayServer):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    r = client.chat.completions.create(model=server.model, messages=history, tools=[ADD],
                                       tool_choice="auto", max_tokens=16, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    if r.choices[0].message.tool_calls:
        _check_calls(r.choices[0].message.tool_calls)
