"""The engine in a process of its own, behind Engine's interface (what `astrai serve` runs by default).

    engine = EngineProcess(checkpoint, EngineConfig(), device="cpu", threads=1)   # loads the model in the child
    engine.start(); req_id = engine.submit(prompt_ids, params, on_event); ...; engine.stop()

Why a process: in one process the engine thread and the HTTP event loop share the GIL, and torch releases and
retakes it around every operator, so the two take turns: at 16 streams the whole server used 0.87 of a core on
2 cores (py-spy and /proc, bench/serving.py's profile in README.md) while the engine alone runs 1.6x faster.

The parent keeps what must answer at once: the prompt checks (ValueError), the queue bound (QueueFull), liveness
and the last stats. Commands go down one pipe (submit, cancel, stop); each engine step's events come up another
as one message with the engine's stats, and a reader thread here hands them to the requests' on_event callbacks,
then calls after_step (as Engine's loop does). If the child dies, every open request gets a last "error" event
and alive turns False, as with a dying Engine thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing as mp
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from astrai_core.engine.engine import Engine, EngineConfig, QueueFull, check_prompt, run_listeners
from astrai_core.engine.sequence import OnEvent, SamplingParams

log = logging.getLogger(__name__)

STATS_EVERY = 0.05  # seconds: the child sends its stats with a step's events at most this often (and when idle)


def _child(commands, events, checkpoint: str, config: EngineConfig, device: str, threads: int) -> None:
    """The engine's process: load the model, run Engine's loop thread, obey commands until "stop" or the parent
    goes away (EOF on the command pipe)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent stops this process
    import torch

    from astrai_core.checkpoint import load_model

    torch.set_num_threads(threads)
    try:
        model, _, _ = load_model(Path(checkpoint), device=device)
        # The parent bounds the queue (it sees submissions first, and counts those still in the pipe): the child's
        # own bound, counting at other moments, would refuse some the parent accepted.
        engine = Engine(model, dataclasses.replace(config, max_waiting=sys.maxsize))
    except Exception as e:  # noqa: BLE001 - the parent reports it and exits
        events.send(("failed", str(e) or type(e).__name__))
        return
    lock, batch, last_stats = threading.Lock(), [], 0.0
    ids: dict[int, int] = {}  # parent's request id -> engine's

    def flush() -> None:  # Engine.after_step, on the engine thread: this step's events in one message
        nonlocal batch, last_stats
        now = time.monotonic()
        with lock:
            out, batch = batch, []
        if out or now - last_stats >= STATS_EVERY:
            stats = engine.stats()
            del stats["ttft_seconds"]  # up to TTFT_KEPT floats per message; the server keeps its own histogram
            last_stats = now
            events.send(("events", out, stats, engine.alive))

    def on_event_for(rid: int) -> OnEvent:
        def on_event(tokens: list[int], finish: str | None) -> None:
            with lock:
                batch.append((rid, tokens, finish))
        return on_event

    engine.after_step.append(flush)
    events.send(("ready", engine.context_length, engine.vocab_size, engine.stats()))
    engine.start()
    try:
        while True:
            command = commands.recv()
            if command[0] == "submit":
                _, rid, prompt_ids, params = command
                try:
                    ids[rid] = engine.submit(prompt_ids, params, on_event_for(rid))
                except (ValueError, QueueFull, RuntimeError):  # checked in the parent; a dead loop lands here
                    on_event_for(rid)([], "error")
            elif command[0] == "cancel":
                if command[1] in ids:
                    engine.cancel(ids.pop(command[1]))
            else:  # "stop"
                break
    except (EOFError, OSError):  # the parent is gone
        pass
    finally:
        engine.stop()


class EngineProcess:
    """Engine's interface (submit, cancel, stats, alive, after_step, start, stop, context_length, vocab_size,
    config) over an Engine running in a child process."""

    def __init__(self, checkpoint: Path, config: EngineConfig | None = None, device: str = "cpu",
                 threads: int = 1) -> None:
        self.config = config or EngineConfig()
        ctx = mp.get_context("spawn")  # not fork: this process may already run threads (torch's, the server's)
        child_commands, self._commands = ctx.Pipe(duplex=False)  # (reading end, writing end)
        self._events, child_events = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child, name="astrai-engine", daemon=True,
                                 args=(child_commands, child_events, str(checkpoint), self.config, device, threads))
        self._proc.start()
        child_commands.close()
        child_events.close()
        first = self._events.recv() if self._events.poll(600) else ("failed", "did not start in 10 minutes")
        if first[0] != "ready":
            self._proc.join(5)
            raise ValueError(first[1])
        _, self.context_length, self.vocab_size, self._stats = first
        self.after_step: list[Callable[[], None]] = []
        self.alive, self.error = True, None
        self._lock = threading.Lock()  # the command pipe and the callbacks, shared by the server's threads
        self._callbacks: dict[int, OnEvent] = {}
        self._ids = itertools.count()
        self._reader: threading.Thread | None = None

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_event: OnEvent) -> int:
        check_prompt(prompt_ids, self.context_length, self.vocab_size)
        with self._lock:
            if not self.alive:
                raise RuntimeError(f"the engine process has stopped: {self.error}")
            if len(self._callbacks) - self.config.max_batch_size >= self.config.max_waiting:
                raise QueueFull(f"{self.config.max_waiting} requests are waiting already")
            rid = next(self._ids)
            self._callbacks[rid] = on_event
            self._commands.send(("submit", rid, list(prompt_ids), params))
        return rid

    def cancel(self, req_id: int) -> None:
        with self._lock:
            if self.alive and req_id in self._callbacks:
                self._commands.send(("cancel", req_id))

    def stats(self) -> dict:
        return dict(self._stats)

    def start(self) -> None:
        assert self._reader is None, "the engine is started already"
        self._reader = threading.Thread(target=self._read, name="astrai-engine-events", daemon=True)
        self._reader.start()

    def stop(self) -> None:
        with self._lock:
            try:
                self._commands.send(("stop",))
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
                _, events, self._stats, alive = self._events.recv()
                for rid, tokens, finish in events:
                    self._deliver(rid, tokens, finish)
                if not alive:
                    raise EOFError("the engine loop died")
                self._after_step()
        except (EOFError, OSError) as e:
            with self._lock:
                self.alive = False
                self.error = self.error or f"{e!r} (exit code {self._proc.exitcode})"
                open_requests = list(self._callbacks)
            for rid in open_requests:
                self._deliver(rid, [], "error")
            self._after_step()

    def _deliver(self, rid: int, tokens: list[int], finish: str | None) -> None:
        with self._lock:
            on_event = self._callbacks.get(rid) if finish is None else self._callbacks.pop(rid, None)
        if on_event is None:
            return
        try:
            on_event(tokens, finish)
        except Exception:  # noqa: BLE001 - its client is gone: cancel its own request only
            log.exception("on_event of request %d raised", rid)
            if finish is None:
                self.cancel(rid)

    def _after_step(self) -> None:
        run_listeners(self.after_step)
