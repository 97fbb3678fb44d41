"""The gateway's side of text <-> tokens: chat template, prompt encoding, token strings.

The gateway loads its own tokenizer instance from the engine's model folder, so the event
loop never shares a tokenizer object with the engine thread. `transformers` is imported only
when loading (it pulls torch in; the gateway's modules themselves do not).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from engine.sampling.params import InvalidRequestError
from grammar.tool_parser import CallFormat, template_call_format


class GatewayTokenizer:
    # Any: a transformers tokenizer. Its stubs type each method for every input and output
    # form at once (`apply_chat_template` returns str | list[int] | BatchEncoding | ...), and
    # its message type (dict[str, str]) is narrower than the tool messages sent here.
    def __init__(self, hf_tokenizer: Any):
        self.hf = hf_tokenizer
        self.token_text = lru_cache(maxsize=65536)(self._token_text)

    @classmethod
    def load(cls, model_dir: str | Path) -> GatewayTokenizer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model_dir))

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def call_format(self) -> CallFormat | None:
        """The tool-call format the chat template renders tools and tool messages in itself:
        Hermes `<tool_call>` (Qwen2.5/3, Hermes 2/3), Llama 3.1's JSON calls or Mistral's
        `[TOOL_CALLS]`. None: the template knows no tools, and the gateway writes the generic
        fallback prompt (gateway/openai/tools.py)."""
        return template_call_format(getattr(self.hf, "chat_template", None))

    def chat_prompt(
        self,
        messages: list[dict[str, object]],
        tools: list[dict[str, object]] | None = None,
        template_kwargs: dict[str, object] | None = None,
        continue_final: bool = False,
    ) -> list[int]:
        """Token ids of the conversation in the model's chat template, ready for the
        assistant's turn (`continue_final`: ready to continue the last, assistant, message).
        `tools` only for templates that render them (`call_format`); `template_kwargs`: the
        template's own variables (e.g. Qwen3's enable_thinking)."""
        extra: dict[str, object] = {**(template_kwargs or {})}
        if tools:
            extra["tools"] = tools
        if continue_final:
            extra["continue_final_message"] = True
        try:
            text = self.hf.apply_chat_template(
                messages, add_generation_prompt=not continue_final, tokenize=False, **extra
            )
        except Exception as e:  # jinja raises for conversations the template refuses
            raise InvalidRequestError(f"cannot apply the chat template: {e}", "messages") from e
        return self.hf.encode(text, add_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=True)

    def decode(self, token_ids: list[int]) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=True)

    def _token_text(self, token_id: int) -> str:
        """One token as text, for logprobs (special tokens included)."""
        return self.hf.decode([token_id], skip_special_tokens=False)
