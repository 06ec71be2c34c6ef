"""OpenAI request bodies: POST /v1/chat/completions (ChatBody) and POST /v1/completions (CompletionBody)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from serving.protocol.base import MAX_MESSAGES, STRICT, Body, Message, at_most, refuse

MAX_STOPS = 4  # as OpenAI documents
MAX_LOGPROBS = 20  # top logprobs per position at most: vLLM's default max_logprobs (OpenAI's legacy API allows 5)
MAX_PROMPTS = 256  # prompts in one completions request (each is one engine request; the default queue bound)


def _one_stop_is_a_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else [] if value is None else value  # anything else: checked as a list


def _stops(stops: list[str]) -> list[str]:
    if len(stops) > MAX_STOPS or not all(stops):
        raise ValueError(f"at most {MAX_STOPS} non-empty strings")
    return stops


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class OpenAIBody(Body):
    temperature: float = Field(1.0, ge=0, le=2)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens in chat; wins if both
    stop: list[str] = []
    stream_options: StreamOptions | None = None
    n: int | None = 1
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None

    _stop_list = field_validator("stop", mode="before")(_one_stop_is_a_list)
    _stop = field_validator("stop")(_stops)
    _n = field_validator("n")(refuse("n other than 1 (one choice per request)", 1))
    _penalties = field_validator("presence_penalty", "frequency_penalty")(refuse("penalties other than 0", 0, 0.0))
    _logit_bias = field_validator("logit_bias")(refuse("logit_bias", {}))


class ChatMessage(Message):
    role: Literal["system", "developer", "user", "assistant"]  # developer: OpenAI's newer name for system


class ChatBody(OpenAIBody):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: Any = None
    functions: Any = None
    tool_choice: Any = None
    response_format: Any = None
    logprobs: Any = None
    top_logprobs: Any = None

    _count = field_validator("messages", mode="before")(at_most(MAX_MESSAGES, "messages"))
    _logprobs = field_validator("logprobs", "top_logprobs")(refuse("logprobs in chat completions (the "
                                                                   "completions route has them)", False, 0))
    _tools = field_validator("tools", "functions", "tool_choice")(refuse("tool calling (this model has no tools)", [], "none"))

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if value is not None and value != {"type": "text"}:
            raise ValueError("not supported: only {'type': 'text'}")
        return value


class CompletionBody(OpenAIBody):
    """Several prompts (a list of strings or of token-id lists) get one choice each, in order. `echo` puts the
    prompt before the reply (and its tokens' logprobs first, with `logprobs`); `max_tokens: 0` with `echo` scores
    the prompt and generates nothing (vLLM's meaning; lm-evaluation-harness's loglikelihood requests)."""
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)
    # OpenAI's legacy logprobs: the sampled (and with echo, the prompt's) tokens' log-probabilities, and the
    # `logprobs` most likely tokens at each position. OpenAI allows up to 5; vLLM up to its max_logprobs (20).
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    # vLLM's extension: generate on past the model's end of turn and end of text (only `stop` and max_tokens end it)
    ignore_eos: bool = False
    suffix: str | None = None
    best_of: int | None = None

    _suffix = field_validator("suffix")(refuse("suffix", ""))
    _best_of = field_validator("best_of")(refuse("best_of other than 1", 1))

    @field_validator("prompt", mode="before")
    @classmethod
    def _count(cls, value: Any) -> Any:
        """At most MAX_PROMPTS prompts, counted before any is validated. A flat list of integers is one prompt of
        token ids, however many: its length is the prompt's, checked against the context as a text's is."""
        if isinstance(value, list) and not (value and type(value[0]) is int):
            at_most(MAX_PROMPTS, "prompts")(value)
        return value

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        """One message for the four shapes (pydantic's would name a union member: 'prompt.str: ...')."""
        def ids(v: Any) -> bool:
            return isinstance(v, list) and all(type(i) is int for i in v)
        if not (isinstance(value, str) or ids(value) or isinstance(value, list) and (
                all(isinstance(p, str) for p in value) or all(ids(p) for p in value))):
            raise ValueError("expected a string, a list of strings, a list of token ids (integers) or a list of "
                             "lists of token ids")
        return value

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if not value or isinstance(value, list) and isinstance(value[0], (str, list)) and not all(value):
            raise ValueError("empty prompt")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or a list of token ids."""
        value = self.prompt
        return value if isinstance(value, list) and isinstance(value[0], (str, list)) else [value]
