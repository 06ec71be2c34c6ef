"""OpenAI routes: POST /v1/chat/completions and POST /v1/completions, whole or streamed (chunks, then
`data: [DONE]`; a last chunk with usage when stream_options.include_usage is set)."""

from __future__ import annotations

import itertools
import time
import uuid
from typing import AsyncIterator, Literal

from fastapi import APIRouter, Depends, Request

from astrai_core.inference.engine import TokenLogprob
from serving.auth import API, require_json
from serving.errors import ApiError, error_body
from serving.model import ServedModel
from serving.protocol.openai import ChatBody, CompletionBody, OpenAIBody
from serving.request import open_request
from serving.streaming import EventStream, Finish, Submission, collect, collect_all, sse

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
    check_completion_options(body)
    prompts = [completion_prompt_ids(served, p) for p in body.prompts]
    # OpenAI's default for the legacy completions endpoint is 16 tokens.
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    stop_ids = served.completion_stop_ids(body.stop, body.ignore_eos)
    if body.stream:
        sub = served.submit(prompts[0], body, max_tokens, stop_ids, "prompt")
        return await respond(request, served, body, prompts[0], sub, started, "text")
    return await complete(request, served, body, prompts, max_tokens, stop_ids, started)


def check_completion_options(body: CompletionBody) -> None:
    """What the completions route refuses in combination (each field alone is checked by CompletionBody)."""
    if body.max_tokens == 0 and not body.echo:
        raise ApiError(400, "max_tokens: 0 only with echo (the prompt's logprobs, nothing generated)",
                       param="max_tokens")
    if body.stream:
        for field, given in (("logprobs", body.logprobs is not None), ("echo", body.echo),
                             ("prompt", len(body.prompts) > 1)):
            if given:
                what = "several prompts" if field == "prompt" else field
                raise ApiError(400, f"{field}: not supported with stream ({what} only in a whole reply)", param=field)


def completion_prompt_ids(served: ServedModel, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        served.check_length([prompt], "prompt")
        return served.text_ids(prompt)
    served.check_ids(prompt, "prompt")
    return list(prompt)


async def complete(request: Request, served: ServedModel, body: CompletionBody, prompts: list[list[int]],
                   max_tokens: int, stop_ids: tuple[int, ...], started: float) -> dict:
    """The whole reply to a completions request: one choice per prompt, with the prompt (echo) and the logprobs
    asked for. Logprobs follow OpenAI's legacy completions API, the prompt's first token null as in vLLM."""
    k = body.logprobs
    # The engine's prompt logprobs: asked for with echo, and needed to run a request that generates nothing.
    prompt_logprobs = (k or 0) if body.echo and (k is not None or max_tokens == 0) else None
    subs: list[Submission] = []
    try:
        for ids in prompts:
            subs.append(served.submit(ids, body, max_tokens, stop_ids, "prompt", logprobs=k,
                                      prompt_logprobs=prompt_logprobs))
    except ApiError:
        for sub in subs:
            sub.cancel()
        raise
    replies = await collect_all(request, [served.generate(sub, body.stop, started) for sub in subs])
    choices = []
    for i, (ids, sub, (reply, finish)) in enumerate(zip(prompts, subs, replies)):
        text, logprobs = reply, None
        if body.echo:
            prompt = body.prompts[i]
            text = (prompt if isinstance(prompt, str) else served.tokenizer.decode(ids, skip_special_tokens=False)) + text
        if k is not None:  # the engine's entries: the prompt's first with echo, then the generated tokens'
            shown = ids if body.echo else []
            generated = [e.token for e in sub.logprobs[len(shown):]]
            logprobs = legacy_logprobs(served, shown + generated, sub.logprobs)
        choices.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish.reason})
    prompt_tokens = sum(map(len, prompts))
    completion_tokens = sum(finish.completion_tokens for _, finish in replies)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": served.model_id, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def legacy_logprobs(served: ServedModel, ids: list[int], entries: list[TokenLogprob | None]) -> dict:
    """OpenAI's legacy `logprobs` of a choice: per token its text, log-probability (None: the prompt's first
    token) and a dict of the most likely tokens there that always holds the token itself, and its character
    offset in the choice's text (each token's text laid end to end, as vLLM counts them)."""
    tokens = [served.token_text(i) for i in ids]
    top = []
    for text, e in zip(tokens, entries, strict=True):
        if e is None:
            top.append(None)
            continue
        # Two tokens may read the same (pieces of one UTF-8 character): the likelier keeps the key.
        alternatives: dict[str, float] = {}
        for token_id, logprob in e.top:
            alternatives.setdefault(served.token_text(token_id), logprob)
        alternatives.setdefault(text, e.logprob)
        top.append(alternatives)
    return {"tokens": tokens, "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": top, "text_offset": list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0))}


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
