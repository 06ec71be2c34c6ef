"""launcher: slurm on a real single-host Slurm cluster (tests/slurm_cluster.py): two tasks on the one host stand for
two nodes, each running a torchrun agent with --nnodes=2 and c10d rendezvous on `localhost`.

Skipped with the reason printed where Slurm or root is missing; ASTRAI_REQUIRE_SLURM=1 (set by .ci/run) turns the
skip into a failure. Every address is loopback: the node is `localhost`, gloo binds `lo`, MLflow serves on 127.0.0.1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from conftest import VENV_BIN, free_port, lines_until, make_project, run_ok
from slurm_cluster import Cluster, missing

pytestmark = pytest.mark.integration

SLURM = {"launcher": "slurm", "nodes": 2, "cpus_per_task": 1, "sbatch": ["--nodes=1"]}  # 2 tasks on 1 host
STEPS = 120


def _require_slurm() -> None:
    why = missing()
    if why:
        if os.environ.get("ASTRAI_REQUIRE_SLURM") == "1":
            pytest.fail(f"ASTRAI_REQUIRE_SLURM=1 but {why}")
        pytest.skip(why)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    _require_slurm()
    c = Cluster(tmp_path_factory.mktemp("slurm")).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen([VENV_BIN / "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                             "--backend-store-uri", f"sqlite:///{d}/mlflow.db", "--artifacts-destination",
                             str(d / "artifacts")], env=env, stdout=open(d / "server.log", "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    import urllib.request

    for _ in range(120):
        try:
            urllib.request.urlopen(f"{uri}/health", timeout=1)
            break
        except OSError:
            assert proc.poll() is None, (d / "server.log").read_text()[-2000:]
            time.sleep(0.5)
    yield uri
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def project(cluster, mlflow_server, tmp_path_factory):
    """A DVC project on the test cluster with the data stages done; pretrain trains 2 ranks for STEPS steps."""
    root = tmp_path_factory.mktemp("slurm-project")
    repo = root / "project"
    env = make_project(repo, root / "remote", "astrai-slurm-test")
    env.update({k: v for k, v in cluster.env.items() if os.environ.get(k) != v})  # SLURM_CONF; PATH stays the venv's
    env.update({"GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(repo), "MLFLOW_TRACKING_URI": mlflow_server})
    set_params(repo, {"pretrain": {"max_steps": STEPS, "checkpoint_every": 10, "log_every": 5, "eval_every": 60}})
    run_ok([VENV_BIN / "dvc", "repro", "pack"], repo, env)
    return repo, env


def set_params(repo: Path, changes: dict) -> None:
    params = yaml.safe_load((repo / "params.yaml").read_text())
    for section, values in changes.items():
        params.setdefault(section, {}).update(values)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def weights(repo: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(repo / "data/pretrain/model.safetensors")


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].equal(b[k]), k


def stage(repo: Path, env: dict, launcher: dict, name: str = "pretrain", **kw) -> subprocess.CompletedProcess:
    set_params(repo, {"cluster": launcher, "pretrain": {"nproc": 1 if launcher.get("launcher") == "slurm" else 2}})
    return subprocess.run([VENV_BIN / "astrai", "stage", name], cwd=repo, env=env, capture_output=True, text=True,
                          **kw)


def no_job_left(repo: Path, env: dict) -> None:
    """No job in the queue and no process of this project's training (its config is under repo) on the host."""
    queue = subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True).stdout.strip()
    assert queue == "", queue
    ranks = [p for p in Path("/proc").glob("[0-9]*") if str(repo).encode() in (cmd := _cmdline(p))
             and (b"torch.distributed.run" in cmd or b"astrai_core.training.train" in cmd)]
    assert ranks == [], [_cmdline(p) for p in ranks]


def _cmdline(p: Path) -> bytes:
    try:
        return (p / "cmdline").read_bytes()
    except OSError:
        return b""


@pytest.fixture(scope="module")
def local_weights(project):
    repo, env = project
    out = stage(repo, env, {"launcher": "local"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return weights(repo)


def test_pretrain_through_dvc_on_slurm_equals_the_local_two_rank_run(project, local_weights, mlflow_server):
    """`dvc repro pretrain` with launcher: slurm, 2 nodes x 1 rank: the same weights bit for bit as torchrun's 2
    local ranks; the job's output is in the stage's output, job id first; the ranks' metrics reach the MLflow
    server."""
    repo, env = project
    set_params(repo, {"cluster": SLURM, "pretrain": {"nproc": 1}})
    t = time.monotonic()
    out = run_ok([VENV_BIN / "dvc", "repro", "pretrain"], repo, env)
    print(f"slurm pretrain through dvc repro: {time.monotonic() - t:.1f} s")
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if "Slurm job" in line)
    assert f"{STEPS - 5}" in "\n".join(lines[first:]) and "loss" in "\n".join(lines[first:]), out[-3000:]
    assert_bitwise_equal(weights(repo), local_weights)
    no_job_left(repo, env)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_server)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              "tags.astrai.stage = 'pretrain'", order_by=["attributes.start_time DESC"])
    run = runs[0]
    train_loss = [k for k in run.data.metrics if "loss" in k and not k.startswith("final_")]
    assert train_loss, run.data.metrics
    history = client.get_metric_history(run.info.run_id, train_loss[0])
    assert len(history) >= STEPS // 5 - 1, [m.step for m in history]  # logged by rank 0 on the "node", every 5 steps


def test_cancelled_job_leaves_nothing_and_the_next_run_resumes_to_the_same_weights(project, local_weights):
    """Ctrl-C while the job trains: scancel, no job and no rank left; the stage run again resumes from the
    job's last checkpoint and ends with the uninterrupted run's weights."""
    repo, env = project
    set_params(repo, {"cluster": SLURM, "pretrain": {"nproc": 1}})
    # As in a terminal, Ctrl-C must reach the stage: a test run started in the background of a non-interactive
    # shell (as CI may be) inherits SIGINT ignored, and the stage would then train on and exit 0.
    proc = subprocess.Popen([VENV_BIN / "astrai", "stage", "pretrain"], cwd=repo, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        # 100 steps before the job would end: the Ctrl-C lands while it trains
        seen = lines_until(proc, "step 20/", timeout=300)
        assert proc.poll() is None, "".join(seen[-30:])
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in the terminal
        rest = proc.communicate(timeout=180)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0, "".join(seen[-15:]) + rest[-3000:]
    assert "cancelled" in rest, rest[-3000:]
    no_job_left(repo, env)
    assert list((repo / "data/pretrain.ckpts").iterdir()), "no checkpoint to resume from"

    out = stage(repo, env, SLURM)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "resuming from" in out.stdout + out.stderr
    assert_bitwise_equal(weights(repo), local_weights)


def test_a_failing_rank_is_the_stages_error(project):
    repo, env = project
    # a start checkpoint that does not exist: the ranks fail reading it
    set_params(repo, {"pretrain": {"init_from": str(repo / "no-such-checkpoint")}})
    try:
        out = stage(repo, env, SLURM)
    finally:
        set_params(repo, {"pretrain": {"init_from": None}})
    assert out.returncode != 0
    last = (out.stdout + out.stderr).strip().splitlines()[-1]
    assert "no-such-checkpoint" in last and "Slurm job" not in last, last
    no_job_left(repo, env)


def test_an_sbatch_rejection_shows_slurms_message(project):
    repo, env = project
    out = stage(repo, env, {**SLURM, "partition": "no-such-partition"})
    assert out.returncode != 0
    assert "invalid partition" in (out.stdout + out.stderr).lower(), out.stdout[-2000:] + out.stderr[-2000:]


# --- bad settings, refused when the params are read -------------------------------------------------------------

def _parse(raw: dict, tmp_path: Path):
    """Parse, then check what the settings need of this machine, as a command or stage does where it starts."""
    from tasks.run.checks import check_cluster
    from tasks.run.params import parse_params

    params = parse_params(raw, str(tmp_path / "params.yaml"))
    check_cluster(params, tmp_path)
    return params


@pytest.mark.parametrize("raw, key", [
    ({"cluster": {"launcher": "slurm", "nodes": 0}}, "cluster.nodes"),
    ({"cluster": {"launcher": "slurm", "shared_dir": "/etc/hostname/jobs"}}, "cluster.shared_dir"),
    ({"cluster": {"launcher": "slurm"}, "tracking": {"uri": None}}, "tracking.uri"),
    ({"cluster": {"launcher": "slurm", "nodes": 2}, "pretrain": {"parallel": "tp", "tp_size": 2, "nproc": 2}},
     "pretrain.tp_size"),
])
def test_bad_slurm_settings_are_refused_naming_the_key(raw, key, tmp_path, monkeypatch):
    from astrai_core.runtime.errors import AstraiError

    if "tracking" not in raw:
        raw = {**raw, "tracking": {"uri": "http://127.0.0.1:5000"}}
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    fake = tmp_path / "bin" / "sbatch"  # only looked for on PATH, never run, by these checks
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(AstraiError, match=key.replace(".", r"\.")):
        _parse(raw, tmp_path)


def test_no_sbatch_on_path_is_refused(tmp_path, monkeypatch):
    from astrai_core.runtime.errors import AstraiError

    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(AstraiError, match=r"cluster\.launcher: slurm needs Slurm's sbatch"):
        _parse({"cluster": {"launcher": "slurm"}, "tracking": {"uri": "http://127.0.0.1:5000"}}, tmp_path)


def test_parsing_the_settings_touches_nothing(tmp_path, monkeypatch):
    """Reading params looks at no PATH and creates no directory (issue 31): launcher slurm without sbatch parses;
    check_cluster, where a run starts, is what refuses it, naming the key."""
    from astrai_core.runtime.errors import AstraiError
    from tasks.run.checks import check_cluster
    from tasks.run.params import parse_params

    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    raw = {"cluster": {"launcher": "slurm", "shared_dir": str(tmp_path / "shared")},
           "tracking": {"uri": "http://127.0.0.1:5000"}}
    params = parse_params(raw, str(tmp_path / "params.yaml"))
    assert params.cluster.launcher == "slurm" and not (tmp_path / "shared").exists()
    with pytest.raises(AstraiError, match=r"params\.yaml: cluster\.launcher: slurm needs Slurm's sbatch"):
        check_cluster(params, tmp_path)


def test_the_local_launcher_is_the_default_and_needs_none_of_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch, sqlite tracking: fine locally
    assert _parse({}, tmp_path).cluster.launcher == "local"


# --- the job script --------------------------------------------------------------------------------------------

def test_a_node_that_lost_the_first_one_writes_the_error_file_even_with_its_output_gone(tmp_path):
    """When the job's first node is lost, srun there (which carries every node's output to the log) is gone too:
    the other node's agent fails and its task says so in the error file, the stage's only way to learn of it. A
    write to the closed output pipe kills the writer (SIGPIPE), so the file must be written first (`echo | tee -a
    FILE >&2` died before writing FILE: seen with this test). Here the node's part of the script runs as
    Slurm would start it on node rank 1, with a closed port as the rendezvous, its agent replaced by `false` (an
    agent that failed: the real one only gives up after ~90 s), and its output pipe closed after its first line."""
    import shlex
    import socket

    from astrai_core.training.config import TrainConfig
    from tasks.run.schema import ClusterParams
    from tasks.run.slurm import batch_script

    cfg = TrainConfig(train_data="x.h5", tokenizer="tokenizer.json", out_dir=str(tmp_path / "pretrain"))
    script = batch_script(cfg, ClusterParams(launcher="slurm", nodes=2), 1, 0, tmp_path / "c.json",
                          tmp_path / "pretrain-%j.out", tmp_path)
    on_node = shlex.split(next(line for line in script.splitlines() if line.startswith("srun ")))[-1]
    parts = on_node.split("; ")
    agent = next(i for i, part in enumerate(parts) if "torch.distributed.run" in part)
    with socket.socket() as s:  # a port nothing listens on: the rendezvous no longer answers
        s.bind(("127.0.0.1", 0))
        rdzv = f"127.0.0.1:{s.getsockname()[1]}"
    errors = tmp_path / "pretrain-7.errors"
    env = {**os.environ, "SLURMD_NODENAME": "n2", "SLURM_PROCID": "1", "SLURM_JOB_ID": "7", "ASTRAI_RDZV": rdzv,
           "ASTRAI_RDZV_NODE": "n1", "ASTRAI_ERROR_FILE": str(errors),
           "BASH_FUNC_node_addr%%": "() { echo 127.0.0.1; }"}  # the script's node_addr asks scontrol
    proc = subprocess.Popen(["bash", "-c", "; ".join([*parts[:agent], "false", *parts[agent + 1:]])], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout.readline().startswith(b"astrai: node n2 (rank 1)")
    proc.stdout.close()  # srun on the first node is gone
    assert proc.wait(timeout=60) != 0
    assert errors.read_text() == (f"error: node n2 (node rank 1) lost node n1 (node rank 0): the rendezvous at {rdzv} "
                                  "no longer answers\n")
