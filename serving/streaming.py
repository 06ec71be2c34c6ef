"""One request's way from the engine to the client.

    sub = Submission(engine, prompt_ids, params, relay)      # submitted; events arrive on this event loop
    events = run_generation(sub, TextStream(tok, stops), ttft, started)    # text pieces, then one Finish
    EventStream(sse(...) for each piece, on_close=sub.cancel) # streamed: server-sent events
    reply, finish = await collect(request, events)            # or whole

However it ends (finished, a stop string, an error, the client gone), the engine request is cancelled if it still
runs, which frees its batch slot and KV blocks at the engine's next step.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse
from prometheus_client import Histogram

from astrai_core.inference.engine import EngineClient, QueueFull, SamplingParams, TokenLogprob
from serving.errors import ApiError
from serving.text_stream import TextStream


@dataclass
class Finish:
    reason: str  # "stop" | "length"
    stop_sequence: str | None
    completion_tokens: int


class EventRelay:
    """Carries engine events from the engine thread to the requests' queues on the server's event loop.

    Waking a loop from another thread costs a socket write, the GIL and a loop iteration, and an engine step emits
    one event per running request: so put() only collects, and flush() (the engine's after_step listener) wakes
    each loop once for the whole step's events (py-spy at 16 streams: the wake-ups took 11% of the engine thread
    when the loop, draining faster than the engine emits, was woken for nearly every event)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}

    def put(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, event: Any) -> None:
        """From any thread; must not block (the engine thread calls it). Delivered at the next flush()."""
        with self._lock:
            self._pending.setdefault(loop, []).append((queue, event))

    def flush(self) -> None:
        """Wake every loop with pending events once."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for loop, events in pending.items():
            try:
                loop.call_soon_threadsafe(self._deliver, events)
            except RuntimeError:  # the loop is closed (server shutting down): nobody is listening
                pass

    @staticmethod
    def _deliver(events: list[tuple[asyncio.Queue, Any]]) -> None:
        for queue, event in events:
            queue.put_nowait(event)


class Submission:
    """A request submitted to the engine; its events arrive on an asyncio queue of the server's loop."""

    def __init__(self, engine: EngineClient, prompt_ids: list[int], params: SamplingParams, relay: EventRelay) -> None:
        self.engine, self.done = engine, False
        self.events: asyncio.Queue[tuple[list[int], str | None, list]] = asyncio.Queue()
        # With params.logprobs or prompt_logprobs: the entries of the events taken so far (sequence.OnEvent)
        self.logprobs: list[TokenLogprob | None] = []
        loop = asyncio.get_running_loop()

        def on_event(ids: list[int], finish: str | None, logprobs: list = ()) -> None:  # on the engine thread
            relay.put(loop, self.events, (list(ids), finish, logprobs))  # must not block

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
        ids, finish, logprobs = await self.events.get()
        self.logprobs += logprobs
        return ids, finish

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
    return (await collect_all(request, [events]))[0]


async def collect_all(request: Request, replies: list[AsyncIterator[str | Finish]]) -> list[tuple[str, Finish]]:
    """The whole replies of several generations of one request (several prompts), running at once; all are
    cancelled if the client disconnects first or one of them fails."""
    async def consume(events: AsyncIterator[str | Finish]) -> tuple[str, Finish]:
        parts = []
        async for item in events:
            if isinstance(item, Finish):
                return "".join(parts), item
            parts.append(item)
        raise AssertionError("generation ended without a Finish")

    async def consume_all() -> list[tuple[str, Finish]]:
        tasks = [asyncio.ensure_future(consume(events)) for events in replies]
        try:
            return list(await asyncio.gather(*tasks))
        finally:  # one failed (or all are cancelled): the others stop too, which cancels their engine requests
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    work = asyncio.ensure_future(consume_all())
    gone = asyncio.ensure_future(wait_for_disconnect(request))
    await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if not work.done():  # the client went away: cancelling the consumers runs run_generation's cleanup
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        raise ApiError(499, "client disconnected")
    return work.result()
