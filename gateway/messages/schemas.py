"""Anthropic Messages request bodies (pydantic), validated strictly from the raw JSON.

As for the OpenAI bodies (gateway/openai/schemas.py), unknown fields are kept and ignored
(`anthropic-beta` features a client may send, `cache_control` on any block) and every float is
finite. Content blocks are told apart by `type`: text, tool_use and thinking (sent back by the
client in an assistant turn), tool_result (in a user turn). Images and documents are refused:
the served models read text.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from gateway.openai.schemas import MAX_STOP_CHARS, OPEN


class TextBlock(BaseModel):
    model_config = OPEN

    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    model_config = OPEN

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, object]


class ToolResultBlock(BaseModel):
    model_config = OPEN

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(b.text for b in self.content)


class ThinkingBlock(BaseModel):
    model_config = OPEN

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(BaseModel):
    model_config = OPEN

    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class MessageParam(BaseModel):
    """A turn. A `system` message in the conversation (Claude Code sends them between turns)
    holds text and stays where it is, for the chat template to render."""

    model_config = OPEN

    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class ToolParam(BaseModel):
    """A client tool. Anthropic's server tools (`web_search_*`, `bash_*`, ...) run on
    Anthropic's side and are refused: their `type` is not "custom"."""

    model_config = OPEN

    name: str
    description: str | None = None
    input_schema: dict[str, object]
    type: str | None = None

    @field_validator("type")
    @classmethod
    def _custom(cls, v: str | None) -> str | None:
        if v not in (None, "custom"):
            raise ValueError(f"tools of type '{v[:64]}' are not supported; "
                             "only client tools (name, description, input_schema) are")
        return v


class ToolChoiceParam(BaseModel):
    model_config = OPEN

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingParam(BaseModel):
    """`enabled` thinks within `budget_tokens`; `adaptive` (and `between_tools`) within the
    budget of `output_config.effort`, if any."""

    model_config = OPEN

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(None, ge=1)
    display: Literal["summarized", "omitted"] | None = None  # omitted: empty thinking blocks

    @property
    def on(self) -> bool:
        return self.type != "disabled"

    @model_validator(mode="after")
    def _budget(self) -> ThinkingParam:
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("thinking of type 'enabled' needs 'budget_tokens'")
        return self


class OutputFormat(BaseModel):
    model_config = OPEN

    type: Literal["json_schema"]
    schema_: dict[str, object] = Field(alias="schema")


class OutputConfig(BaseModel):
    """`effort` bounds the thinking (the chat API's `reasoning_effort`; "max": unbounded);
    `format` is a JSON Schema the reply's text follows."""

    model_config = OPEN

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class Metadata(BaseModel):
    model_config = OPEN

    user_id: str | None = None


class CountTokensRequest(BaseModel):
    """`POST /v1/messages/count_tokens`: what a message would be prompted with."""

    model_config = OPEN

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfig | None = None
    # Switchboard's engine extensions, as chat completions take them.
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    speculative: bool = True
    chat_template_kwargs: dict[str, object] | None = None

    def system_text(self) -> str:
        if isinstance(self.system, list):
            return "\n".join(b.text for b in self.system)
        return self.system or ""


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`."""

    max_tokens: int = Field(ge=1)
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=2**31 - 1)
    stop_sequences: list[str] | None = None
    metadata: Metadata | None = None
    stream: bool = False

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and len(v) > 16:
            raise ValueError("at most 16 stop sequences")
        if any(not s or len(s) > MAX_STOP_CHARS for s in v or []):
            raise ValueError(f"stop sequences must be 1 to {MAX_STOP_CHARS} characters")
        return v

    @model_validator(mode="after")
    def _budget_below_max_tokens(self) -> MessagesRequest:
        budget = self.thinking.budget_tokens if self.thinking else None
        if self.thinking and self.thinking.type == "enabled" and budget is not None \
                and budget >= self.max_tokens:
            raise ValueError("thinking.budget_tokens must be less than max_tokens")
        return self
