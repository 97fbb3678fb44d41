"""Incremental detokenization: UTF-8 safe, stop strings across token boundaries, no leaks."""

from __future__ import annotations

import random

import pytest

from engine.core.detokenizer import Decoder, IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def llama2_tok():
    """Llama-2 style: Metaspace, byte fallback, and a decoder that strips the leading space of
    the text. Its vocabulary is a few letters: other characters become one token per byte."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + list("▁Sayhelowrd:")
    merges = [("▁", "h"), ("▁h", "e"), ("l", "l"), ("▁he", "ll"), ("▁hell", "o"), ("▁", "w")]
    vocab += ["".join(m) for m in merges]
    t = Tokenizer(models.BPE({w: i for i, w in enumerate(vocab)}, merges, byte_fallback=True,
                             unk_token="<unk>", fuse_unk=True))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                   decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def wordpiece_tok():
    """A tokenizer whose transformers decode cleans up spaces (" ," -> ",")."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "[CLS]", "hello", ",", "world", "!", "s"])}
    t = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    t.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]", cls_token="[CLS]",
                                   clean_up_tokenization_spaces=True)


def stream(tok, text, stop=()):
    return stream_ids(tok, tok.encode("Say:"), tok.encode(text), stop)


def stream_ids(tok, prompt, ids, stop=()):
    d = IncrementalDetokenizer(Decoder(tok), prompt, list(stop))
    pieces, matched = [], None
    for t in ids:
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


def test_multi_token_characters_and_special_tokens(tok):
    """Characters split over several tokens are held until complete; special tokens between
    pieces are skipped: the stream equals decoding the whole output at once."""
    assert len(tok.encode("𝔘")) > 1  # a 4-byte character over several byte-level tokens
    specials = sorted(tok.all_special_ids)
    ids = []
    for i, piece in enumerate(["héllo ", "𝔘𝔫𝔦 ", "你好", " 🚀", "wörld"]):
        ids += tok.encode(piece) + [specials[i % len(specials)]]
    out, pieces, _ = stream_ids(tok, tok.encode("Say:"), ids)
    assert out == tok.decode(ids, skip_special_tokens=True)
    assert "" in pieces[:-1] and all("\ufffd" not in p for p in pieces)


def test_leading_space_and_byte_fallback(llama2_tok):
    """A Metaspace tokenizer drops the leading space of a lone token; the window reaching into
    the prompt keeps it. Characters outside the vocabulary arrive one byte token at a time."""
    tok = llama2_tok
    prompt = tok.encode("Say:", add_special_tokens=False)
    ids = tok.encode("hello 你好 world", add_special_tokens=False)
    assert len(ids) >= 8  # 你 and 好 are three byte tokens each
    out, pieces, _ = stream_ids(tok, prompt, ids + [tok.eos_token_id])
    assert out == tok.decode(prompt + ids)[len(tok.decode(prompt)) :] == " hello 你好 world"
    assert all("\ufffd" not in p for p in pieces)


def test_decoder_equals_tokenizer_decode(tok, llama2_tok, wordpiece_tok):
    rng = random.Random(0)
    for t in (tok, llama2_tok, wordpiece_tok):
        decode = Decoder(t)
        for _ in range(200):
            ids = [rng.randrange(len(t)) for _ in range(rng.choice([1, 1, 2, 5]))]
            for _ in range(2):  # the second time a lone token comes from the cache
                assert decode(ids) == t.decode(ids, skip_special_tokens=True)
    assert Decoder(wordpiece_tok)([2, 3, 4, 5]) == "hello, world!"
