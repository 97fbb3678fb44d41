"""OpenAI request bodies (pydantic), validated strictly from the raw JSON.

Unknown fields are kept (`extra="allow"`) and ignored, as OpenAI's own server tolerates new
client fields; every float is finite (NaN and Infinity are refused). The bodies are only
shapes: `model` (base model or adapter), `response_format`, `structured_outputs` and `tools`
are resolved in gateway/openai/params.py, `session_id` in gateway/sessions/turns.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway.errors import clip

# Strict types; no NaN or Infinity (Python's JSON reads them, and `ge`/`le` let +-inf past a
# one-sided bound): every float of a request is finite.
OPEN = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
MAX_STOP_CHARS = 512  # stop matching cost grows with the length; keep one request cheap


# `reasoning_effort` -> the reasoning budget in tokens (docs/reasoning.md); "none" thinks not at
# all where the template can be told (enable_thinking), else its end marker comes first.
REASONING_EFFORT = {"none": 1, "minimal": 256, "low": 1024, "medium": 4096, "high": 16384,
                    "xhigh": 32768}


def reasoning_budget(max_reasoning_tokens: int | None, effort: str | None) -> int | None:
    """`max_reasoning_tokens`, else the budget of a reasoning effort (None: unbounded)."""
    if max_reasoning_tokens is not None or effort is None:
        return max_reasoning_tokens
    return REASONING_EFFORT[effort]


class ContentPart(BaseModel):
    model_config = OPEN

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type != "text":
            raise ValueError(f"content parts of type '{clip(self.type)}' are not supported; "
                             "use 'text'")
        if self.text is None:
            raise ValueError("a 'text' content part needs a 'text' field")
        return self


class ChatMessage(BaseModel):
    model_config = OPEN

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, object]] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers

    @model_validator(mode="after")
    def _needs_content(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a '{self.role}' message needs 'content'")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)


class StreamOptions(BaseModel):
    model_config = OPEN

    include_usage: bool = False


class _Generation(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = OPEN

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=64)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # int64, as OpenAI's
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    # The engine's extras.
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(None, ge=0, le=1)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)  # vLLM's: EOS and stop_token_ids banned until then
    speculative: bool = True  # False: this request never drafts (--num-speculative-tokens)
    repetition_penalty: float | None = Field(None, gt=0)
    stop_token_ids: list[int] | None = None  # at most MAX_STOP_TOKEN_IDS (gateway/access/bounds.py)

    # Structured output, parsed into one constraint in gateway/openai/params.py.
    response_format: dict[str, object] | None = None
    structured_outputs: dict[str, object] | None = None  # vLLM's extra field
    session_id: str | None = None  # a session's turn (gateway/sessions/turns.py)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > 16:
            raise ValueError("at most 16 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences must be at most {MAX_STOP_CHARS} characters")
        return v

    @model_validator(mode="after")
    def _stream_options(self) -> _Generation:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Tool calls: validated in gateway/openai/tools.py, the constraint built in
    # gateway/openai/params.py.
    tools: list[dict[str, object]] | None = None
    tool_choice: str | dict[str, object] | None = None
    parallel_tool_calls: bool | None = None
    # Reasoning models (engine/core/reasoning.py): the chat template's extra variables (e.g.
    # enable_thinking) and the reasoning budget, after which the end marker is forced.
    chat_template_kwargs: dict[str, object] | None = None
    max_reasoning_tokens: int | None = Field(None, ge=1)
    # vLLM's: the reply continues the last message, an assistant's ("prefill"), instead of
    # starting a turn of its own.
    continue_final_message: bool = False
    # OpenAI's: a budget from REASONING_EFFORT ("none": the template is told not to think);
    # max_reasoning_tokens, when given too, is the budget.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None

    @model_validator(mode="after")
    def _top_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @model_validator(mode="after")
    def _continue_final(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs an assistant message last")
        if self.continue_final_message and self.session_id is not None:
            raise ValueError("continue_final_message does not work with session_id")
        return self

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def reasoning_budget(self) -> int | None:
        return reasoning_budget(self.max_reasoning_tokens, self.reasoning_effort)


class CompletionRequest(_Generation):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: object) -> object:
        if isinstance(v, list) and not v:
            raise ValueError("the prompt list is empty")
        return v

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and isinstance(self.prompt[0], int):
            # list[int]: mypy does not narrow a list by its first item
            return [self.prompt]  # type: ignore[list-item]
        return self.prompt  # type: ignore[return-value]  # list[str] or list[list[int]], as above
