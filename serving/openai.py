"""OpenAI routes: POST /v1/chat/completions and POST /v1/completions, whole or streamed (chunks, then
`data: [DONE]`; a last chunk with usage when stream_options.include_usage is set)."""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator, Literal

from fastapi import APIRouter, Depends, Request

from serving.auth import API, require_json
from serving.errors import ApiError, error_body
from serving.model import ServedModel
from serving.protocol.openai import ChatBody, CompletionBody, OpenAIBody
from serving.request import open_request
from serving.streaming import EventStream, Finish, Submission, collect, sse

router = APIRouter(dependencies=API)
Kind = Literal["chat", "text"]  # chat completions, or plain-text completions


@router.post("/v1/chat/completions", dependencies=[Depends(require_json)])
async def chat_completions(request: Request):
    served, body, started = await open_request(request, ChatBody)
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.content} for m in body.messages]
    prompt_ids = served.chat_prompt(messages, "messages")
    sub = served.submit(prompt_ids, body, body.max_completion_tokens or body.max_tokens, served.chat.stop_ids,
                        "messages")
    return await respond(request, served, body, prompt_ids, sub, started, "chat")


@router.post("/v1/completions", dependencies=[Depends(require_json)])
async def completions(request: Request):
    served, body, started = await open_request(request, CompletionBody)
    if isinstance(body.prompt, str):
        served.check_length([body.prompt], "prompt")
        prompt_ids = served.text_ids(body.prompt)
    else:
        prompt_ids = list(body.prompt)
        vocab = served.tokenizer.get_vocab_size()
        if not all(0 <= i < vocab for i in prompt_ids):
            raise ApiError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
    # OpenAI's default for the legacy completions endpoint is 16 tokens.
    sub = served.submit(prompt_ids, body, body.max_tokens or 16, served.eos, "prompt")
    return await respond(request, served, body, prompt_ids, sub, started, "text")


def usage(prompt_tokens: int, finish: Finish) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": finish.completion_tokens,
            "total_tokens": prompt_tokens + finish.completion_tokens}


def choice(kind: Kind, content: str | None, finish: str | None, first: bool = False) -> dict:
    """One streamed choice: a text piece (kind "text"), or a chat delta (the first one names the role)."""
    if kind == "text":
        return {"index": 0, "text": content or "", "logprobs": None, "finish_reason": finish}
    delta = ({"role": "assistant", "content": content} if first else
             {"content": content} if content is not None else {})
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}


async def respond(request: Request, served: ServedModel, body: OpenAIBody, prompt_ids: list[int], sub: Submission,
                  started: float, kind: Kind):
    """The OpenAI reply for chat (kind "chat") or plain completions (kind "text"), whole or streamed."""
    prefix, obj = ("chatcmpl", "chat.completion") if kind == "chat" else ("cmpl", "text_completion")
    head = {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": served.model_id}
    events = served.generate(sub, body.stop, started)

    if not body.stream:
        reply, finish = await collect(request, events)
        message = {"message": {"role": "assistant", "content": reply}} if kind == "chat" else {"text": reply}
        return {**head, "object": obj, "choices": [{"index": 0, **message, "logprobs": None,
                                                    "finish_reason": finish.reason}],
                "usage": usage(len(prompt_ids), finish)}

    with_usage = body.stream_options is not None and body.stream_options.include_usage
    chunk_obj = f"{obj}.chunk" if kind == "chat" else obj

    def chunk(choices: list[dict], **extra) -> str:
        return sse({**head, "object": chunk_obj, "choices": choices, **({"usage": None} if with_usage else {}),
                    **extra})

    async def stream() -> AsyncIterator[str]:
        try:
            if kind == "chat":
                yield chunk([choice(kind, "", None, first=True)])
            async for item in events:
                if isinstance(item, Finish):
                    yield chunk([choice(kind, None, item.reason)])
                    if with_usage:
                        yield chunk([], usage=usage(len(prompt_ids), item))
                else:
                    yield chunk([choice(kind, item, None)])
        except ApiError as e:
            yield sse(error_body(request.url.path, e.status, e.message))
        yield sse("[DONE]")

    return EventStream(stream(), sub.cancel)
