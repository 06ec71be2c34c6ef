"""The HTTP side of `astrai serve`: OpenAI- and Anthropic-compatible routes over the inference engine.

    app = create_app(engine, chat, model_id="astrai/3", api_key=None)    # engine: astrai_core.engine.Engine
    uvicorn.run(app, host="127.0.0.1", port=8000)                          # `astrai serve` does this

Routes: GET /v1/models, POST /v1/chat/completions, POST /v1/completions (OpenAI), POST /v1/messages (Anthropic),
GET /health (503 once the engine loop has died), GET /metrics (Prometheus text).

A request's way through: the JSON body is read (413 past the size limit), parsed and validated by the pydantic
models below (400 naming the field), turned into prompt token ids (the chat template for chat and messages), and
submitted to the engine with a callback that hands each event (new token ids, finish reason) from the engine
thread to this request's asyncio queue. TextStream turns the token ids into text: it gives out only text that
can no longer change, so a stop string is never returned, not even partly, and a character whose UTF-8 bytes are
split across tokens is held back until it is whole. Responses and errors take each protocol's own shape. A client
that goes away (a closed stream or an abandoned request) has its engine request cancelled, which frees its batch
slot and KV blocks at the engine's next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Literal, Sequence

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from tokenizers import Tokenizer
import torch

from astrai_core.chat import ChatFormat
from astrai_core.engine import Engine, QueueFull, SamplingParams
from astrai_core.errors import AstraiError
from astrai_core.bpe import special_id

MAX_BODY_BYTES = 1024 * 1024  # far more text than any context here holds; bigger bodies get 413
GREEDY_BELOW = 1e-5  # temperatures this small sample greedily (dividing logits by them would overflow)
OPENAI_MAX_STOPS = 4  # as OpenAI documents
ANTHROPIC_MAX_STOPS = 16


# --- errors: one exception, rendered in the shape of the protocol the route speaks -------------------------------

class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


OPENAI_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                      405: "invalid_request_error", 413: "invalid_request_error", 503: "server_error",
                      500: "server_error"}
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                         405: "invalid_request_error", 413: "request_too_large", 503: "overloaded_error",
                         500: "api_error"}


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(path: str, status: int, message: str, param: str | None = None) -> dict:
    if is_anthropic(path):
        return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}
    code = "model_not_found" if status == 404 and param == "model" else None
    return {"error": {"message": message, "type": OPENAI_ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


def lone_surrogate(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string in a parsed JSON value that is not valid Unicode (JSON's "\\ud800"
    escapes decode to lone surrogates, which no tokenizer can encode), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
    elif isinstance(value, dict):
        for key, item in value.items():
            found = lone_surrogate(key, path) or lone_surrogate(item, f"{path}.{key}" if path else str(key))
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if found := lone_surrogate(item, f"{path}.{i}" if path else str(i)):
                return found
    return None


def validation_message(e: ValidationError) -> tuple[str, str]:
    """(field, message) of the first problem pydantic found, e.g. ("messages.0.role", "Input should be ...")."""
    err = e.errors()[0]
    field = ".".join(str(part) for part in err["loc"]) or "body"
    message = "unknown field" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
    return field, f"{field}: {message}"


# --- request bodies ------------------------------------------------------------------------------------------------

class Body(BaseModel):
    # Unknown fields are ignored, as the real APIs do (clients send fields of newer API versions); fields that
    # would change the answer and are not implemented (n, tools, logprobs, ...) are refused by name below.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # an extension in the OpenAI routes, as vLLM has it; 0 or -1: off
    # The range torch.Generator.manual_seed takes; in the Anthropic route an extension, as top_k is in OpenAI's.
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stream: StrictBool = False  # the OpenAI and Anthropic APIs take a JSON boolean, not "yes" or 1

    @field_validator("top_k")
    @classmethod
    def _top_k_off(cls, value: int | None) -> int | None:
        return value if value is not None and value > 0 else None


def _refuse(what: str, *allowed: Any) -> Callable[[Any], Any]:
    """A validator that refuses any value but `allowed` (compared with their types: True is not 1)."""
    def check(value: Any) -> Any:
        if value is not None and not any(type(value) is type(a) and value == a for a in allowed):
            raise ValueError(f"not supported: {what}")
        return value
    return check


def _openai_stops(value: str | list[str] | None) -> list[str]:
    stops = [value] if isinstance(value, str) else (value or [])
    if len(stops) > OPENAI_MAX_STOPS or not all(stops):
        raise ValueError(f"at most {OPENAI_MAX_STOPS} non-empty strings")
    return stops


class StreamOptions(BaseModel):
    include_usage: bool = False


class OpenAIBody(Body):
    temperature: float = Field(1.0, ge=0, le=2)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens in chat; wins if both
    stop: list[str] = []
    stream_options: StreamOptions | None = None
    n: int | None = 1
    logprobs: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None

    _stop = field_validator("stop", mode="before")(_openai_stops)
    _n = field_validator("n")(_refuse("n other than 1 (one choice per request)", 1))
    _logprobs = field_validator("logprobs")(_refuse("logprobs", False))
    _penalties = field_validator("presence_penalty", "frequency_penalty")(_refuse("penalties other than 0", 0, 0.0))
    _logit_bias = field_validator("logit_bias")(_refuse("logit_bias", {}))


def _text_content(value: Any) -> Any:
    """Message content: a string, or a list of text parts ({"type": "text", "text": ...}) joined into one."""
    if isinstance(value, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value):
            raise ValueError("only text is supported: a string or a list of {'type': 'text', 'text': ...} parts")
        return "".join(p["text"] for p in value)
    return value


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]  # developer: OpenAI's newer name for system
    content: str

    _content = field_validator("content", mode="before")(_text_content)


class ChatBody(OpenAIBody):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: Any = None
    functions: Any = None
    tool_choice: Any = None
    response_format: Any = None

    _tools = field_validator("tools", "functions", "tool_choice")(_refuse("tool calling (this model has no tools)", [], "none"))

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if value is not None and value != {"type": "text"}:
            raise ValueError("not supported: only {'type': 'text'}")
        return value


class CompletionBody(OpenAIBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    _echo = field_validator("echo", "suffix")(_refuse("echo and suffix", False, ""))
    _best_of = field_validator("best_of")(_refuse("best_of other than 1", 1))

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError("one prompt per request (a list of several prompts is not supported)")
            value = value[0]
        if not value:
            raise ValueError("empty prompt")
        return value


class AnthropicMessage(BaseModel):
    role: Literal["user", "assistant"]
    content: str

    _content = field_validator("content", mode="before")(_text_content)


class MessagesBody(Body):
    temperature: float = Field(1.0, ge=0, le=1)
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | None = None
    stop_sequences: list[str] = Field([], max_length=ANTHROPIC_MAX_STOPS)
    tools: Any = None
    tool_choice: Any = None

    _tools = field_validator("tools", "tool_choice")(_refuse("tool use (this model has no tools)", []))
    _system = field_validator("system", mode="before")(_text_content)

    @field_validator("stop_sequences")
    @classmethod
    def _non_empty(cls, value: list[str]) -> list[str]:
        if not all(value):
            raise ValueError("empty stop sequence")
        return value


# --- token ids to text ---------------------------------------------------------------------------------------------

class TextStream:
    """Token ids in, text out: `add` returns the text that became final, so everything given out is a prefix
    of the reply's final text. Held back: an incomplete UTF-8 character at the end (the byte-level tokenizer
    decodes it as U+FFFD until its last byte arrives) and the longest end of the text that could still grow into
    a stop string. When a stop string appears, the text is cut before it and stop_sequence is set."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str] = ()) -> None:
        self.tokenizer, self.stops = tokenizer, list(stops)
        self.ids: list[int] = []
        self.sent = 0  # characters given out so far
        self.stop_sequence: str | None = None

    def add(self, ids: Sequence[int], final: bool = False) -> str:
        self.ids += ids
        text = self.tokenizer.decode(self.ids)  # special tokens are skipped, as ChatFormat.decode_reply does
        if not final:
            text = text.rstrip("\ufffd")
        hits = [(i, s) for s in self.stops if (i := text.find(s, self.sent)) >= 0]
        if hits:
            end, self.stop_sequence = min(hits)
        else:
            end = len(text) if final else len(text) - self._could_become_stop(text)
        out = text[self.sent:end]
        self.sent = max(self.sent, end)
        return out

    def _could_become_stop(self, text: str) -> int:
        """Length of the longest end of text that is the start of a stop string."""
        return max((k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)


# --- one request in the engine -------------------------------------------------------------------------------------

@dataclass
class Finish:
    reason: str  # "stop" | "length"
    stop_sequence: str | None
    completion_tokens: int


class EventRelay:
    """Carries engine events from the engine thread to the requests' queues on the server's event loop.

    Waking a loop from another thread costs a socket write and a loop iteration, and an engine step emits one
    event per running request: so the relay wakes the loop once for all the events that arrived since it last
    ran, not once per token (measured: 5% of the engine thread's time at 16 streams went to those wake-ups)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}

    def put(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, event: Any) -> None:
        """From any thread; must not block (the engine thread calls it)."""
        with self._lock:
            pending = self._pending.setdefault(loop, [])
            pending.append((queue, event))
            if len(pending) > 1:  # a wake-up is scheduled already and will deliver this one too
                return
        try:
            loop.call_soon_threadsafe(self._deliver, loop)
        except RuntimeError:  # the loop is closed (server shutting down): nobody is listening
            with self._lock:
                self._pending.pop(loop, None)

    def _deliver(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            pending = self._pending.pop(loop, [])
        for queue, event in pending:
            queue.put_nowait(event)


class Submission:
    """A request submitted to the engine; its events arrive on an asyncio queue of the server's loop."""

    def __init__(self, engine: Engine, prompt_ids: list[int], params: SamplingParams, relay: EventRelay) -> None:
        self.engine, self.done = engine, False
        self.events: asyncio.Queue[tuple[list[int], str | None]] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def on_event(ids: list[int], finish: str | None) -> None:  # runs on the engine thread: must not block
            relay.put(loop, self.events, (list(ids), finish))

        if not engine.alive:
            raise ApiError(503, "the engine is not running (see /health)")
        try:
            self.req_id = engine.submit(prompt_ids, params, on_event)
        except QueueFull:
            raise ApiError(503, "too many requests are waiting; retry later") from None
        except RuntimeError:  # the loop died since the check above
            raise ApiError(503, "the engine is not running (see /health)") from None
        except ValueError as e:  # the prompt does not fit the context
            raise ApiError(400, str(e)) from None

    async def next_event(self) -> tuple[list[int], str | None]:
        # No timeout needed: the engine ends every request it accepted with a last event, "error" included
        # when its loop dies.
        return await self.events.get()

    def cancel(self) -> None:
        if not self.done:
            self.done = True
            self.engine.cancel(self.req_id)


async def run_generation(sub: Submission, text: TextStream, ttft: Histogram, started: float
                         ) -> AsyncIterator[str | Finish]:
    """Pieces of reply text as they become final, then one Finish. Cancels the engine request when it ends early
    (a stop string, an error, or the consumer went away)."""
    tokens, first = 0, True
    try:
        while True:
            ids, finish = await sub.next_event()
            if first and finish not in ("error", "cancelled"):  # a first token (an immediate stop token too)
                ttft.observe(time.perf_counter() - started)
                first = False
            tokens += len(ids)
            if finish is not None:
                sub.done = True
            if finish in ("error", "cancelled"):
                raise ApiError(500, f"generation failed in the engine ({finish})")
            piece = text.add(ids, final=finish is not None)
            if piece:
                yield piece
            if text.stop_sequence is not None:
                yield Finish("stop", text.stop_sequence, tokens)
                return
            if finish is not None:
                # The engine's stop token ends the reply without being passed on, but it was generated.
                yield Finish(finish, None, tokens + (finish == "stop"))
                return
    finally:
        sub.cancel()  # a no-op when the engine already finished it


class EventStream(StreamingResponse):
    """Server-sent events that cancel the engine request however the response ends, even when the client goes
    away before the first event (then the body generator never runs, so its own cleanup cannot)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def sse(data: dict | str, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(request: Request, events: AsyncIterator[str | Finish]) -> tuple[str, Finish]:
    """The whole reply of a non-streaming request; cancels it if the client disconnects first."""
    async def consume() -> tuple[str, Finish]:
        parts = []
        async for item in events:
            if isinstance(item, Finish):
                return "".join(parts), item
            parts.append(item)
        raise AssertionError("generation ended without a Finish")

    work = asyncio.ensure_future(consume())
    gone = asyncio.ensure_future(wait_for_disconnect(request))
    await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if not work.done():  # the client went away: cancelling the consumer runs run_generation's cleanup
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        raise ApiError(499, "client disconnected")
    return work.result()


# --- metrics -------------------------------------------------------------------------------------------------------

class EngineCollector:
    """Reads engine.stats() at every scrape (prometheus_client's custom-collector protocol)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        gauges = {"requests_running": ("running", "Requests in the running batch"),
                  "requests_waiting": ("waiting", "Requests waiting to be admitted"),
                  "kv_blocks_total": ("kv_blocks_total", "KV cache blocks in the pool"),
                  "kv_blocks_used": ("kv_blocks_used", "KV cache blocks held by requests"),
                  "kv_blocks_free": ("kv_blocks_free", "KV cache blocks free to allocate"),
                  "kv_cache_bytes": ("kv_bytes", "Memory of the preallocated KV block pool")}
        counters = {"prefix_cache_hits": ("prefix_cache_hits", "Prompt KV blocks found in the prefix cache"),
                    "prefix_cache_queries": ("prefix_cache_queries", "Prompt KV blocks looked up in the prefix cache"),
                    "prompt_tokens": ("prompt_tokens_total", "Prompt tokens submitted"),
                    "generation_tokens": ("generated_tokens_total", "Tokens generated"),
                    "requests_finished": ("requests_finished_total", "Requests the engine finished"),
                    "preemptions": ("preemptions_total", "Requests preempted for KV blocks (recomputed later)")}
        for name, (key, doc) in gauges.items():
            if key in s:
                yield GaugeMetricFamily(f"astrai_{name}", doc, value=s[key])
        for name, (key, doc) in counters.items():
            if key in s:
                yield CounterMetricFamily(f"astrai_{name}", doc, value=s[key])
        yield GaugeMetricFamily("astrai_engine_alive", "1 while the engine loop runs", value=int(self.engine.alive))
        yield GaugeMetricFamily("astrai_torch_threads", "torch intra-op threads of the engine",
                                value=torch.get_num_threads())


# --- the app -------------------------------------------------------------------------------------------------------

def create_app(engine: Engine, chat: ChatFormat, model_id: str, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, aliases: Sequence[str] = ()) -> FastAPI:
    """The server for one model. `engine` must be started by the caller (and stopped after the server). Requests
    may name it `model_id` or any of `aliases` (a registered model's name, NAME@ALIAS: ids a client keeps when the
    champion moves); responses name `model_id`."""
    served = (model_id, *[a for a in aliases if a != model_id])
    tokenizer = chat.tokenizer
    context = engine.context_length
    created = int(time.time())
    eos = (special_id(tokenizer, "eos"),)  # a plain-text completion ends at end-of-text
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    ttft = Histogram("astrai_time_to_first_token_seconds", "From a request's arrival to its first token",
                     registry=registry, buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))

    relay = EventRelay()
    app = FastAPI(title="astrai serve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(error_body(request.url.path, e.status, e.message, e.param), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:  # unknown route, 405
        return JSONResponse(error_body(request.url.path, e.status_code, str(e.detail)), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:  # a bug: the server stays up
        return JSONResponse(error_body(request.url.path, 500, f"internal error: {type(e).__name__}"), status_code=500)

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        bearer = request.headers.get("authorization", "")
        given = [bearer[7:].strip() if bearer[:7].lower() == "bearer " else "", request.headers.get("x-api-key", "")]
        if not any(hmac.compare_digest(g.encode(), api_key.encode()) for g in given if g):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')")

    async def parse(request: Request, model: type[Body]) -> Any:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_body_bytes:
            raise ApiError(413, f"request body of {declared} bytes is over the limit of {max_body_bytes}")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > max_body_bytes:
                raise ApiError(413, f"request body is over the limit of {max_body_bytes} bytes")
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as e:  # ValueError covers bad UTF-8 too
            raise ApiError(400, f"request body is not valid JSON ({str(e)[:200]})") from None
        if not isinstance(data, dict):
            raise ApiError(400, "request body must be a JSON object")
        if field := lone_surrogate(data):
            raise ApiError(400, f"{field}: not valid Unicode (a lone surrogate escape such as \\ud800)", param=field)
        try:
            body = model.model_validate(data)
        except ValidationError as e:
            field, message = validation_message(e)
            raise ApiError(400, message, param=field) from None
        if body.model not in served:
            raise ApiError(404, f"model {body.model!r} not found; this server serves {', '.join(served)}",
                           param="model")
        return body

    def submit(prompt_ids: list[int], body: Body, max_tokens: int | None, stops: list[str], stop_ids: tuple[int, ...],
               field: str) -> Submission:
        if len(prompt_ids) >= context:
            raise ApiError(400, f"prompt has {len(prompt_ids)} tokens; the context is {context} "
                                f"(prompt and reply must fit in it)", param=field)
        temperature = body.temperature if body.temperature >= GREEDY_BELOW else 0.0
        # A reply runs at most to the end of the context (the engine ends it there with "length").
        budget = context - len(prompt_ids)
        params = SamplingParams(max_tokens=min(max_tokens or budget, budget), temperature=temperature,
                                top_p=body.top_p, top_k=body.top_k, seed=body.seed,
                                stop_token_ids=stop_ids)
        return Submission(engine, prompt_ids, params, relay)

    # Tokenizing megabytes would stall every stream on this event loop for seconds, so a text that cannot fit the
    # context is refused before: no token covers more than this many bytes of text.
    max_token_bytes = max(len(t.encode()) for t in tokenizer.get_vocab())

    def check_length(texts: list[str], field: str) -> None:
        size = sum(len(t.encode()) for t in texts)
        if size > context * max_token_bytes:
            raise ApiError(400, f"prompt has more than {context} tokens ({size} bytes of text, at most "
                                f"{max_token_bytes} per token); the context is {context}", param=field)

    def chat_prompt(messages: list[dict], field: str) -> list[int]:
        check_length([m["content"] for m in messages], field)
        try:
            return chat.encode_prompt(messages)
        except AstraiError as e:
            raise ApiError(400, f"{field}: {e}", param=field) from None

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.alive:
            return JSONResponse({"status": "ok", "model": model_id})
        return JSONResponse({"status": "engine stopped", "model": model_id}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_PLAIN_0_0_4)

    cards = {name: {"id": name, "object": "model", "created": created, "owned_by": "astrai"} for name in served}

    @app.get("/v1/models", dependencies=[Depends(check_key)])
    async def list_models() -> dict:
        return {"object": "list", "data": list(cards.values())}

    @app.get("/v1/models/{name:path}", dependencies=[Depends(check_key)])
    async def get_model(name: str) -> dict:
        if name not in cards:
            raise ApiError(404, f"model {name!r} not found; this server serves {', '.join(served)}", param="model")
        return cards[name]

    def openai_usage(prompt_tokens: int, finish: Finish) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": finish.completion_tokens,
                "total_tokens": prompt_tokens + finish.completion_tokens}

    async def openai_response(request: Request, body: OpenAIBody, prompt_ids: list[int], sub: Submission,
                              text: TextStream, started: float, kind: Literal["chat", "text"]):
        """The OpenAI reply for chat (kind "chat") or plain completions (kind "text"), whole or streamed."""
        prefix, obj = ("chatcmpl", "chat.completion") if kind == "chat" else ("cmpl", "text_completion")
        rid, now = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "created": now, "model": model_id}
        events = run_generation(sub, text, ttft, started)

        def choice(content: str | None, finish: str | None, first: bool = False) -> dict:
            if kind == "text":
                return {"index": 0, "text": content or "", "logprobs": None, "finish_reason": finish}
            delta = ({"role": "assistant", "content": content} if first else
                     {"content": content} if content is not None else {})
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

        if not body.stream:
            reply, finish = await collect(request, events)
            message = ({"message": {"role": "assistant", "content": reply}} if kind == "chat" else
                       {"text": reply})
            return {**head, "object": obj, "choices": [{"index": 0, **message, "logprobs": None,
                                                        "finish_reason": finish.reason}],
                    "usage": openai_usage(len(prompt_ids), finish)}

        usage = body.stream_options is not None and body.stream_options.include_usage
        chunk_obj = f"{obj}.chunk" if kind == "chat" else obj

        def chunk(choices: list[dict], **extra) -> str:
            return sse({**head, "object": chunk_obj, "choices": choices, **({"usage": None} if usage else {}),
                        **extra})

        async def stream() -> AsyncIterator[str]:
            try:
                if kind == "chat":
                    yield chunk([choice("", None, first=True)])
                async for item in events:
                    if isinstance(item, Finish):
                        yield chunk([choice(None, item.reason)])
                        if usage:
                            yield chunk([], usage=openai_usage(len(prompt_ids), item))
                    else:
                        yield chunk([choice(item, None)])
            except ApiError as e:
                yield sse(error_body(request.url.path, e.status, e.message))
            yield sse("[DONE]")

        return EventStream(stream(), sub.cancel)

    @app.post("/v1/chat/completions", dependencies=[Depends(check_key)])
    async def chat_completions(request: Request):
        started = time.perf_counter()
        body: ChatBody = await parse(request, ChatBody)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.content}
                    for m in body.messages]
        prompt_ids = chat_prompt(messages, "messages")
        sub = submit(prompt_ids, body, body.max_completion_tokens or body.max_tokens, body.stop, chat.stop_ids,
                     "messages")
        return await openai_response(request, body, prompt_ids, sub, TextStream(tokenizer, body.stop), started, "chat")

    @app.post("/v1/completions", dependencies=[Depends(check_key)])
    async def completions(request: Request):
        started = time.perf_counter()
        body: CompletionBody = await parse(request, CompletionBody)
        if isinstance(body.prompt, str):
            check_length([body.prompt], "prompt")
            prompt_ids = tokenizer.encode(body.prompt, add_special_tokens=False).ids
        else:
            prompt_ids = list(body.prompt)
            if not all(0 <= i < tokenizer.get_vocab_size() for i in prompt_ids):
                raise ApiError(400, f"prompt: token ids must be in [0, {tokenizer.get_vocab_size()})", param="prompt")
        # OpenAI's default for the legacy completions endpoint is 16 tokens.
        sub = submit(prompt_ids, body, body.max_tokens or 16, body.stop, eos, "prompt")
        return await openai_response(request, body, prompt_ids, sub, TextStream(tokenizer, body.stop), started, "text")

    @app.post("/v1/messages", dependencies=[Depends(check_key)])
    async def messages(request: Request):
        started = time.perf_counter()
        body: MessagesBody = await parse(request, MessagesBody)
        turns = [{"role": m.role, "content": m.content} for m in body.messages]
        system = [{"role": "system", "content": body.system}] if body.system else []
        if turns[-1]["role"] == "assistant":  # a prefilled reply: the model continues the assistant's text
            check_length([m["content"] for m in system + turns], "messages")
            prompt_ids = (chat_prompt(system + turns[:-1], "messages")
                          + tokenizer.encode(turns[-1]["content"], add_special_tokens=False).ids)
        else:
            prompt_ids = chat_prompt(system + turns, "messages")
        sub = submit(prompt_ids, body, body.max_tokens, body.stop_sequences, chat.stop_ids, "messages")
        text = TextStream(tokenizer, body.stop_sequences)
        events = run_generation(sub, text, ttft, started)
        mid = f"msg_{uuid.uuid4().hex}"
        reasons = {"stop": "end_turn", "length": "max_tokens"}

        def stop_reason(finish: Finish) -> str:
            return "stop_sequence" if finish.stop_sequence is not None else reasons[finish.reason]

        message = {"id": mid, "type": "message", "role": "assistant", "model": model_id}
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

    return app
