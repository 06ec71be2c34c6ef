"""Run a child process in its own process group, stream its output line by line, never leave it orphaned."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import threading
from typing import Callable, Mapping, Sequence


# The file where a run notes what it started (tasks/run/lock.py sets it): a run killed outright cannot stop its
# children, so the next run in the checkout reads this and stops them.
RECORD_ENV = "ASTRAI_RUN_RECORD"


def record(entry: dict) -> None:
    """Append `entry` (one JSON line) to the run's record, if this process belongs to a run that keeps one."""
    path = os.environ.get(RECORD_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


def start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat), or None if it does not exist: with the
    pid, it names one process, not whichever later reuses its number."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def kill_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the child's whole process group (torchrun and every rank), then SIGKILL after `grace` s."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def stream_process(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    on_line: Callable[[str], None] = print,
    what: str | None = None,
) -> None:
    """Run `cmd`, passing each output line (stdout and stderr merged) to `on_line`.

    The child starts a new session so that on any exception here (failure, Ctrl-C, a Prefect cancellation or
    timeout raised into this thread) the whole group is killed, grandchildren included. A non-zero exit raises
    RuntimeError with the exit code and the last lines of output.
    """
    proc = subprocess.Popen(
        list(cmd),
        env=dict(env) if env is not None else None,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        bufsize=1,
        start_new_session=True,
    )
    record({"pid": proc.pid, "start": start_ticks(proc.pid), "group": True, "what": what or os.path.basename(cmd[0])})
    tail: collections.deque[str] = collections.deque(maxlen=20)
    # SIGTERM to this process (a Prefect worker cancelling the flow run, `kill`, a batch scheduler) must not
    # orphan the child's group: kill the group first, then do what this process would have done anyway.
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum, frame):
            kill_group(proc)
            if callable(previous):
                previous(signum, frame)
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, on_sigterm)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            on_line(line)
        code = proc.wait()
    except BaseException:
        kill_group(proc)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if code != 0:
        name = what or os.path.basename(cmd[0])
        last = " | ".join(tail)[-2000:]
        raise RuntimeError(f"{name} exited with code {code}; last output: {last}")
