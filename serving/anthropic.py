"""Anthropic route: POST /v1/messages, whole or streamed (message_start, content_block_start, ping,
content_block_delta..., content_block_stop, message_delta, message_stop)."""

from __future__ import annotations

import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Depends, Request

from serving.auth import API, require_json
from serving.errors import ApiError, error_body
from serving.model import ServedModel
from serving.protocol.anthropic import MessagesBody
from serving.request import open_request
from serving.streaming import EventStream, Finish, collect, sse

router = APIRouter(dependencies=API)
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


@router.post("/v1/messages", dependencies=[Depends(require_json)])
async def messages(request: Request):
    served, body, started = await open_request(request, MessagesBody)
    prompt_ids = messages_prompt(served, body)
    sub = served.submit(prompt_ids, body, body.max_tokens, served.chat.stop_ids, "messages")
    events = served.generate(sub, body.stop_sequences, started)
    message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": served.model_id}

    if not body.stream:
        reply, finish = await collect(request, events)
        return {**message, "content": [{"type": "text", "text": reply}], "stop_reason": stop_reason(finish),
                "stop_sequence": finish.stop_sequence,
                "usage": {"input_tokens": len(prompt_ids), "output_tokens": finish.completion_tokens}}

    async def stream() -> AsyncIterator[str]:
        yield sse({"type": "message_start", "message": {
            **message, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": len(prompt_ids), "output_tokens": 0}}}, "message_start")
        yield sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                  "content_block_start")
        yield sse({"type": "ping"}, "ping")
        try:
            async for item in events:
                if isinstance(item, Finish):
                    yield sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
                    yield sse({"type": "message_delta", "delta": {"stop_reason": stop_reason(item),
                                                                  "stop_sequence": item.stop_sequence},
                               "usage": {"output_tokens": item.completion_tokens}}, "message_delta")
                    yield sse({"type": "message_stop"}, "message_stop")
                else:
                    yield sse({"type": "content_block_delta", "index": 0,
                               "delta": {"type": "text_delta", "text": item}}, "content_block_delta")
        except ApiError as e:
            yield sse(error_body(request.url.path, e.status, e.message), "error")

    return EventStream(stream(), sub.cancel)


def messages_prompt(served: ServedModel, body: MessagesBody) -> list[int]:
    """The prompt ids: the system prompt and the turns in the chat template. A final assistant message is a
    prefilled reply: the model continues its text."""
    turns = [{"role": m.role, "content": m.content} for m in body.messages]
    system = [{"role": "system", "content": body.system}] if body.system else []
    if turns[-1]["role"] != "assistant":
        return served.chat_prompt(system + turns, "messages")
    served.check_length([m["content"] for m in system + turns], "messages")
    return served.chat_prompt(system + turns[:-1], "messages") + served.text_ids(turns[-1]["content"])


def stop_reason(finish: Finish) -> str:
    return "stop_sequence" if finish.stop_sequence is not None else STOP_REASONS[finish.reason]
