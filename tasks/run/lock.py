"""One run per checkout: `astrai pipeline`, the flow and `astrai stage` hold .astrai/run.lock while they run.

A run swaps params.yaml for its own params while it lasts (tasks/run/params.py run_params) and DVC writes dvc.lock
after each stage, so two runs in one checkout corrupt each other. The lock is an OS lock (fcntl.flock): a run
that dies, even by SIGKILL, releases it. The file holds the holder's pid, start time and command, so a second run
stops at once with one line naming it. The holder's token travels to its children in ASTRAI_RUN_TOKEN: the
stages a pipeline runs (through `dvc repro`, each one `astrai stage NAME`) are part of its run and pass.

What a run starts is noted in .astrai/run.record (astrai_core/runtime/proc.py `record`): the process groups of its
subprocesses (dvc repro, torchrun), the temporary Prefect server, its MLflow runs. A clean end clears both files;
a run killed outright leaves them, and the next run to take the lock stops those processes (checking each one's
start time, so a reused pid is left alone) and marks those MLflow runs KILLED.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Callable, Iterator

from astrai_core.runtime.errors import AstraiError
from astrai_core.runtime.proc import RECORD_ENV, record, start_ticks

LOCK = Path(".astrai") / "run.lock"
RECORD = Path(".astrai") / "run.record"
TOKEN_ENV = "ASTRAI_RUN_TOKEN"
DVC_LOCK = Path(".dvc") / "tmp" / "lock"  # held by a dvc command for as long as it runs (zc.lockfile: flock)


def holder(root: Path) -> dict:
    """What .astrai/run.lock says about the run that holds it (or held it last and was killed); {} if nothing."""
    try:
        return json.loads((root / LOCK).read_text() or "{}")
    except (OSError, ValueError):
        return {}


def describe(info: dict) -> str:
    if not info:
        return "another run (it has not written its details yet)"
    return f"pid {info['pid']}, started {info['started']}, `{info['command']}`"


@contextlib.contextmanager
def checkout_lock(root: Path, command: str | None = None, *, log: Callable[[str], None] = print,
                  dvc_free: bool = False) -> Iterator[None]:
    """Hold the checkout's run lock while the block runs; AstraiError naming the holder if another run has it.

    A process of the run that holds it (ASTRAI_RUN_TOKEN matches) passes without locking. `dvc_free`: also refuse
    while a dvc command runs here (a plain `dvc repro` between two of its stages holds no run lock). What a killed
    earlier run left is stopped first (`log` says what).
    """
    path = root / LOCK
    token = os.environ.get(TOKEN_ENV)
    if token and holder(root).get("token") == token:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+")
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise AstraiError(f"{path}: this checkout is in use by {describe(holder(root))}; wait for it to end, "
                              "or stop it") from None
        if left := holder(root):  # first: a killed run's orphaned `dvc repro` holds DVC's lock
            log(stop_leftovers(root, left))
        if dvc_free and (busy := _dvc_running(root)):
            raise AstraiError(f"{root / DVC_LOCK}: a dvc command is running in this checkout ({busy}); wait for it "
                              "to end")
        token = uuid.uuid4().hex
        info = {"token": token, "pid": os.getpid(), "start": start_ticks(os.getpid()), "host": socket.gethostname(),
                "started": datetime.now().astimezone().isoformat(timespec="seconds"),
                "command": command or " ".join(["astrai", *sys.argv[1:]])}
        f.seek(0)
        f.truncate()
        f.write(json.dumps(info) + "\n")
        f.flush()
        (root / RECORD).write_text("")
        saved = {k: os.environ.get(k) for k in (TOKEN_ENV, RECORD_ENV)}
        os.environ.update({TOKEN_ENV: token, RECORD_ENV: str((root / RECORD).resolve())})
        try:
            yield
        finally:
            for key, value in saved.items():
                os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
            (root / RECORD).unlink(missing_ok=True)
            f.seek(0)
            f.truncate()  # a clean end: nothing for the next run to stop
    finally:
        f.close()  # releases the lock


def _dvc_running(root: Path) -> str | None:
    """Who holds DVC's repository lock, or None. Probed with the lock itself (shared, released at once)."""
    path = root / DVC_LOCK
    if not path.exists():
        return None
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            pid = f.read().strip()
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except (OSError, ValueError):
                cmd = "?"
            return f"pid {pid}: {cmd}"
    return None


def note_prefect_server() -> None:
    """Record this process's temporary Prefect server (Prefect starts it as a plain child; a SIGKILL of this
    process would leave it running, listening, ~200 MB)."""
    me = str(os.getpid())
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[1] != me:
                continue
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if b"prefect.server.api.server:create_app" in cmdline:
            pid = int(stat.parent.name)
            record({"pid": pid, "start": start_ticks(pid), "group": False, "what": "prefect temporary server"})


def stop_leftovers(root: Path, left: dict) -> str:
    """Stop what the killed run `left` (its lock's details) started, mark its MLflow runs KILLED; one line."""
    entries = []
    with contextlib.suppress(OSError):
        for line in (root / RECORD).read_text().splitlines():
            with contextlib.suppress(ValueError):
                entries.append(json.loads(line))
    procs = [e for e in entries if "pid" in e and e.get("start") is not None and start_ticks(e["pid"]) == e["start"]]
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        for e in procs:
            if start_ticks(e["pid"]) == e["start"]:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    (os.killpg if e["group"] else os.kill)(e["pid"], sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(start_ticks(e["pid"]) == e["start"] for e in procs):
            time.sleep(0.1)
    stopped = [f"{e['what']} (pid {e['pid']})" for e in procs]
    killed = mark_runs_killed([e for e in entries if "mlflow_run" in e], left)
    (root / RECORD).unlink(missing_ok=True)
    return (f"a run killed earlier ({describe(left)}) left: "
            f"{', '.join(stopped) or 'no process running'} (stopped); "
            f"MLflow runs marked KILLED: {', '.join(killed) or 'none'}")


def mark_runs_killed(entries: list[dict], left: dict) -> list[str]:
    """Mark KILLED the recorded MLflow runs still RUNNING (a run killed outright never ends them)."""
    if not entries:
        return []
    import mlflow
    from mlflow.exceptions import MlflowException

    killed = []
    for e in entries:
        client = mlflow.MlflowClient(e["tracking_uri"])
        try:
            if client.get_run(e["mlflow_run"]).info.status != "RUNNING":
                continue
            client.set_tag(e["mlflow_run"], "astrai.ended", f"killed: its process (pid {left.get('pid')}) ended "
                                                            "without ending the run; marked by the next run")
            client.set_terminated(e["mlflow_run"], status="KILLED")
            killed.append(e["mlflow_run"])
        except MlflowException:  # a store or run that is gone
            continue
    return killed
