"""The engine in a process of its own, behind Engine's interface (what `astrai serve` runs by default).

    engine = EngineProcess(checkpoint, EngineConfig(), device="cpu", threads=1)   # loads the model in the child
    engine.start(); req_id = engine.submit(prompt_ids, params, on_event); ...; engine.stop()

Why a process: in one process the engine thread and the HTTP event loop share the GIL, and torch releases and
retakes it around every operator, so the two take turns: at 16 streams the whole server used 0.87 of a core on
2 cores (py-spy and /proc, bench/serving.py's profile in README.md) while the engine alone runs 1.6x faster.

The parent keeps what must answer at once: the prompt checks (ValueError), the queue bound (QueueFull), liveness
and the last stats. Commands go down one pipe (Submit, Cancel, Stop); each engine step's events come up another
as one Step message with the engine's stats, and a reader thread here hands them to the requests' on_event
callbacks, then calls after_step (as Engine's loop does). If the child dies, every open request gets a last
"error" event and alive turns False, as with a dying Engine thread.

The queue bound is EngineConfig.check_waiting, as in Engine, applied to what the child last reported waiting plus
the submissions it had not received yet when it reported (each Step says how many it has received).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from astrai_core.inference.engine.engine import Engine, EngineConfig, QueueFull, check_prompt, run_listeners
from astrai_core.inference.engine.sequence import OnEvent, SamplingParams

log = logging.getLogger(__name__)

STATS_EVERY = 0.05  # seconds: the child sends its stats with a step's events at most this often (and when idle)


# --- the messages over the pipes ----------------------------------------------------------------------------------
# Down (parent -> child):

class Submit(NamedTuple):
    rid: int  # the parent's request id (0, 1, 2, ... in the order sent)
    prompt_ids: list[int]
    params: SamplingParams


class Cancel(NamedTuple):
    rid: int


class Stop(NamedTuple):
    pass


# Up (child -> parent): Ready or Failed once, then one Step per engine step with events (or per STATS_EVERY).

class Ready(NamedTuple):
    context_length: int
    vocab_size: int
    stats: dict


class Failed(NamedTuple):
    message: str  # why the model or the engine could not load


class Event(NamedTuple):
    rid: int
    tokens: list[int]
    finish: str | None
    logprobs: list | None = None  # list[TokenLogprob | None], for a request that asked for logprobs (OnEvent)


class Step(NamedTuple):
    events: list[Event]
    stats: dict  # Engine.stats() after the step, less ttft_seconds
    alive: bool
    received: int  # Submit messages the child had received when it took the stats


def _child(commands, events, checkpoint: str, config: EngineConfig, device: str, threads: int,
           dtype: torch.dtype) -> None:
    """The engine's process: load the model, run Engine's loop on this (the main) thread, the thread that loaded
    it (Engine.run says why), and obey commands on a thread of their own until Stop or the parent goes away (EOF
    on the command pipe)."""
    # Ctrl-C, `kill -- -PGID` and systemd's stop reach the whole group: the parent stops this process (Stop), and
    # a parent that is gone ends it too (EOF on the pipe); SIGKILL still works.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from astrai_core.checkpoint.model_dir import load_model

    torch.set_num_threads(threads)
    try:
        model, _, _ = load_model(Path(checkpoint), device=device, dtype=dtype)
        # The parent bounds the queue (it sees submissions first, and counts those still in the pipe): the child's
        # own bound, counting at other moments, would refuse some the parent accepted.
        engine = Engine(model, dataclasses.replace(config, max_waiting=sys.maxsize))
    except Exception as e:  # noqa: BLE001 - the parent reports it and exits
        events.send(Failed(str(e) or type(e).__name__))
        return
    lock, batch, last_stats = threading.Lock(), [], 0.0
    ids: dict[int, int] = {}  # parent's request id -> engine's
    received = 0  # Submit messages taken in (the engine counts them as waiting from then on)

    def flush() -> None:  # Engine.after_step, on the engine thread: this step's events in one message
        nonlocal batch, last_stats
        now = time.monotonic()
        with lock:
            out, batch = batch, []
        if out or now - last_stats >= STATS_EVERY:
            counted = received  # read before the stats: a submission in between is counted twice, never missed
            stats = engine.stats()
            del stats["ttft_seconds"]  # up to TTFT_KEPT floats per message; the server keeps its own histogram
            last_stats = now
            events.send(Step(out, stats, engine.alive, counted))

    def on_event_for(rid: int) -> OnEvent:
        def on_event(tokens: list[int], finish: str | None, logprobs: list | None = None) -> None:
            with lock:
                batch.append(Event(rid, tokens, finish, logprobs))
        return on_event

    def obey() -> None:  # the commands' thread: pure Python, no torch work
        nonlocal received
        try:
            while True:
                command = commands.recv()
                if isinstance(command, Submit):
                    try:
                        ids[command.rid] = engine.submit(command.prompt_ids, command.params,
                                                         on_event_for(command.rid))
                    except (ValueError, QueueFull, RuntimeError):  # checked in the parent; a dead loop lands here
                        on_event_for(command.rid)([], "error")
                    received += 1
                elif isinstance(command, Cancel):
                    if command.rid in ids:
                        engine.cancel(ids.pop(command.rid))
                else:
                    assert isinstance(command, Stop), command
                    break
        except (EOFError, OSError):  # the parent is gone
            pass
        finally:
            engine.stop()

    engine.after_step.append(flush)
    events.send(Ready(engine.context_length, engine.vocab_size, engine.stats()))
    obeying = threading.Thread(target=obey, name="astrai-commands", daemon=True)
    obeying.start()
    engine.run()
    obeying.join()  # a loop that died returns early: its requests are told "error" until Stop


class EngineProcess:
    """EngineClient (astrai_core/inference/engine/client.py) over an Engine running in a child process."""

    def __init__(self, checkpoint: Path, config: EngineConfig | None = None, device: str = "cpu",
                 threads: int = 1, dtype: torch.dtype = torch.float32) -> None:
        self.config = config or EngineConfig()
        ctx = mp.get_context("spawn")  # not fork: this process may already run threads (torch's, the server's)
        child_commands, self._commands = ctx.Pipe(duplex=False)  # (reading end, writing end)
        self._events, child_events = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child, name="astrai-engine", daemon=True,
                                 args=(child_commands, child_events, str(checkpoint), self.config, device, threads,
                                       dtype))
        self._proc.start()
        child_commands.close()
        child_events.close()
        first = self._events.recv() if self._events.poll(600) else Failed("did not start in 10 minutes")
        if not isinstance(first, Ready):
            self._proc.join(5)
            raise ValueError(first.message)
        self.context_length, self.vocab_size = first.context_length, first.vocab_size
        self._stats, self._received = first.stats, 0  # the child's last report
        self.after_step: list[Callable[[], None]] = []
        self.alive, self.error = True, None
        self._lock = threading.Lock()  # the command pipe and the callbacks, shared by the server's threads
        self._callbacks: dict[int, OnEvent] = {}
        self._with_logprobs: set[int] = set()  # open requests that asked for logprobs
        self._sent = 0  # Submit messages sent; also the next request's id
        self._reader: threading.Thread | None = None

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_event: OnEvent) -> int:
        check_prompt(prompt_ids, self.context_length, self.vocab_size)
        with self._lock:
            if not self.alive:
                raise RuntimeError(f"the engine process has stopped: {self.error}")
            self.config.check_waiting(self._stats["waiting"] + self._sent - self._received)
            rid, self._sent = self._sent, self._sent + 1
            self._callbacks[rid] = on_event
            if params.logprobs is not None or params.prompt_logprobs is not None:
                self._with_logprobs.add(rid)  # its events carry logprobs, its "error" end an empty list
            self._commands.send(Submit(rid, list(prompt_ids), params))
        return rid

    def cancel(self, req_id: int) -> None:
        with self._lock:
            if self.alive and req_id in self._callbacks:
                self._commands.send(Cancel(req_id))

    def stats(self) -> dict:
        return dict(self._stats)

    def start(self) -> None:
        assert self._reader is None, "the engine is started already"
        self._reader = threading.Thread(target=self._read, name="astrai-engine-events", daemon=True)
        self._reader.start()

    def stop(self) -> None:
        with self._lock:
            try:
                self._commands.send(Stop())
            except OSError:  # the child is gone already
                pass
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        if self._reader is not None:
            self._reader.join(10)
            self._reader = None

    def _read(self) -> None:
        """The reader thread: each message is one engine step's events, then after_step; EOF means the child is
        gone, which ends every open request with "error"."""
        try:
            while True:
                step: Step = self._events.recv()
                with self._lock:  # submit reads both
                    self._stats, self._received = step.stats, step.received
                for event in step.events:
                    self._deliver(event.rid, event.tokens, event.finish, event.logprobs)
                if not step.alive:
                    self.error = RuntimeError("the engine loop died in the engine process (see its log)")
                    raise EOFError("the engine loop died")
                self._after_step()
        except (EOFError, OSError) as e:
            if self.error is None:  # the child is gone: its pipe closes as it dies, its exit code comes just after
                self._proc.join(1)
                self.error = RuntimeError(f"the engine process ended ({e!r}, exit code {self._proc.exitcode})")
            with self._lock:
                self.alive = False
                open_requests = list(self._callbacks)
            for rid in open_requests:
                self._deliver(rid, [], "error")
            self._after_step()

    def _deliver(self, rid: int, tokens: list[int], finish: str | None, logprobs: list | None = None) -> None:
        with self._lock:
            on_event = self._callbacks.get(rid) if finish is None else self._callbacks.pop(rid, None)
            with_logprobs = rid in self._with_logprobs  # then always three arguments, as Engine sends them
            if finish is not None:
                self._with_logprobs.discard(rid)
        if on_event is None:
            return
        try:
            on_event(tokens, finish, logprobs or []) if with_logprobs else on_event(tokens, finish)
        except Exception:  # noqa: BLE001 - its client is gone: cancel its own request only
            log.exception("on_event of request %d raised", rid)
            if finish is None:
                self.cancel(rid)

    def _after_step(self) -> None:
        run_listeners(self.after_step)
