"""Progress of a stage's long work: counts, time so far and an ETA, one line at least every `every` seconds
(ASTRAI_PROGRESS_SECONDS, default 10), printed by a thread, so a stage that works for minutes is never silent.

The stage opens one Progress; the loops doing the work, wherever they are (scoring, the reference cache, the
tokenizer's reader), say what they count and how far they are with `expect` and `advance`, which do nothing when no
Progress is open in the process:

    with Progress("dpo_reference"):          # dpo_reference: 320/1,500 prompts (21%), 12s so far, eta 44s
        for batch in batches:                # (in a loop anywhere below)
            expect(len(records), "prompts")  # once, before the loop
            ...
            advance(len(batch))
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable


EVERY_ENV = "ASTRAI_PROGRESS_SECONDS"
DEFAULT_EVERY = 10.0  # seconds between two lines, at most: well inside "never silent for 15 s"

_open: list["Progress"] = []  # the Progress objects open in this process, innermost last


def expect(total: int | None, unit: str) -> None:
    """The innermost open Progress now counts `unit`, `total` of them (None: unknown), from zero."""
    if _open:
        _open[-1].expect(total, unit)


def advance(n: int = 1) -> None:
    """`n` more of what the innermost open Progress counts are done."""
    if _open:
        _open[-1].advance(n)


class Progress:
    """A line `LABEL: DONE/TOTAL UNIT (P%), Ns so far, eta Ms` whenever `every` seconds have passed since the last
    one, at an `advance` or from a thread while the work is inside one long step (before `expect`:
    `LABEL: working, Ns so far`). `every`: None reads ASTRAI_PROGRESS_SECONDS; 0: a line at every advance."""

    def __init__(self, label: str, every: float | None = None, out: Callable[[str], None] | None = None) -> None:
        self.label = label
        self.every = float(os.environ.get(EVERY_ENV, DEFAULT_EVERY)) if every is None else every
        self.out = out or (lambda line: print(line, flush=True))
        self.total: int | None = None
        self.unit = ""
        self.done = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def expect(self, total: int | None, unit: str) -> None:
        self.total, self.unit, self.done, self.since = total, unit, 0, time.monotonic()

    def advance(self, n: int = 1) -> None:
        self.done += n
        self._maybe_say()

    def line(self) -> str:
        now = time.monotonic()
        so_far = f"{now - self.start:.0f}s so far"
        if not self.unit:
            return f"{self.label}: working, {so_far}"
        if self.total is None:
            return f"{self.label}: {self.done:,} {self.unit}, {so_far}"
        left = eta(self.total - self.done, self.done, now - self.since) if self.done else "unknown"
        return (f"{self.label}: {self.done:,}/{self.total:,} {self.unit} ({self.done / max(self.total, 1):.0%}), "
                f"{so_far}, eta {left}")

    def _maybe_say(self) -> None:
        with self._lock:  # the thread and the loop: one line per interval
            if time.monotonic() - self.said >= self.every and _open and _open[-1] is self:
                self.said = time.monotonic()  # an inner Progress speaks for itself
                self.out(self.line())

    def __enter__(self) -> "Progress":
        self.start = self.since = self.said = time.monotonic()
        _open.append(self)
        self._thread = None
        if self.every > 0:
            self._thread = threading.Thread(target=self._tick, name=f"progress {self.label}", daemon=True)
            self._thread.start()
        return self

    def _tick(self) -> None:
        while not self._stop.wait(max(self.said + self.every - time.monotonic(), 0.01)):  # till the next line is due
            self._maybe_say()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        _open.remove(self)


# ---- durations as text: this line's, the training progress bar's (training/callbacks.py), the flow's -------------

def eta(steps_left: int, steps_done: int, seconds: float) -> str:
    """Time left at the measured rate, as 1h02m, 3m05s or 42s."""
    return duration(steps_left * seconds / max(steps_done, 1))


def duration(seconds: float) -> str:
    """1h02m, 3m05s or 42s."""
    hours, rest = divmod(round(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
