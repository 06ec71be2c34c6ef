"""Crash-safe file output: write to a temporary path next to the target, rename into place on success."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any, Iterator

from astrai_core.errors import AstraiError


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `target`; on success rename it onto `target`, on error remove it.

    Works for files and directories alike (the caller decides what to create at the yielded path).
    An existing `target` is replaced only after the new one is complete. The temporary path names its process;
    one left by a process of this host that no longer runs (SIGKILL: no cleanup ran) is removed here.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in _orphaned_temps(target):
        _remove(stale)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.{_OWNER}{os.getpid()}.", suffix=".tmp", dir=target.parent))
    tmp.rmdir()  # the caller creates a file or a directory here
    try:
        yield tmp
        if target.is_dir() and not target.is_symlink():
            old = target.with_name(f".{target.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        _remove(tmp)
        raise


def check_output_dir(out: str | os.PathLike, *inputs: str | os.PathLike) -> None:
    """A directory a command writes whole, replacing what is there (atomic_path): refuse, before any work, a path
    that is a file, the current directory or one holding it, or one that is or holds one of the `inputs`."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise AstraiError(f"{out}: is a file, not a directory; give the path of a directory to write")
    resolved, cwd = out.resolve(), Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        raise AstraiError(f"{out}: is the current directory (or holds it), which would be replaced; give the path "
                          "of a new directory")
    for src in inputs:
        if resolved == Path(src).resolve() or resolved in Path(src).resolve().parents:
            raise AstraiError(f"{out}: is or holds the input {src}, which would be replaced; give another directory")


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


_OWNER = socket.gethostname().replace(".", "_") + "-"  # temp names: .NAME.HOST-PID.RANDOM.tmp


def _orphaned_temps(target: Path) -> list[Path]:
    """atomic_path's temporary paths beside `target` whose process, on this host, has ended."""
    out = []
    for path in target.parent.glob(f".{glob.escape(target.name)}.{glob.escape(_OWNER)}*.tmp"):
        pid = path.name[len(target.name) + len(_OWNER) + 2:].split(".", 1)[0]
        if pid.isdigit() and not _running(int(pid)):
            out.append(path)
    return out


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def write_json(path: str | os.PathLike, obj: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
