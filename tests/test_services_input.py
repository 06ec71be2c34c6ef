"""`astrai services start|env|stop` on bad input: one line `astrai: error: ...` naming the file or option, exit 2,
and nothing started or written. No server needs to run for these: each is refused before anything starts (the
started team's checks are in test_team_services.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import VENV_BIN, free_port


def _astrai(*args, cwd: Path) -> subprocess.CompletedProcess:
    # cwd: a crash would write its traceback log under cwd/.astrai, never into the checkout
    return subprocess.run([str(VENV_BIN / "astrai"), *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def _one_error_line(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("astrai: error: "), out.stderr
    assert "Traceback" not in lines[0] and "(traceback: " not in lines[0], lines[0]  # not the crash form
    return lines[0]


def _ports() -> list[str]:
    return ["--pg-port", str(free_port()), "--mlflow-port", str(free_port()), "--prefect-port", str(free_port())]


@pytest.mark.parametrize("case", ["dir-is-a-file", "dir-not-writable", "postgres-garbage", "postgres-no-host",
                                  "mlflow-port-99999", "prefect-port-0", "pg-port-70000"])
def test_bad_start_input_is_one_line_before_anything_starts(tmp_path, case):
    team = tmp_path / "team"  # new: nothing may be created there
    args, named = [], None
    if case == "dir-is-a-file":
        team.write_text("mine\n")
        named = str(team)
    elif case == "dir-not-writable":  # tests run as root, which may write anywhere but under /proc
        team = Path(f"/proc/astrai-test-{os.getpid()}")
        named = str(team)
    elif case == "postgres-garbage":
        args, named = ["--postgres", "garbage"], "--postgres garbage"
    elif case == "postgres-no-host":
        args, named = ["--postgres", "postgresql://u:p@:notaport"], "--postgres"
    else:
        option, port = case.rsplit("-", 1)
        args, named = [f"--{option}", port], f"--{option} {port}"
    # free ports for the others (the defaults may be a running team's), then the case's own (typer: the last wins)
    line = _one_error_line(_astrai("services", "start", team, *_ports(), *args, cwd=tmp_path))
    assert named in line, line
    if case == "dir-is-a-file":
        assert team.read_text() == "mine\n"
    else:
        assert not team.exists()  # nothing written: no services.json, no trial database


def _failed_start(tmp_path: Path) -> Path:
    """A real start that failed: --postgres names a PostgreSQL that is not there, so the start stops at its first
    connection, leaving a services.json with no servers in it."""
    team = tmp_path / "team"
    out = _astrai("services", "start", team, *_ports(), "--postgres", f"postgresql://u:p@127.0.0.1:{free_port()}",
                  cwd=tmp_path)
    assert out.returncode == 2 and "PostgreSQL at 127.0.0.1" in out.stderr, out.stderr
    assert json.loads((team / "services.json").read_text())["pids"] == {}
    return team


def test_a_postgres_that_does_not_answer_is_one_line(tmp_path):
    """libpq's message has a second line (a hint), which used to follow the error line."""
    out = _astrai("services", "start", tmp_path / "team", *_ports(), "--postgres",
                  f"postgresql://u:p@127.0.0.1:{free_port()}", cwd=tmp_path)
    line = _one_error_line(out)
    assert "PostgreSQL at 127.0.0.1" in line and "Connection refused" in line, line


def test_env_after_a_failed_start_is_one_line(tmp_path):
    team = _failed_start(tmp_path)
    line = _one_error_line(_astrai("services", "env", team, cwd=tmp_path))
    assert f"{team}/services.json" in line, line
    assert _astrai("services", "stop", team, cwd=tmp_path).returncode == 0  # nothing to stop, and it says so


@pytest.mark.parametrize("command", ["env", "stop", "start"])
def test_a_truncated_services_json_is_one_line(tmp_path, command):
    team = _failed_start(tmp_path)
    state = team / "services.json"
    state.write_text(state.read_text()[:20])
    args = _ports() if command == "start" else []
    line = _one_error_line(_astrai("services", command, team, *args, cwd=tmp_path))
    assert str(state) in line, line
