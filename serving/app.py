"""create_app: the server for one model, assembled from the protocol routers.

    app = create_app(engine, chat, model_id="astrai/3", api_key=None)    # engine: an EngineClient
    serving.server.run(app, engine, "127.0.0.1", 8000)                     # `astrai serve` does this

Routes: GET /v1/models, POST /v1/chat/completions, POST /v1/completions (OpenAI), POST /v1/messages (Anthropic),
POST /tokenize, POST /detokenize, GET /tokenizer_info (vLLM's, for lm-evaluation-harness's remote tokenizer),
GET /health (503 once the engine loop has died; astrai serve then exits), GET /metrics (Prometheus text), GET / (a
chat page over /v1/chat/completions: static/index.html; open, as its API calls carry the key; never framed). Every
route checks the Host header, the /v1/ routes the Origin and the key, the POST routes the Content-Type (auth.py).
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Sequence

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from astrai_core.inference.engine import EngineClient
from astrai_core.tokenizer.chat import ChatFormat
from serving import anthropic, openai, tokenize
from serving.auth import API, Hosts, require_host
from serving.errors import EXCEPTION_HANDLERS
from serving.model import MAX_BODY_BYTES, AliasWatch, ServedModel

router = APIRouter()  # the routes of the server itself, not of one protocol
# The page loads nothing from elsewhere, and the browser is told so: it may talk to this server only. No page may
# frame it (a page of another site could lay its own elements over the key field and the Send button):
# frame-ancestors for today's browsers, X-Frame-Options for older ones.
PAGE_HEADERS = {"Cache-Control": "no-cache",
                "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                           "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
                                           "frame-ancestors 'none'",
                "X-Frame-Options": "DENY"}


def create_app(engine: EngineClient, chat: ChatFormat, model_id: str, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, aliases: Sequence[str] = (), hosts: Hosts = Hosts(),
               watch: AliasWatch | None = None) -> FastAPI:
    """The server for one model. `engine` must be started by the caller (and stopped after the server). Requests
    may name it `model_id` or any of `aliases` (a registered model's name, NAME@ALIAS: ids a client keeps when the
    champion moves); responses name `model_id`. With `api_key`, every /v1/ route needs it. `hosts`: the names
    requests may give in Host and Origin (auth.py: the address it is bound to, loopback, --allowed-host). `watch`:
    the registry alias it was started by, which the caller keeps up to date (/health and /v1/models report it)."""
    app = FastAPI(title="astrai serve", docs_url=None, redoc_url=None, openapi_url=None,
                  exception_handlers=EXCEPTION_HANDLERS, dependencies=[Depends(require_host)])
    app.state.served = ServedModel(engine, chat, model_id, aliases, max_body_bytes, watch)
    app.state.api_key, app.state.hosts = api_key, hosts
    app.include_router(router)
    app.include_router(openai.router)
    app.include_router(anthropic.router)
    app.include_router(tokenize.router)
    return app


@router.get("/")
async def chat_page() -> HTMLResponse:
    return HTMLResponse(page(), headers=PAGE_HEADERS)


@functools.cache
def page() -> str:
    """The chat page, read once from the package (importlib.resources: also from a non-editable install)."""
    return resources.files("serving").joinpath("static/index.html").read_text(encoding="utf-8")


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    served: ServedModel = request.app.state.served
    # A moved alias leaves the server healthy (it serves what it loaded): the registry part says so.
    registry = {"registry": served.watch.report()} if served.watch else {}
    if served.engine.alive:
        return JSONResponse({"status": "ok", "model": served.model_id, **registry})
    return JSONResponse({"status": "engine stopped", "model": served.model_id, **registry}, status_code=503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.served.registry), media_type=CONTENT_TYPE_PLAIN_0_0_4)


@router.get("/v1/models", dependencies=API)
async def list_models(request: Request) -> dict:
    served: ServedModel = request.app.state.served
    return {"object": "list", "data": [served.model_card(name) for name in served.names]}


@router.get("/v1/models/{name:path}", dependencies=API)
async def get_model(request: Request, name: str) -> dict:
    served: ServedModel = request.app.state.served
    served.check_model(name)
    return served.model_card(name)
