"""ServedModel: what the OpenAI and Anthropic routes share for the one model a server serves (create_app keeps it
on app.state.served): reading and validating a body, building prompt ids, and submitting them to the engine."""

from __future__ import annotations

import json
import time
from typing import AsyncIterator, Sequence, TypeVar

from fastapi import Request
from pydantic import ValidationError

from astrai_core.bpe import special_id
from astrai_core.chat import ChatFormat
from astrai_core.engine import Engine, SamplingParams
from astrai_core.errors import AstraiError
from serving.errors import ApiError, lone_surrogate, validation_message
from serving.metrics import metrics_registry
from serving.protocol.anthropic import MessagesBody
from serving.protocol.base import Body
from serving.protocol.openai import OpenAIBody
from serving.streaming import EventRelay, Finish, Submission, run_generation
from serving.text_stream import TextStream

MAX_BODY_BYTES = 1024 * 1024  # far more text than any context here holds; bigger bodies get 413
GREEDY_BELOW = 1e-5  # temperatures this small sample greedily (dividing logits by them would overflow)

B = TypeVar("B", bound=Body)


async def read_json(request: Request, max_bytes: int) -> dict:
    """The request's body as a JSON object: 413 past max_bytes (declared or read), 400 for anything not JSON, not
    an object, or holding a string that is not valid Unicode."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"request body of {declared} bytes is over the limit of {max_bytes}")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > max_bytes:
            raise ApiError(413, f"request body is over the limit of {max_bytes} bytes")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # ValueError covers bad UTF-8 too
        raise ApiError(400, f"request body is not valid JSON ({str(e)[:200]})") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    if field := lone_surrogate(data):
        raise ApiError(400, f"{field}: not valid Unicode (a lone surrogate escape such as \\ud800)", param=field)
    return data


class ServedModel:
    """One model on a started engine. Requests may name it `model_id` or any of `aliases` (a registered model's
    name, NAME@ALIAS: ids a client keeps when the champion moves); responses name `model_id`."""

    def __init__(self, engine: Engine, chat: ChatFormat, model_id: str, aliases: Sequence[str] = (),
                 max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.engine, self.chat, self.tokenizer = engine, chat, chat.tokenizer
        self.model_id, self.max_body_bytes = model_id, max_body_bytes
        self.names = (model_id, *[a for a in aliases if a != model_id])
        self.created = int(time.time())
        self.context = engine.context_length
        self.eos = (special_id(self.tokenizer, "eos"),)  # a plain-text completion ends at end-of-text
        self.relay = EventRelay()
        engine.after_step.append(self.relay.flush)
        self.registry, self.ttft = metrics_registry(engine)
        # Tokenizing megabytes would stall every stream on the event loop for seconds, so a text that cannot fit
        # the context is refused before: no token covers more than this many bytes of text.
        self.max_token_bytes = max(len(t.encode()) for t in self.tokenizer.get_vocab())

    def model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "astrai"}

    def check_model(self, name: str) -> None:
        if name not in self.names:
            raise ApiError(404, f"model {name!r} not found; this server serves {', '.join(self.names)}",
                           param="model")

    async def parse(self, request: Request, model: type[B]) -> B:
        """The request's body validated as `model` (400 naming the field), for a model this server serves (404)."""
        data = await read_json(request, self.max_body_bytes)
        try:
            body = model.model_validate(data)
        except ValidationError as e:
            field, message = validation_message(e)
            raise ApiError(400, message, param=field) from None
        self.check_model(body.model)
        return body

    def check_length(self, texts: list[str], field: str) -> None:
        size = sum(len(t.encode()) for t in texts)
        if size > self.context * self.max_token_bytes:
            raise ApiError(400, f"prompt has more than {self.context} tokens ({size} bytes of text, at most "
                                f"{self.max_token_bytes} per token); the context is {self.context}", param=field)

    def chat_prompt(self, messages: list[dict], field: str) -> list[int]:
        """Messages ({"role", "content"}) in the chat template, ready for the assistant's turn."""
        self.check_length([m["content"] for m in messages], field)
        try:
            return self.chat.encode_prompt(messages)
        except AstraiError as e:
            raise ApiError(400, f"{field}: {e}", param=field) from None

    def text_ids(self, text: str) -> list[int]:
        """Plain text as token ids, no special tokens (a completion's prompt, a prefilled reply)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def submit(self, prompt_ids: list[int], body: OpenAIBody | MessagesBody, max_tokens: int | None,
               stop_ids: tuple[int, ...], field: str) -> Submission:
        if len(prompt_ids) >= self.context:
            raise ApiError(400, f"prompt has {len(prompt_ids)} tokens; the context is {self.context} "
                                f"(prompt and reply must fit in it)", param=field)
        temperature = body.temperature if body.temperature >= GREEDY_BELOW else 0.0
        # A reply runs at most to the end of the context (the engine ends it there with "length").
        budget = self.context - len(prompt_ids)
        params = SamplingParams(max_tokens=min(max_tokens or budget, budget), temperature=temperature,
                                top_p=body.top_p, top_k=body.top_k, seed=body.seed, stop_token_ids=stop_ids)
        return Submission(self.engine, prompt_ids, params, self.relay)

    def generate(self, sub: Submission, stops: list[str], started: float) -> AsyncIterator[str | Finish]:
        """The reply's text pieces as they become final, then one Finish (see streaming.run_generation)."""
        return run_generation(sub, TextStream(self.tokenizer, stops), self.ttft, started)
