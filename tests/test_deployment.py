"""`prefect deployment run 'astrai-pipeline/NAME'` (the checkout's own deployment) against a real Prefect server and
process worker, started and stopped with the commands the README documents (the Makefile's `server`, `worker`,
`deploy`, `stop`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request

import mlflow
import pytest

from conftest import PROJECT_ROOT, VENV_BIN, free_port, make_deploy, make_project, prefect_server, run_ok

pytestmark = pytest.mark.integration


def stop(proc: subprocess.Popen, *signals: int) -> None:
    for sig in signals:
        if proc.poll() is not None:
            return
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            continue
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_deployment_run_on_server_and_process_worker(tmp_path):
    repo = tmp_path / "project"
    env = make_project(repo, tmp_path / "remote", "astrai-deploy-test", post_training=False)
    port = free_port()
    env.update({"PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
                "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"})
    prefect = str(VENV_BIN / "prefect")
    worker = None
    with prefect_server(tmp_path, port, env) as server:
        try:
            run_ok([prefect, "work-pool", "create", "astrai-local", "--type", "process", "--overwrite"], repo, env)
            worker = subprocess.Popen([prefect, "worker", "start", "--pool", "astrai-local"], cwd=repo, env=env,
                                      stdout=open(tmp_path / "worker.log", "w"), stderr=subprocess.STDOUT,
                                      start_new_session=True)
            deployment = make_deploy(repo, env)
            out = subprocess.run([prefect, "deployment", "run", deployment, "--watch", "--watch-timeout", "600"],
                                 cwd=repo, env=env, capture_output=True, text=True)
            worker_log = (tmp_path / "worker.log").read_text()
            assert out.returncode == 0, f"{out.stdout}\n{out.stderr}\n--- worker log ---\n{worker_log[-5000:]}"
            assert "Completed" in out.stdout + out.stderr
        finally:
            if worker is not None:
                stop(worker, signal.SIGTERM, signal.SIGINT)  # a worker needs SIGTERM then SIGINT

    # The deployment ran in this project: DVC's record is complete and the model is registered.
    assert "up to date" in run_ok([VENV_BIN / "dvc", "status"], repo, env)
    registration = json.loads((repo / "data/register/registration.json").read_text())
    assert registration["version"] == 1 and "champion" in registration["aliases"]
    assert registration["tags"]["prefect_flow_run_id"] != "none"
    client = mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"])
    assert str(client.get_model_version_by_alias("astrai-deploy-test", "champion").version) == "1"
    assert worker.poll() is not None and server.poll() is not None


def test_two_checkouts_deploy_each_its_own_deployment(tmp_path):
    """`make deploy` in two checkouts of one user, in folders of the same name, against one Prefect server: two
    deployments, each running the flow in its own checkout, under the names `make deploy` printed. (One name for
    every checkout, the later `make deploy` took the other's runs.) A name Prefect refuses fails in one line."""
    port = free_port()
    deployed = {}
    with prefect_server(tmp_path, port, {**os.environ, "PREFECT_HOME": str(tmp_path / "server")}):
        for who in ("a", "b"):
            repo = tmp_path / who / "project"
            env = make_project(repo, tmp_path / who / "remote", "unused", post_training=False)
            env.update({"PREFECT_HOME": str(tmp_path / who / "prefect"),
                        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"})
            if not deployed:
                run_ok([VENV_BIN / "prefect", "work-pool", "create", "astrai-local", "--type", "process"], repo, env)
            deployed[make_deploy(repo, env)] = str(repo)
        request = urllib.request.Request(f"http://127.0.0.1:{port}/api/deployments/filter", data=b"{}",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as r:
            deployments = json.loads(r.read())
    on_server = {f"astrai-pipeline/{d['name']}": d["pull_steps"][0]["prefect.deployments.steps.set_working_directory"]
                 ["directory"] for d in deployments}
    assert len(deployed) == 2 and on_server == deployed, (deployed, on_server)

    out = subprocess.run(["make", "-s", "deploy", "DEPLOYMENT=a/b"], cwd=PROJECT_ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.splitlines()[0].startswith("astrai: error: Makefile: DEPLOYMENT='a/b'")


def test_make_stop_ends_the_worker_and_the_server_it_started(tmp_path):
    """`make server`, `make worker`, then `make stop`: nothing of either is left. An idle worker ignores SIGTERM
    alone (the Makefile used to wait 30 s for it before sending SIGINT); stop sends SIGINT 2 s later, so the bound
    below is about which signals it sends, not a speed measurement."""
    port = free_port()
    home = tmp_path / "prefect"
    make = ["make", "-s", "-C", str(PROJECT_ROOT), f"PREFECT_HOME={home}", f"PREFECT_PORT={port}"]
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    run_ok(make + ["server"], PROJECT_ROOT, env)
    run_ok(make + ["worker"], PROJECT_ROOT, env)
    pids = [int((home / f"{name}.pid").read_text()) for name in ("worker", "server")]
    deadline = time.time() + 60
    while "started" not in (home / "worker.log").read_text() and time.time() < deadline:
        time.sleep(0.5)
    t0 = time.monotonic()
    run_ok(make + ["stop"], PROJECT_ROOT, env)
    assert time.monotonic() - t0 < 15
    time.sleep(1)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not (home / "worker.pid").exists() and not (home / "server.pid").exists()


def test_make_server_on_another_port_serves_a_ui_that_calls_that_port(tmp_path):
    """`make server PREFECT_PORT=P`: the UI's settings (what its pages call) name P's API, not 4200's."""
    port = free_port()
    make = ["make", "-s", "-C", str(PROJECT_ROOT), f"PREFECT_HOME={tmp_path / 'prefect'}", f"PREFECT_PORT={port}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_URL", "PREFECT_UI", "PREFECT_SERVER_UI"))}
    run_ok(make + ["server"], PROJECT_ROOT, env)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ui-settings", timeout=30) as r:
            assert json.loads(r.read())["api_url"] == f"http://127.0.0.1:{port}/api"
    finally:
        run_ok(make + ["stop"], PROJECT_ROOT, env)


def test_stopping_a_service_ends_its_whole_process_group(tmp_path):
    """`astrai services stop` signals each service's process group and waits for all of it: a worker's flow runs
    are in its group and ignore the SIGTERM that ends the worker; they must not outlive it."""
    import contextlib
    import sys

    from astrai.services import _spawn, _stop_pid

    child = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             "open('child.pid', 'w').write(str(__import__('os').getpid())); time.sleep(300)")
    leader = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(300)"
    pid = _spawn(tmp_path, "worker", [sys.executable, "-c", leader], dict(os.environ))
    deadline = time.time() + 60
    while not (tmp_path / "child.pid").exists() or not (tmp_path / "child.pid").read_text():
        assert time.time() < deadline
        time.sleep(0.1)
    flow_run = int((tmp_path / "child.pid").read_text())
    try:
        _stop_pid(pid, signal.SIGTERM)
        time.sleep(0.5)  # init reaps the orphan it adopted
        assert not os.path.exists(f"/proc/{flow_run}") or \
            open(f"/proc/{flow_run}/stat").read().rsplit(")", 1)[1].split()[0] == "Z", "the flow run outlived the stop"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
