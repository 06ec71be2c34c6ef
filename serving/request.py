"""A request's opening, the same in every API route: its JSON body read (413 past the size limit, 400 for what is
not a JSON object), validated as the route's protocol model (protocol/validate.py: 400 naming the field), for the
model this server serves (404).

    served, body, started = await open_request(request, ChatBody)
"""

from __future__ import annotations

import json
import time
from typing import TypeVar

from fastapi import Request

from serving.errors import ApiError
from serving.model import ServedModel
from serving.protocol.base import Body
from serving.protocol.validate import validate_body

B = TypeVar("B", bound=Body)


async def open_request(request: Request, model: type[B]) -> tuple[ServedModel, B, float]:
    """(the served model, the body validated as `model`, the arrival time for time-to-first-token)."""
    started = time.perf_counter()
    served: ServedModel = request.app.state.served
    body = validate_body(model, await read_json(request, served.max_body_bytes), served.chat.control_tokens)
    served.check_model(body.model)
    return served, body, started


async def read_json(request: Request, max_bytes: int) -> dict:
    """The request's body as a JSON object: 413 past max_bytes (declared or read), 400 for anything not JSON or
    not an object."""
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
    return data
