"""The offline API: `LLM(model=None).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from engine.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.messages import TokenLogprob
from engine.sampling.params import InvalidRequestError, SamplingParams

DEFAULT_TENANT = "default"  # the offline API's adapters belong to this tenant


@dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # why, when finish_reason is "error"
    # A reasoning model's reasoning (not in `text`) and its tokens, markers included.
    reasoning_text: str = ""
    num_reasoning_tokens: int = 0


class LLM:
    """Offline batched generation over the engine.

    `model=None` loads the embedded SmolLM2-135M-Instruct; otherwise an HF folder or a .gguf
    file. Extra keyword arguments are `EngineConfig` fields (max_num_seqs, num_pages, ...).
    """

    def __init__(self, model: str | None = None, **engine_args: Any):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's tensor-parallel workers, if any (also on leaving a `with`)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """One result per prompt, in order. Prompts are strings or token-id lists."""
        one = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
        # mypy does not narrow a list by its first item: `one` tells a prompt from a list.
        batch = cast("list[str | list[int]]", [prompts] if one else prompts)
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(batch)
        if len(plist) != len(batch):
            raise InvalidRequestError(f"got {len(batch)} prompts but {len(plist)} params")
        token_lists = [self._encode(p) for p in batch]
        for ids, p in zip(token_lists, plist, strict=True):
            self.engine.validate(ids, p)  # refuse the whole call before anything runs

        results: dict[str, CompletionOutput] = {}
        order = []
        for ids, p in zip(token_lists, plist, strict=True):
            rid = f"offline-{next(self._ids)}"
            self.engine.add_request(rid, ids, p, validated=True)
            results[rid] = CompletionOutput(rid, ids)
            order.append(rid)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                r = results[out.request_id]
                r.token_ids.extend(out.new_token_ids)
                r.text += out.new_text
                r.reasoning_text += out.new_reasoning_text
                r.num_reasoning_tokens = out.num_reasoning_tokens
                if out.logprobs:
                    r.logprobs = (r.logprobs or []) + out.logprobs
                if out.finished:
                    r.finish_reason = out.finish_reason
                    r.num_cached_tokens = out.num_cached_tokens
                    r.error = out.error
        return [results[rid] for rid in order]

    def load_adapter(self, name: str, path: str | Path, pin: bool = False) -> None:
        """Register the PEFT LoRA folder at `path` as `name`; requests select it with
        `SamplingParams(adapter=name)`. The folder is validated now and stays where it is.

        Raises:
            lora.adapter.AdapterError: naming every problem with the folder.
            lora.manager.AdapterExists: `name` is taken (unload it first).
        """
        self.engine.adapters.add(DEFAULT_TENANT, name, path, pin=pin)

    def unload_adapter(self, name: str) -> bool:
        """Forget adapter `name`; False if there was none."""
        return self.engine.adapters.remove(DEFAULT_TENANT, name)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        params: SamplingParams | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[CompletionOutput]:
        """Apply the model's chat template to one conversation (or a list of them), with
        `chat_template_kwargs` (e.g. `enable_thinking=False`) as the template's variables."""
        one = bool(messages) and isinstance(messages[0], dict)
        convs = cast("list[list[dict[str, Any]]]", [messages] if one else messages)
        prompts: list[list[int]] = []
        for c in convs:
            text = self.tokenizer.apply_chat_template(c, add_generation_prompt=True,
                                                      tokenize=False,
                                                      **(chat_template_kwargs or {}))
            assert isinstance(text, str)  # tokenize=False: the rendered text
            prompts.append(self._encode(text, special=False))
        return self.generate(prompts, params)

    def _encode(self, prompt: str | list[int], special: bool = True) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=special)
        return list(prompt)
