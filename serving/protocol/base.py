"""What the OpenAI and Anthropic request bodies share: the base model and the validators both use."""

from __future__ import annotations

from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator


class Body(BaseModel):
    # Unknown fields are ignored, as the real APIs do (clients send fields of newer API versions); fields that
    # would change the answer and are not implemented (n, tools, logprobs, ...) are refused by name.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # an extension in the OpenAI routes, as vLLM has it; 0 or -1: off
    # The range torch.Generator.manual_seed takes; in the Anthropic route an extension, as top_k is in OpenAI's.
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stream: StrictBool = False  # the OpenAI and Anthropic APIs take a JSON boolean, not "yes" or 1

    @field_validator("top_k")
    @classmethod
    def _top_k_off(cls, value: int | None) -> int | None:
        return value if value is not None and value > 0 else None


def refuse(what: str, *allowed: Any) -> Callable[[Any], Any]:
    """A validator that refuses any value but `allowed` (compared with their types: True is not 1)."""
    def check(value: Any) -> Any:
        if value is not None and not any(type(value) is type(a) and value == a for a in allowed):
            raise ValueError(f"not supported: {what}")
        return value
    return check


def text_content(value: Any) -> Any:
    """Message content: a string, or a list of text parts ({"type": "text", "text": ...}) joined into one."""
    if isinstance(value, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value):
            raise ValueError("only text is supported: a string or a list of {'type': 'text', 'text': ...} parts")
        return "".join(p["text"] for p in value)
    return value
