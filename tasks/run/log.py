"""Where a run's whole output goes, and what of it the console shows.

Every entry point keeps one promise: a failure ends with one line, `astrai: error: <file>[:<line>]: <what>`, that
names the log file holding the rest: every line a stage printed, Python tracebacks, torchrun's failure report
("ChildFailedError ... Failures: ..."). The console shows a stage's progress as it runs, but not those dumps
(ConsoleFilter). Logs are written under .astrai/logs/ in the project (git-ignored).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Iterator, TextIO

LOG_DIR = Path(".astrai") / "logs"
# Set by the flow for the stages it runs: their output reaches the flow's log file (which it names), so a stage
# run by the flow neither filters its output nor writes a log of its own.
RUN_LOG_ENV = "ASTRAI_RUN_LOG"

# A line that says what failed: a stage's (`astrai: error: ...`) or a training rank's (`error: ...`, torchrun may
# prefix it with "[rank]:"). It ends a dump and is always shown.
_ERROR_LINE = re.compile(r"^(\[[^\]]*\]:)?(astrai: )?error: ")
# torchrun's failure report opens with a rule of '=' (it follows the ChildFailedError traceback).
_REPORT_RULE = re.compile(r"^={20,}$")


def log_file(root: Path, name: str) -> Path:
    """.astrai/logs/NAME.log under `root` (the folder made if needed)."""
    path = root / LOG_DIR / f"{name}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def shown(path: Path) -> str:
    """`path` as the error line names it: relative to the working directory when it is under it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


class ConsoleFilter:
    """Called with each output line of a process, says whether the console shows it: every line but a Python
    traceback (from "Traceback (most recent call last):" to the next error line, the multi-line message of the
    exception included) and torchrun's failure report. The log file keeps them all."""

    def __init__(self) -> None:
        self.hiding = False

    def __call__(self, line: str) -> bool:
        if _ERROR_LINE.match(line):
            self.hiding = False
            return True
        if "Traceback (most recent call last):" in line or _REPORT_RULE.match(line.strip()):
            self.hiding = True
        return not self.hiding


def crash_line(exc: BaseException, log: Path) -> str:
    """An unexpected exception (a bug, not bad input) as the one line: `<file>:<line>: <Type>: <message> (traceback:
    LOG)`, the innermost frame's place; its traceback is appended to `log`."""
    with log.open("a") as f:
        f.write("".join(traceback.format_exception(exc)))
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{shown(Path(frames[-1].filename))}:{frames[-1].lineno}: " if frames else ""
    message = (str(exc).strip().splitlines() or [""])[0]
    return f"{where}{type(exc).__name__}{': ' + message if message else ''} (traceback: {shown(log)})"


class _Tee(io.TextIOBase):
    """A stdout that writes every line to the log and the lines ConsoleFilter lets through to the console."""

    def __init__(self, console: TextIO, log: TextIO) -> None:
        self.console, self.log, self.keep, self.pending = console, log, ConsoleFilter(), ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            self.log.write(line + "\n")
            if self.keep(line):
                self.console.write(line + "\n")
        self.log.flush()
        self.console.flush()
        return len(text)

    def flush(self) -> None:
        self.log.flush()
        self.console.flush()


@contextlib.contextmanager
def command_log(root: Path, name: str) -> Iterator[Path | None]:
    """For `astrai stage NAME` / `astrai train` run by hand (or by `dvc repro`): what they print goes whole to
    .astrai/logs/NAME-<time>.log, and to the console without tracebacks and torchrun's failure report; yields the log
    to name in the error line. Under the flow (RUN_LOG_ENV set) output passes as it is and this yields None."""
    if os.environ.get(RUN_LOG_ENV):
        yield None
        return
    path = log_file(root, f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    console = sys.stdout
    with path.open("a") as log:
        sys.stdout = _Tee(console, log)
        try:
            yield path
        finally:
            if sys.stdout.pending:
                sys.stdout.write("\n")
            sys.stdout = console
