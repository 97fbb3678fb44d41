"""Reasoning models through the engine: a tiny random Qwen3 whose chat template reasons in
`<think>` ... `</think>` (two special tokens of the SmolLM2 tokenizer renamed).

The reasoning is kept apart from the answer, the budget forces the end marker, every constraint
mode starts after the reasoning and validates, and a model without markers is unchanged.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from transformers import AutoTokenizer

from engine import LLM, SamplingParams
from engine.config import ModelLoadError
from engine.core.detokenizer import Decoder
from engine.core.reasoning import Reasoning, ReasoningDetokenizer, ReasoningFormat
from grammar.tools import check_tool_output, parse_tools, tool_constraint
from tests.tiny_models import THINK_IDS, save_tiny_reasoner

START, END = THINK_IDS["<think>"], THINK_IDS["</think>"]
EOS = 2
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 12},
                         "days": {"type": "integer", "minimum": 1, "maximum": 7},
                         "unit": {"enum": ["celsius", "fahrenheit"]}},
          "required": ["city", "days", "unit"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}},
]


@pytest.fixture(scope="module")
def reasoner_dir(tmp_path_factory):
    return save_tiny_reasoner(tmp_path_factory.mktemp("reasoner"))


@pytest.fixture(scope="module")
def llm(reasoner_dir):
    return LLM(model=str(reasoner_dir), num_pages=256, page_size=16, max_num_seqs=16)


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 48, "temperature": 0, **kw})


# -- the format and the output stage --------------------------------------------------------


def test_format_comes_from_the_template_or_the_setting(llm, reasoner_dir, smollm2_dir):
    fmt = llm.engine.reasoning_format
    assert (fmt.start, fmt.end, fmt.start_id, fmt.end_id) == ("<think>", "</think>", START, END)
    tok = AutoTokenizer.from_pretrained(reasoner_dir)
    assert ReasoningFormat.for_tokenizer(tok, "none") is None
    assert ReasoningFormat.for_tokenizer(tok, "qwen3") == fmt
    plain = AutoTokenizer.from_pretrained(smollm2_dir)  # no markers in its template or vocab
    assert ReasoningFormat.for_tokenizer(plain, "auto") is None
    with pytest.raises(ModelLoadError, match="not single tokens"):
        ReasoningFormat.for_tokenizer(plain, "deepseek_r1")


def test_output_stage_splits_reasoning_from_answer(reasoner_dir):
    tok = AutoTokenizer.from_pretrained(reasoner_dir)
    fmt = ReasoningFormat.for_tokenizer(tok, "auto")
    thought = tok.encode("\nLet me think: stop here?\n", add_special_tokens=False)
    answer = tok.encode("\n\nIt is sunny. stop now", add_special_tokens=False)
    prompt = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    reasoning = Reasoning(fmt)
    out = ReasoningDetokenizer(Decoder(tok), prompt, ["stop now"], reasoning)
    streamed = {"answer": "", "reasoning": ""}
    stop = None
    for t in [START, *thought, END, *answer]:
        stop = out.add(t)
        streamed["answer"] += out.take(final=False)
        streamed["reasoning"] += out.take_reasoning(final=False)
        if stop:
            break
    streamed["answer"] += out.take(final=True)
    streamed["reasoning"] += out.take_reasoning(final=True)
    assert stop == "stop now"  # the stop string counts in the answer only, not in reasoning
    assert out.reasoning_text == streamed["reasoning"] == "Let me think: stop here?\n"
    assert out.text == streamed["answer"] == "It is sunny. "
    assert reasoning.num_tokens == len(thought) + 2 and not reasoning.thinking


# -- through the engine ----------------------------------------------------------------------


def test_budget_forces_the_end_marker_and_the_answer_follows(llm):
    out = llm.chat(ASK, _greedy(max_reasoning_tokens=6, ignore_eos=True, max_tokens=20))[0]
    assert out.token_ids[5] == END and END not in out.token_ids[:5]
    assert out.num_reasoning_tokens == 6 and out.finish_reason == "length"
    tok = llm.tokenizer
    thought = [t for t in out.token_ids[:5] if t != START]
    assert out.reasoning_text == tok.decode(thought, skip_special_tokens=True).lstrip()
    assert out.text == tok.decode(out.token_ids[6:], skip_special_tokens=True).lstrip()
    assert out.text  # the answer got the rest of max_tokens


def test_runaway_reasoning_without_a_budget_is_all_reasoning(llm):
    out = llm.chat(ASK, _greedy(ignore_eos=True, max_tokens=24))[0]
    assert END not in out.token_ids  # the random model never closes it by itself
    assert out.finish_reason == "length" and out.num_reasoning_tokens == 24
    assert out.text == "" and out.reasoning_text


def test_enable_thinking_false_is_all_answer(llm):
    params = _greedy(ignore_eos=True, max_tokens=12)
    out = llm.chat(ASK, params, chat_template_kwargs={"enable_thinking": False})[0]
    assert out.num_reasoning_tokens == 0 and out.reasoning_text == ""
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True).lstrip()


def test_the_model_may_end_its_reasoning_itself(llm):
    """A bias on `</think>` makes the model write it as its first token (not forced: no
    budget); the JSON answer follows, and the bias cannot put the marker inside it."""
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
    out = llm.chat(ASK, _greedy(max_tokens=120, response_format=rf,
                                logit_bias={END: 100.0}))[0]
    assert out.token_ids[0] == END and out.num_reasoning_tokens == 1
    assert out.reasoning_text == "" and out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), SCHEMA)


CONSTRAINTS = {
    "json_schema": {"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "w", "schema": SCHEMA}}},
    "json_object": {"response_format": {"type": "json_object"}},
    "regex": {"response_format": {"type": "regex", "regex": r"(sunny|rainy), [0-9]{1,2} C"}},
    "choice": {"response_format": {"type": "choice", "choices": ["yes", "no", "maybe"]}},
    "grammar": {"structured_outputs": {"grammar": 'root ::= "temp=" [0-9] [0-9]? "C"'}},
}


def _check(kind: str, text: str) -> None:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(r"(sunny|rainy), [0-9]{1,2} C", text)
    elif kind == "choice":
        assert text in ("yes", "no", "maybe")
    else:
        assert re.fullmatch(r"temp=[0-9][0-9]?C", text)


# json_object's strings are open-ended: a bias on `":` and `"}` lets the random model close them.
BIAS = {"json_object": {1799: 12.0, 23597: 12.0}}


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_every_constraint_validates_after_reasoning(llm, kind):
    """The reasoning is free (but EOS is banned, so the answer still comes: the bias on EOS
    would end it at once otherwise); the budget ends it; the answer follows the constraint.
    Greedy and two seeded samples, in one batch."""
    text = llm.tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False)
    prompt = llm.tokenizer.encode(text, add_special_tokens=False)
    params = [SamplingParams(max_tokens=160, max_reasoning_tokens=8, seed=s, temperature=t,
                             logit_bias={EOS: 30.0, **BIAS.get(kind, {})}, **CONSTRAINTS[kind])
              for s, t in ((0, 0.0), (1, 1.0), (2, 1.0))]
    for out in llm.generate([prompt] * len(params), params):
        assert out.finish_reason == "stop", (out.finish_reason, out.error, out.text)
        assert out.num_reasoning_tokens == 8 and out.token_ids[7] == END
        assert out.reasoning_text.strip()
        _check(kind, out.text)


@pytest.mark.parametrize("mode", ["required", "named", "auto"])
def test_tool_calls_validate_after_reasoning(llm, mode):
    choice = {"type": "function", "function": {"name": "add"}} if mode == "named" else mode
    spec = tool_constraint(parse_tools(TOOLS, choice, False))
    for seed in range(3):
        p = SamplingParams(max_tokens=160, temperature=1.0, seed=seed, max_reasoning_tokens=6,
                           constraint=spec)
        out = llm.chat(ASK, p)[0]
        assert out.finish_reason in ("stop", "length"), out.error
        assert out.num_reasoning_tokens == 6
        if out.finish_reason == "stop":
            assert check_tool_output(spec, out.text) is None
        if mode != "auto":
            assert out.text.startswith('<tool_call>\n{"name": "')


def test_reasoning_off_for_a_request_is_all_answer(llm):
    rf = CONSTRAINTS["json_schema"]["response_format"]
    out = llm.chat(ASK, _greedy(max_tokens=120, response_format=rf, reasoning=False))[0]
    assert out.num_reasoning_tokens == 0 and out.token_ids[0] != START
    jsonschema.validate(json.loads(out.text), SCHEMA)


def test_a_model_without_markers_is_unchanged(smollm2):
    """The embedded SmolLM2 has no reasoning format: the reasoning fields stay empty and the
    tokens are those of a request that asks for no reasoning."""
    assert smollm2.engine.reasoning_format is None
    rf = CONSTRAINTS["json_schema"]["response_format"]
    on, off = (smollm2.chat(ASK, _greedy(max_tokens=64, response_format=rf, reasoning=r))[0]
               for r in (True, False))
    assert on.token_ids == off.token_ids and on.text == off.text
    assert on.num_reasoning_tokens == 0 and on.reasoning_text == ""


def test_mask_rows_of_reasoning_requests(llm):
    """Thinking: no row unconstrained, every token but the output's end constrained (bit 31 of a
    word included), only the end marker on the budget's last token."""
    from engine.core.request import Request

    stage, fmt = llm.engine.grammar, llm.engine.reasoning_format
    spec = SamplingParams(response_format={"type": "json_object"}).constraint
    free = Request("free", [1], SamplingParams())
    free.reasoning = Reasoning(fmt, budget=4)
    constrained = Request("constrained", [1], SamplingParams(stop_token_ids=[31, 63],
                                                             constraint=spec))
    constrained.reasoning = Reasoning(fmt, budget=4)
    constrained.matcher = stage.compile(spec).result().matcher()
    last = Request("last", [1], SamplingParams())
    last.reasoning = Reasoning(fmt, budget=4, num_tokens=3)
    assert stage.start_fill([free]) is None
    bitmask, rows, errors = stage.start_fill([free, constrained, last]).result()
    assert rows == [1, 2] and not errors
    vocab = llm.engine.model_config.vocab_size

    def allowed(row: int) -> set[int]:
        return {t for t in range(vocab) if (int(bitmask[row, t // 32]) >> (t % 32)) & 1}

    assert allowed(1) == set(range(vocab)) - {EOS, 31, 63}
    assert allowed(2) == {END}


def test_the_template_writes_calls_in_the_hermes_format(reasoner_dir):
    """What the grammar enforces is what the (Qwen3-shaped) template renders for a call."""
    from gateway.openai.tokenizer import GatewayTokenizer
    from grammar.tool_parser import HERMES

    tok = AutoTokenizer.from_pretrained(reasoner_dir)
    assert GatewayTokenizer(tok).call_format == HERMES
    calls = [{"id": f"c{i}", "type": "function",
              "function": {"name": "add", "arguments": {"a": i, "b": 2}}} for i in (1, 2)]
    text = tok.apply_chat_template([*ASK, {"role": "assistant", "content": "",
                                           "tool_calls": calls}], tokenize=False)
    rendered = HERMES.separator.join(HERMES.render("add", json.dumps({"a": i, "b": 2}))
                                     for i in (1, 2))
    assert f"<|im_start|>assistant\n{rendered}<|im_end|>" in text
