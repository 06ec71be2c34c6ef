"""Nothing lost (issue 32, items 2 and 4): one run per checkout, and a killed run leaves nothing running.

Real runs of `astrai pipeline --profile quick` in a throwaway git + DVC project (real temporary Prefect server,
sqlite MLflow store, torchrun)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from conftest import VENV_BIN, make_quick_project, run_ok
from tasks.run.table import MODEL_STAGES

pytestmark = pytest.mark.integration


def astrai(*args) -> list[str]:
    return [sys.executable, "-m", "astrai.cli", *args]


# The lock is the pipeline's, not the stages': the runs here stop after pretrain's model is evaluated and registered
# (about a minute less per run than the whole quick chain).
POST_TRAINING_OFF = {f"{kind}.enabled": False for kind in MODEL_STAGES[1:]}  # sft, dpo, grpo
NO_POST_TRAINING = [a for key in POST_TRAINING_OFF for a in ("--set", f"{key}=false")]


def wait_for(predicate, proc, what: str, timeout: float = 600):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert proc.poll() is None, f"the run ended before {what}: {proc.communicate()[0][-3000:]}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.2)
    return value


def lock_holder(repo):
    try:
        return json.loads((repo / ".astrai/run.lock").read_text() or "{}")
    except (OSError, ValueError):
        return {}


def test_a_second_run_in_the_checkout_stops_at_once_naming_the_first(tmp_path):
    """Two runs started a few seconds apart: the second (`astrai pipeline` or `astrai stage`) stops with one line
    naming the first (pid, start, command) and touches nothing; the first ends as if alone, and dvc.lock records
    its params (dvc status clean)."""
    repo, env = make_quick_project(tmp_path)
    user_params = (repo / "params.yaml").read_bytes()
    first = subprocess.Popen(astrai("pipeline", "--profile", "quick", *NO_POST_TRAINING), cwd=repo, env=env,
                             stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: lock_holder(repo).get("pid") == first.pid and (repo / ".astrai/params.yaml.run").exists(),
                 first, "lock and params of the first run")
        run_params = (repo / "params.yaml").read_bytes()
        assert run_params != user_params
        for args in (("pipeline", "--profile", "quick", "--set", "pretrain.max_steps=3"), ("stage", "corpus")):
            start = time.monotonic()
            second = subprocess.run(astrai(*args), cwd=repo, env=env, capture_output=True, text=True, timeout=300)
            took = time.monotonic() - start
            lines = second.stderr.strip().splitlines()
            assert second.returncode == 2 and len(lines) == 1, second.stdout[-2000:] + second.stderr[-3000:]
            assert lines[0].startswith(f"astrai: error: .astrai/run.lock: this checkout is in use by pid "
                                       f"{first.pid}, started "), lines[0]
            assert f"`astrai pipeline --profile quick {' '.join(NO_POST_TRAINING)}`" in lines[0]
            assert took < 60, took  # at once: no Prefect server, no stage
            assert (repo / "params.yaml").read_bytes() == run_params  # the first run's params stay in place
            assert first.poll() is None
        out = first.communicate(timeout=900)[0]
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, out[-4000:]
    assert (repo / "params.yaml").read_bytes() == user_params
    assert lock_holder(repo) == {} and not (repo / ".astrai/run.record").exists()  # a clean end leaves nothing
    assert_lock_records(repo, env, run_params)
    recorded = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]["pretrain"]["params"]["params.yaml"]
    assert recorded["pretrain"] == yaml.safe_load(run_params)["pretrain"] and recorded["pretrain"]["max_steps"] == 40


def assert_lock_records(repo, env, run_params: bytes) -> None:
    """dvc.lock records the outputs in data/ and the params `run_params` they were made with: with those params in
    params.yaml, `dvc status` is clean (with the user's own, it names the profile's params as changed)."""
    user = (repo / "params.yaml").read_bytes()
    (repo / "params.yaml").write_bytes(run_params)
    try:
        status = run_ok([VENV_BIN / "dvc", "status"], repo, env)
    finally:
        (repo / "params.yaml").write_bytes(user)
    assert "Data and pipelines are up to date" in status, status


def test_a_killed_pipeline_is_cleaned_up_by_the_next_start(tmp_path):
    """kill -9 of `astrai pipeline` during pretrain orphans the temporary Prefect server and the stage's process
    groups (dvc repro, torchrun) and leaves its MLflow runs RUNNING; the next start stops them, marks the runs
    KILLED, says so, and runs the pipeline to the end."""
    import mlflow

    from astrai_core.runtime.proc import start_ticks

    repo, env = make_quick_project(tmp_path)
    first = subprocess.Popen(astrai("pipeline", "--profile", "quick", "--set", "pretrain.max_steps=100000"), cwd=repo,
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    record = repo / ".astrai/run.record"

    def entries():
        return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []

    try:
        wait_for(lambda: any(e.get("what", "").startswith("torchrun") for e in entries()), first, "torchrun")
        time.sleep(3)  # training
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    finally:
        if first.poll() is None:
            first.kill()
    procs = [e for e in entries() if "pid" in e]
    whats = {e["what"].split(" (")[0] for e in procs}
    assert {"prefect temporary server", "dvc repro pretrain", "torchrun"} <= whats, procs
    alive = [e for e in procs if start_ticks(e["pid"]) == e["start"]]
    assert {e["what"].split(" (")[0] for e in alive} >= {"prefect temporary server", "torchrun"}, alive  # orphans
    runs = [e["mlflow_run"] for e in entries() if "mlflow_run" in e]
    client = mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"])
    assert any(client.get_run(r).info.status == "RUNNING" for r in runs)

    again = subprocess.run(astrai("pipeline", "--profile", "quick", *NO_POST_TRAINING), cwd=repo, env=env,
                           capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-4000:]
    note = [line for line in again.stderr.splitlines() if "a run killed earlier" in line]
    assert note and f"pid {first.pid}" in note[0] and "prefect temporary server" in note[0], again.stderr[-3000:]
    assert not [e for e in procs if start_ticks(e["pid"]) == e["start"]]  # nothing of the killed run runs
    statuses = {r: client.get_run(r).info.status for r in runs}
    assert "RUNNING" not in statuses.values() and "KILLED" in statuses.values(), statuses
    parent = [r for r in runs if client.get_run(r).data.tags.get("astrai.stage") == "pipeline"]
    assert [statuses[r] for r in parent] == ["KILLED"]
    from tasks.run.params import params_of_run

    assert_lock_records(repo, env, params_of_run(repo, "params.yaml", POST_TRAINING_OFF, "quick").text.encode())


def test_ctrl_c_stops_the_pipeline_in_seconds_and_cancels_its_flow_run(tmp_path):
    """Ctrl-C in the terminal (SIGINT to the whole foreground process group) while pretrain trains: `astrai pipeline`
    exits 130 within 30 s with one line naming the signal, no process of the run is left (torchrun, its ranks, dvc,
    the temporary Prefect server), and the flow run ended Cancelled. Before, Prefect's temporary server was in the
    terminal's group as well: Ctrl-C stopped it first, the run took 76 s to give up on it ("All connection attempts
    failed") and the flow run stayed RUNNING."""
    import urllib.request

    from conftest import free_port, prefect_server

    repo, env = make_quick_project(tmp_path)
    env["PREFECT_HOME"] = str(tmp_path / "prefect")  # the temporary server's database: read again below
    record = repo / ".astrai/run.record"
    # A terminal's foreground job: a process group of its own, SIGINT not ignored (a test runner in the background
    # of a non-interactive shell may start it ignored).
    proc = subprocess.Popen(astrai("pipeline", "--profile", "quick", "--set", "pretrain.max_steps=100000"), cwd=repo,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_for(lambda: "torchrun" in (record.read_text() if record.exists() else ""), proc, "torchrun")
        time.sleep(3)  # training
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        start = time.monotonic()
        err = proc.communicate(timeout=120)[1]
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = err.strip().splitlines()
    assert proc.returncode == 130 and lines[-1].startswith("astrai: interrupted (SIGINT)"), err[-4000:]
    assert took < 30, (took, err[-4000:])
    left = []
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.readlink(f"/proc/{pid}/cwd").startswith(str(tmp_path)):
                left.append(open(f"/proc/{pid}/cmdline").read().replace("\0", " "))
        except OSError:
            continue
    assert not left, left  # what ran in the checkout (the stage) or in PREFECT_HOME (the server) is gone

    port = free_port()
    with prefect_server(tmp_path / "prefect", port, env):
        request = urllib.request.Request(f"http://127.0.0.1:{port}/api/flow_runs/filter", data=b"{}",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as r:
            states = [run["state_type"] for run in json.loads(r.read())]
    assert states == ["CANCELLED"], states
