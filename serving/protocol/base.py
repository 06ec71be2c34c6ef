"""What the OpenAI and Anthropic request bodies share: the base model, the bounds and the validators both use.

Types are strict, as the JSON the APIs document: "4" is not a number, true is not 1, "yes" is not a boolean (a
float field takes an integer, as JSON has one number type). A body's size is bounded by the server (MAX_BODY_BYTES)
and its messages and content parts by count here, before anything is tokenized.
"""

from __future__ import annotations

from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from astrai_core.tokenizer.chat import control_token_in

# Every message costs at least two tokens in a chat template (its role header and its end of turn), so no context
# here (at most a few thousand tokens) holds more; a body of 36,000 empty messages (1 MB) is refused before its
# template is rendered and tokenized.
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 256  # text parts of one message's content

STRICT = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class Body(BaseModel):
    # Unknown fields are ignored, as the real APIs do (clients send fields of newer API versions); fields that
    # would change the answer and are not implemented (n, tools, logprobs, ...) are refused by name.
    model_config = STRICT

    model: str
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # an extension in the OpenAI routes, as vLLM has it; 0 or -1: off
    # The range torch.Generator.manual_seed takes; in the Anthropic route an extension, as top_k is in OpenAI's.
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stream: bool = False

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


def at_most(n: int, what: str) -> Callable[[Any], Any]:
    """A before-validator: a list of more than `n` items is refused before any item is validated."""
    def check(value: Any) -> Any:
        if isinstance(value, list) and len(value) > n:
            raise ValueError(f"at most {n} {what} (got {len(value)})")
        return value
    return check


def text_content(value: Any) -> Any:
    """Message content: a string, or a list of text parts ({"type": "text", "text": ...}) joined into one."""
    if isinstance(value, list):
        at_most(MAX_CONTENT_PARTS, "content parts")(value)
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value):
            raise ValueError("only text is supported: a string or a list of {'type': 'text', 'text': ...} parts")
        return "".join(p["text"] for p in value)
    return value


def no_control_tokens(value: str | None, info: ValidationInfo) -> str | None:
    """Message text is a turn's content, never its markup: text spelling a control token (<|end_of_turn|>,
    <|system|>, ...) would be tokenized as that token and forge turns. The same rule in both protocols, for every
    role, a prefilled reply and a system prompt included; the tokens come from the served tokenizer
    (validate_body's context)."""
    tokens = (info.context or {}).get("control_tokens", ())
    if value is not None and (token := control_token_in(value, tokens)):
        raise ValueError(f"contains the control token {token} (message text cannot hold a chat template's markup)")
    return value


class Message(BaseModel):
    """A message of either protocol: a role (each protocol names its own) and text content."""
    model_config = STRICT

    content: str

    _content = field_validator("content", mode="before")(text_content)
    _control = field_validator("content")(no_control_tokens)
