"""Errors: one exception (ApiError), rendered in the JSON shape of the protocol the route speaks.

    OpenAI (every route but /v1/messages):  {"error": {"message", "type", "param", "code"}}
    Anthropic (/v1/messages):               {"type": "error", "error": {"type", "message"}}
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


OPENAI_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                      404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
                      415: "invalid_request_error", 503: "server_error", 500: "server_error"}
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                         415: "invalid_request_error", 503: "overloaded_error", 500: "api_error"}


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(path: str, status: int, message: str, param: str | None = None) -> dict:
    """The error JSON for a request to `path`, in that route's protocol."""
    if is_anthropic(path):
        return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}
    code = "model_not_found" if status == 404 and param == "model" else None
    return {"error": {"message": message, "type": OPENAI_ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


# --- the app's exception handlers (create_app installs EXCEPTION_HANDLERS) ----------------------------------------

async def api_error(request: Request, e: ApiError) -> JSONResponse:
    return JSONResponse(error_body(request.url.path, e.status, e.message, e.param), status_code=e.status)


async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:  # unknown route, 405
    return JSONResponse(error_body(request.url.path, e.status_code, str(e.detail)), status_code=e.status_code)


async def internal_error(request: Request, e: Exception) -> JSONResponse:  # a bug: the server stays up
    return JSONResponse(error_body(request.url.path, 500, f"internal error: {type(e).__name__}"), status_code=500)


EXCEPTION_HANDLERS = {ApiError: api_error, StarletteHTTPException: http_error, Exception: internal_error}
