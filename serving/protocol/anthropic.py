"""Anthropic request body: POST /v1/messages (MessagesBody)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from serving.protocol.base import Body, refuse, text_content

MAX_STOPS = 16


class AnthropicMessage(BaseModel):
    role: Literal["user", "assistant"]
    content: str

    _content = field_validator("content", mode="before")(text_content)


class MessagesBody(Body):
    temperature: float = Field(1.0, ge=0, le=1)
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | None = None
    stop_sequences: list[str] = Field([], max_length=MAX_STOPS)
    tools: Any = None
    tool_choice: Any = None

    _tools = field_validator("tools", "tool_choice")(refuse("tool use (this model has no tools)", []))
    _system = field_validator("system", mode="before")(text_content)

    @field_validator("stop_sequences")
    @classmethod
    def _non_empty(cls, value: list[str]) -> list[str]:
        if not all(value):
            raise ValueError("empty stop sequence")
        return value
