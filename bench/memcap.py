"""What the stage memory benchmarks (bench/pack_memory.py, bench/tokenizer_memory.py) share: a stage run in a fresh
Python process, with the code of a given checkout and its address space capped (prlimit), so that a blow-up fails
instead of starving the machine; the process measures itself (getrusage ru_maxrss) and prints one JSON line.

    result = run_capped(ROOT, STAGE, [str(corpus), str(out)], limit_gb=8.0)    # STAGE: python -c source
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_capped(code: Path, script: str, args: list[str], limit_gb: float | None) -> dict:
    """Run `python -c script *args` in checkout `code` (its directory and PYTHONPATH), capped at `limit_gb` GiB of
    address space when given: the JSON of its last stdout line, or {"failed": "exit N: its last stderr line",
    "limit_gb": limit_gb}."""
    cmd = [sys.executable, "-c", script, *args]
    if limit_gb:
        cmd = ["prlimit", f"--as={int(limit_gb * 2**30)}", "--", *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(code)), cwd=code)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"failed": f"exit {proc.returncode}: {last}", "limit_gb": limit_gb}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def commit(root: Path) -> str:
    """The checkout's short commit, with " (modified)" when tasks/ or astrai_core/ differ from it (for the report)."""
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=root).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "tasks", "astrai_core"], capture_output=True,
                           text=True, cwd=root).stdout.strip()
    return git + (" (modified)" if dirty else "")
