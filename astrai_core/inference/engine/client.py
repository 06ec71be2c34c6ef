"""EngineClient: the engine's interface, exactly what a server may use (serving/ is typed with it). Engine (the loop
in a thread of this process) and EngineProcess (the same over an Engine in a child process) both implement it;
vLLM's HTTP layer stands on its EngineClient in the same way.

    engine: EngineClient = EngineProcess(checkpoint, config)   # or Engine(model, config)
    engine.after_step.append(flush); engine.start()
    req_id = engine.submit(prompt_ids, params, on_event)       # on_event(new_ids, finish) on the engine's thread
    # with SamplingParams(logprobs=k) or (prompt_logprobs=k): on_event(new_ids, finish, logprobs) (sequence.OnEvent)
    engine.cancel(req_id); engine.stats(); engine.alive; engine.stop()
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

from astrai_core.inference.engine.engine import EngineConfig
from astrai_core.inference.engine.sequence import OnEvent, SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    config: EngineConfig
    context_length: int  # tokens a prompt and its reply share
    vocab_size: int
    # Called after each engine step (and once after the loop died), on the engine's (or the reader's) thread.
    after_step: list[Callable[[], None]]
    alive: bool  # False once the loop (or the child process) has died; it never comes back
    error: BaseException | None  # why it died

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_event: OnEvent) -> int:
        """Queue a request -> its id. ValueError: a prompt the engine cannot run; QueueFull: too many wait;
        RuntimeError: the engine has died. Every accepted request gets a last event with a finish reason."""

    def cancel(self, req_id: int) -> None:
        """End the request with "cancelled" at the next step (nothing if it has finished)."""

    def stats(self) -> dict:
        """Gauges and counters (Engine.stats' keys)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...
