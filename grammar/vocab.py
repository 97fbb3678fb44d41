"""The model's vocabulary as the grammar backends see it: one byte string per token id."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from grammar.tool_parser import marker_tokens

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class TokenVocab:
    """Token id -> the bytes it decodes to, for every row of the model's embedding.

    `tokens[i] == b""` marks a token no grammar may emit: special/control tokens (but for the
    markers of the model's tool-call format) and the padding rows past `len(tokenizer)`. Stop
    tokens keep their text but are allowed only where the grammar may end. Plain data, so it
    pickles cheaply into compile workers.
    """

    tokens: tuple[bytes, ...]  # (vocab_size,)
    stop_token_ids: tuple[int, ...]
    # The HF `tokenizers` JSON, for backends that tokenize forced text (llguidance); optional.
    tokenizer_json: str | None = field(default=None, compare=False, repr=False)

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @cached_property
    def fingerprint(self) -> str:
        """Identity of the tokenizer for cache keys: a hash of every token and the stops."""
        h = hashlib.sha256(repr(self.stop_token_ids).encode())
        for t in self.tokens:
            h.update(len(t).to_bytes(4, "little"))
            h.update(t)
        return h.hexdigest()

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: list[int] | None = None,
    ) -> TokenVocab:
        """Build from a HF tokenizer; `vocab_size` is the model's embedding rows (>= its
        length). Stop tokens default to the tokenizer's EOS."""
        import xgrammar as xgr  # decodes byte-level, byte-fallback and SentencePiece vocabs

        if vocab_size < len(tokenizer):
            raise ValueError(f"vocab_size {vocab_size} < len(tokenizer) {len(tokenizer)}")
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        if stop_token_ids is None:
            eos = tokenizer.eos_token_id
            stop_token_ids = [eos] if eos is not None else list(info.stop_token_ids)
        if not stop_token_ids:
            raise ValueError("the tokenizer has no EOS token; pass stop_token_ids")
        special = set(tokenizer.all_special_ids)
        special |= {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        special -= set(stop_token_ids)
        markers = marker_tokens(tokenizer)
        tokens = [
            markers[i].encode() if i in markers else b"" if i in special else t
            for i, t in enumerate(info.decoded_vocab)
        ]
        tokens += [b""] * (vocab_size - len(tokens))
        backend = getattr(tokenizer, "backend_tokenizer", None)  # fast tokenizers only
        tokenizer_json = backend.to_str() if backend is not None else None
        return cls(tuple(tokens[:vocab_size]), tuple(stop_token_ids), tokenizer_json)
