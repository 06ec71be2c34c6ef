"""Anthropic request body: POST /v1/messages (MessagesBody)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from serving.protocol.base import MAX_MESSAGES, Body, Message, at_most, no_control_tokens, refuse, text_content

MAX_STOPS = 16


class AnthropicMessage(Message):
    role: Literal["user", "assistant"]


class MessagesBody(Body):
    temperature: float = Field(1.0, ge=0, le=1)
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | None = None
    stop_sequences: list[str] = Field([], max_length=MAX_STOPS)
    tools: Any = None
    tool_choice: Any = None

    _count = field_validator("messages", mode="before")(at_most(MAX_MESSAGES, "messages"))
    _tools = field_validator("tools", "tool_choice")(refuse("tool use (this model has no tools)", []))
    _system = field_validator("system", mode="before")(text_content)
    _system_control = field_validator("system")(no_control_tokens)

    @field_validator("stop_sequences")
    @classmethod
    def _non_empty(cls, value: list[str]) -> list[str]:
        if not all(value):
            raise ValueError("empty stop sequence")
        return value
