"""`astrai services start|env|stop` on bad input: one line `astrai: error: ...` naming the file or option, exit 2,
and nothing started or written. No server needs to run for these: each is refused before anything starts (the
started team's checks are in test_team_services.py)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PROJECT_ROOT, VENV_BIN, free_port, stop_group


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


def _distinct_free_ports(n: int) -> list[int]:
    """n free ports, all different: the sockets are held until all are picked (free_port() thrice in a row once gave
    one port twice: "--mlflow-port 39415 and --prefect-port 39415")."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def _ports() -> list[str]:
    pg, mlflow_port, prefect = _distinct_free_ports(3)
    return ["--pg-port", str(pg), "--mlflow-port", str(mlflow_port), "--prefect-port", str(prefect)]


@pytest.mark.parametrize("case", ["dir-is-a-file", "dir-not-writable", "postgres-garbage", "postgres-no-host",
                                  "mlflow-port-99999", "prefect-port-0", "pg-port-70000", "one-port-twice",
                                  "dir-empty-string", "dir-of-the-users"])
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
    elif case == "dir-empty-string":  # issue 50 (13): "" started everything in the current directory
        team, named = "", "DIR ''"
    elif case == "dir-of-the-users":  # issue 50 (13): a non-empty folder of the user's was written into
        team.mkdir()
        (team / "notes.txt").write_text("mine\n")
        named = "a folder `astrai services start` did not make"
    elif case == "one-port-twice":
        port = str(free_port())
        args, named = ["--mlflow-port", port, "--prefect-port", port], f"--prefect-port {port}"
    else:
        option, port = case.rsplit("-", 1)
        args, named = [f"--{option}", port], f"--{option} {port}"
    # free ports for the others (the defaults may be a running team's), then the case's own (typer: the last wins)
    line = _one_error_line(_astrai("services", "start", team, *_ports(), *args, cwd=tmp_path))
    assert named in line, line
    if case == "dir-is-a-file":
        assert team.read_text() == "mine\n"
    elif case == "dir-empty-string":
        assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing in the current directory
    elif case == "dir-of-the-users":
        assert [p.name for p in team.iterdir()] == ["notes.txt"]
    else:
        assert not team.exists()  # nothing written: no services.json, no trial database


@pytest.mark.parametrize("option", ["--pg-port", "--mlflow-port", "--prefect-port"])
def test_start_refuses_a_port_in_use_before_anything_starts(tmp_path, option):
    """Started beside another team on its ports, `start` used to go on: its own servers died (address in use) while
    the other team's answered, and it exited 0 printing the other team's URLs."""
    team = tmp_path / "team"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _astrai("services", "start", team, *_ports(), option, port, cwd=tmp_path)
        try:
            line = _one_error_line(out)
        finally:  # the unfixed start went on with the trial database: stop whatever it left
            if (team / "services.json").exists():
                _astrai("services", "stop", team, cwd=tmp_path)
    assert f"127.0.0.1:{port}" in line and option in line, line
    assert not team.exists()


def test_make_team_services_moves_postgres_port(tmp_path):
    """TEAM_POSTGRES_PORT reaches `astrai services start --pg-port`: on a port in use, its error names it.
    (-o: make leaves .venv as it is, whatever the dates of pyproject.toml and the lock.)"""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(["make", "-s", "-C", str(PROJECT_ROOT), "-o", ".venv/bin/astrai", "team-services",
                              f"TEAM_DIR={tmp_path / 'team'}", f"TEAM_POSTGRES_PORT={port}",
                              *(f"{name}={p}" for name, p in zip(("MLFLOW_PORT", "PREFECT_PORT"),
                                                                  _distinct_free_ports(2)))],
                             cwd=tmp_path, capture_output=True, text=True, timeout=300)
        if (tmp_path / "team" / "services.json").exists():  # the unfixed Makefile started a team on 5432
            _astrai("services", "stop", tmp_path / "team", cwd=tmp_path)
    ours = [line for line in out.stderr.splitlines() if line.startswith("astrai: error: ")]
    assert out.returncode != 0 and len(ours) == 1 and f"127.0.0.1:{port} (--pg-port)" in ours[0], out.stderr


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


def test_a_server_is_taken_for_the_one_started_only_if_its_processes_listen():
    """What answers on a port is the server just started only if a process of its group holds the listening socket
    (not another team's server that took the port first)."""
    from astrai.services import _group_listens

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    other = subprocess.Popen(["sleep", "300"], start_new_session=True)  # alive, listening nowhere
    try:
        for _ in range(100):
            if _group_listens(server.pid, port):
                break
            assert server.poll() is None
            __import__("time").sleep(0.1)
        assert _group_listens(server.pid, port)
        assert not _group_listens(other.pid, port)
        assert not _group_listens(server.pid, free_port())
    finally:
        stop_group(server)
        stop_group(other)


@pytest.mark.parametrize("uri, mlflow_port, base", [
    ("http://127.0.0.1:25000", None, "http://127.0.0.1:25000"),
    ("http://127.0.0.1:25000/", None, "http://127.0.0.1:25000"),
    ("HTTP://mlflow.example:8080/prefix/", None, "http://mlflow.example:8080/prefix"),
    ("https://user:secret@mlflow.example/mlflow", None, "https://mlflow.example/mlflow"),  # no password on screen
    ("sqlite:////tmp/mlflow.db", None, "http://127.0.0.1:5000"),  # a local store: `make mlflow-ui`'s server
    ("sqlite:////tmp/mlflow.db", "5001", "http://127.0.0.1:5001"),  # ... on the Makefile's MLFLOW_PORT
])
def test_the_mlflow_link_follows_the_tracking_uri(monkeypatch, uri, mlflow_port, base):
    from tasks.run.tracking import ui_link

    if mlflow_port:
        monkeypatch.setenv("MLFLOW_PORT", mlflow_port)
    else:
        monkeypatch.delenv("MLFLOW_PORT", raising=False)
    assert ui_link(uri, "3") == f"{base}/#/experiments/3?workflowType=machine_learning"
    assert ui_link(uri, "3", "r1") == f"{base}/#/experiments/3/runs/r1?workflowType=machine_learning"
