"""Crash-safe file output: write to a temporary path next to the target, rename into place on success."""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from astrai_core.runtime.errors import AstraiError


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


OUTPUT_MARK = ".astrai-output"  # inside every folder atomic_path writes: which command wrote it ({"written_by": kind})
CHECKPOINT = "astrai checkpoint"  # the kind of a training run's model folder (save_checkpoint's default)


def written_by(folder: str | os.PathLike) -> str | None:
    """The kind of output `folder` holds (what atomic_path recorded in it), or None (not written by it)."""
    try:
        return json.loads((Path(folder) / OUTPUT_MARK).read_text())["written_by"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_output(target: str | os.PathLike, kind: str, *, force: bool = False,
                 inputs: Iterable[str | os.PathLike] = (), force_option: str | None = None,
                 folder: bool = False, file_kind: Callable[[Path], str | None] | None = None) -> None:
    """The one rule for writing over `target`; AstraiError naming it when the write must not happen.

    An output equal to, inside or containing one of `inputs`, or the current directory or one holding it, is
    refused (even with `force`): writing it would replace what is being read or worked in. An existing folder that
    is not empty is replaced only if it holds an earlier output of the same `kind` (its OUTPUT_MARK says so), or
    with `force`; a symlink or an empty folder is simply replaced, except that a `folder` output never replaces a
    file. A file is simply replaced by the files a stage writes into its own folders; a command that writes a file
    where a user points it passes `file_kind` (what wrote an existing file, read from the file itself), and then
    an existing file is replaced only if `file_kind` says `kind` wrote it, or with `force`, and a folder never.
    `force_option` names the command's option that forces, for the message.
    """
    target = Path(target)
    where = target.resolve()
    cwd = Path.cwd().resolve()
    if where == cwd or where in cwd.parents:
        raise AstraiError(f"{target}: is the current directory (or holds it), which would be replaced; give the path "
                          "of a new directory")
    if folder and target.exists() and not target.is_dir():
        raise AstraiError(f"{target}: is a file, not a directory; give the path of a directory to write")
    for source in inputs:
        source = Path(source).resolve()
        if where == source or source in where.parents or where in source.parents:
            relation = "is" if where == source else "is inside" if source in where.parents else "contains"
            raise AstraiError(f"{target}: the output folder {relation} the input {source}; write it elsewhere")
    forcing = f", or pass {force_option} to replace it" if force_option else ""
    if file_kind is not None and target.is_dir() and not target.is_symlink():
        raise AstraiError(f"{target}: is a directory, not a file; give the path of a file to write")
    if file_kind is not None and target.is_file() and not force and (found := file_kind(target)) != kind:
        holds = f"was written by {found}" if found else f"was not written by {kind}"
        raise AstraiError(f"{target}: exists and {holds}; nothing was changed: choose a new file name{forcing}")
    if force or target.is_symlink() or not target.is_dir() or not any(target.iterdir()):
        return
    found = written_by(target)
    if found == kind:
        return
    holds = f"holds an output of {found}" if found else f"holds files not written by {kind} (no {OUTPUT_MARK})"
    raise AstraiError(f"{target}: exists, is not empty and {holds}; nothing was changed: choose a new or empty "
                      f"folder{forcing}")


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike, kind: str, *, force: bool = False,
                inputs: Iterable[str | os.PathLike] = (), force_option: str | None = None,
                file_kind: Callable[[Path], str | None] | None = None) -> Iterator[Path]:
    """Yield a temporary path beside `target`; on success rename it onto `target`, on error remove it.

    Works for files and directories alike (the caller decides what to create at the yielded path). `kind` names
    what is written (e.g. "stage corpus", "astrai export-hf"): a folder gets it in OUTPUT_MARK, and an existing
    `target` is replaced only as check_output allows (checked first, and again before the rename), and only after
    the new one is complete. The temporary path names its process; one left by a process of this host that no
    longer runs (SIGKILL: no cleanup ran) is removed here.
    """
    target = Path(target)
    check_output(target, kind, force=force, inputs=inputs, force_option=force_option, file_kind=file_kind)
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in _orphaned_temps(target):
        _remove(stale)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.{_OWNER}{os.getpid()}.", suffix=".tmp", dir=target.parent))
    tmp.rmdir()  # the caller creates a file or a directory here
    try:
        yield tmp
        if tmp.is_dir():
            (tmp / OUTPUT_MARK).write_text(json.dumps({"written_by": kind}) + "\n")
        # nothing else appeared there meanwhile
        check_output(target, kind, force=force, force_option=force_option, file_kind=file_kind)
        if target.is_dir() and not target.is_symlink():
            old = target.with_name(f".{target.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException as e:
        _remove(tmp)
        if why := disk_full(e):
            raise AstraiError(f"{target}: disk full while writing it ({why}); nothing replaced") from e
        raise


def disk_full(e: BaseException | None) -> str | None:
    """What says `e` (or an exception it came from) is a full disk: ENOSPC, a library's "No space left on device"
    (safetensors' own error type), or a short write (gguf's "16384 requested and 14320 written"); else None."""
    while e is not None:
        text = str(e)
        if getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in text:
            return "No space left on device"
        if isinstance(e, OSError) and re.search(r"\d+ requested and \d+ written", text):
            return f"a short write: {text}"
        e = e.__cause__ or e.__context__
    return None


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
    with atomic_path(path, "json") as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
