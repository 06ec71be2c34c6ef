"""vLLM's tokenizer routes' bodies: POST /tokenize (TokenizeBody) and POST /detokenize (DetokenizeBody)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from serving.protocol.base import STRICT


class TokenizerBody(BaseModel):
    model_config = STRICT

    model: str | None = None  # optional, as in vLLM; when given it must name the served model


class TokenizeBody(TokenizerBody):
    prompt: str
    # vLLM's default; this tokenizer adds no special tokens around a text either way (pack.py adds the
    # end-of-text token between documents itself)
    add_special_tokens: bool = True


class DetokenizeBody(TokenizerBody):
    tokens: list[int] = Field(max_length=1_000_000)
