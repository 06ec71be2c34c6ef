"""The API key: with `astrai serve --api-key KEY`, every /v1/ route needs 'Authorization: Bearer KEY' (what the
openai client sends) or 'x-api-key: KEY' (what the anthropic client sends). /health, /metrics and the chat page
(GET /) stay open."""

from __future__ import annotations

import hmac
from typing import Mapping

from fastapi import Request

from serving.errors import ApiError


def check_key(headers: Mapping[str, str], api_key: str | None) -> None:
    """Raises ApiError 401 unless `headers` (lower-case names) carry `api_key`; no key set: anything passes."""
    if api_key is None:
        return
    bearer = headers.get("authorization", "")
    given = [bearer[7:].strip() if bearer[:7].lower() == "bearer " else "", headers.get("x-api-key", "")]
    if not any(hmac.compare_digest(g.encode(), api_key.encode()) for g in given if g):
        raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')")


def require_key(request: Request) -> None:
    """The route dependency: the key create_app was given (app.state.api_key)."""
    check_key(request.headers, request.app.state.api_key)
