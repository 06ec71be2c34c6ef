"""The process-group runner: output streamed, failures reported, and no orphan left on error or SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from astrai_core.runtime.proc import stream_process

# A parent that starts a long-lived grandchild and prints its pid, then waits forever.
PARENT = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    print(f"grandchild {child.pid}", flush=True)
    time.sleep(300)
""")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_streams_lines_and_reports_exit_code():
    lines = []
    stream_process([sys.executable, "-c", "print('a'); print('b')"], on_line=lines.append)
    assert lines == ["a", "b"]
    with pytest.raises(RuntimeError, match=r"exited with code 3; last output: oops"):
        stream_process([sys.executable, "-c", "print('oops'); raise SystemExit(3)"], on_line=lambda _: None)


def test_exception_in_caller_kills_grandchildren():
    pids = []

    def on_line(line):
        pids.append(int(line.split()[1]))
        raise KeyboardInterrupt  # what Ctrl-C or a cancellation raised into the caller looks like

    with pytest.raises(KeyboardInterrupt):
        stream_process([sys.executable, "-c", PARENT], on_line=on_line)
    time.sleep(0.5)
    assert pids and not alive(pids[0])


def test_sigterm_to_the_caller_kills_the_group(tmp_path):
    """A process running stream_process gets SIGTERM (as from a Prefect worker): no grandchild survives it."""
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        from astrai_core.runtime.proc import stream_process
        stream_process([sys.executable, "-c", {PARENT!r}], on_line=lambda l: print(l, flush=True))
    """))
    caller = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    grandchild = int(caller.stdout.readline().split()[1])
    assert alive(grandchild)
    caller.send_signal(signal.SIGTERM)
    assert caller.wait(timeout=30) != 0
    time.sleep(0.5)
    assert not alive(grandchild)
