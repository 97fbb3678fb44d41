"""Incremental detokenization: UTF-8 safe, stop strings across token boundaries, no leaks."""

from __future__ import annotations

import pytest

from engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def stream(tok, text, stop=()):
    prompt = tok.encode("Say:")
    d = IncrementalDetokenizer(tok, prompt, list(stop))
    pieces, matched = [], None
    for t in tok.encode(text):
        matched = d.add(t)
        pieces.append(d.take(final=matched is not None))
        if matched:
            break
    pieces.append(d.take(final=True))
    return "".join(pieces), pieces, matched


@pytest.mark.parametrize("text", ["héllo wörld — 你好, 🚀 emoji", "plain ascii text", " 日本語"])
def test_streamed_text_equals_decode(tok, text):
    out, pieces, _ = stream(tok, text)
    assert out == tok.decode(tok.encode(text))
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_across_tokens_never_leaks(tok):
    out, pieces, matched = stream(tok, "The answer is 42. END of story", stop=["END of"])
    assert matched == "END of"
    assert out == "The answer is 42. "
    assert not any("END" in p for p in pieces)


def test_held_back_prefix_is_released(tok):
    # "EN" may start "END"; once the text moves on it must be released.
    out, _, matched = stream(tok, "ENTER the room", stop=["END"])
    assert matched is None and out == "ENTER the room"
