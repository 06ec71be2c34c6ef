"""Training stages as two-node Slurm jobs on a simulated three-machine cluster (tests/netns_cluster.py): a login
namespace with slurmctld and the team services (PostgreSQL, MLflow, Prefect), two compute namespaces with a slurmd
each, one rank per node; gloo and torchrun's c10d rendezvous cross the bridge between them, not loopback. The
whole pipeline as a `prefect deployment run` on the login node's worker, the model then served from a compute node;
a compute node lost mid-job, then the stage resumed.

Built once for the module. Skipped with the reason where root, iproute2, Slurm or PostgreSQL is missing (or a
cluster of another live run is up); ASTRAI_REQUIRE_CLUSTER=1 (set by .ci/run) turns the skip into a failure.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import (TINY_PARAMS, VENV_BIN, lines_until, make_deploy, make_project, run_ok, served_completion,
                      stop_group)
from netns_cluster import NetnsCluster, missing
from test_slurm import assert_bitwise_equal, set_params, stage, weights

pytestmark = pytest.mark.integration

# The tiny model; a node is lost at step 20, after two checkpoints, with 140 steps to go: the stage passes a step
# line on up to a second after a rank wrote it (it polls the job's log), and the fast kind trains 60 steps in about
# 2 s (with 60 steps in all, the loss came after training had ended, and the job waited on the lost node in
# torchrun's exit barrier).
STEPS = 160
# A lost node ends the job within peer_timeout + 2 x kill_wait seconds (tasks/run/schema.py ClusterParams).
TWO_NODES = {"launcher": "slurm", "nodes": 2, "cpus_per_task": 1, "peer_timeout": 20, "kill_wait": 10}


def _require(why: str | None) -> None:
    if why:
        if os.environ.get("ASTRAI_REQUIRE_CLUSTER") == "1":
            pytest.fail(f"ASTRAI_REQUIRE_CLUSTER=1 but {why}")
        pytest.skip(why)


def test_what_a_dead_run_left_is_removed_and_a_live_runs_cluster_refuses_a_second():
    """Before the module's cluster starts: a namespace, a bridge and a hosts line of a run whose process is gone are
    removed; those of a live process (this one) make a new cluster refuse to start, naming it."""
    import netns_cluster

    _require(None if os.geteuid() == 0 and shutil.which("ip") else "needs root and iproute2")
    gone = subprocess.Popen(["true"])
    gone.wait()
    for pid in (gone.pid, os.getpid()):
        tag = f"astrai{pid}"
        subprocess.run(["ip", "netns", "add", f"{tag}-n1"], check=True)
        subprocess.run(["ip", "link", "add", f"astb{pid}", "type", "bridge"], check=True)
        with netns_cluster.HOSTS.open("a") as f:
            f.write(f"10.99.250.11 {tag}-n1 {netns_cluster.MARK} {tag}\n")
        if pid == gone.pid:
            assert netns_cluster.clean_stale() is None
        else:
            try:
                assert f"process {pid} is up" in (netns_cluster.clean_stale() or "")
            finally:
                netns_cluster._remove(tag)
        assert f"{tag}-" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"astb{pid}" not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert tag not in netns_cluster.HOSTS.read_text()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    _require(missing())
    t = time.monotonic()
    c = NetnsCluster(tmp_path_factory.mktemp("netns-cluster")).start()
    print(f"namespace cluster up in {time.monotonic() - t:.0f} s", file=sys.stderr)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def project(cluster, tmp_path_factory):
    """A DVC project on the shared filesystem with the data stages done, pointed at the login namespace's MLflow;
    pretrain trains STEPS steps, one rank per node."""
    root = tmp_path_factory.mktemp("netns-project")
    repo = root / "project"
    env = make_project(repo, root / "remote", "astrai-netns-test")
    env.update({k: v for k, v in cluster.env.items() if os.environ.get(k) != v})  # SLURM_CONF, the services' URLs
    env.pop("GLOO_SOCKET_IFNAME", None)  # the launcher picks each node's interface
    env["PYTHONPATH"] = str(repo)
    set_params(repo, {"pretrain": {"max_steps": STEPS, "checkpoint_every": 10, "log_every": 5, "eval_every": 60}})
    run_ok([VENV_BIN / "dvc", "repro", "pack"], repo, env)
    return repo, env


@pytest.fixture(scope="module")
def local_weights(project):
    """The reference: the same pretrain as 2 local ranks (torchrun on this host, loopback)."""
    repo, env = project
    out = stage(repo, env, {"launcher": "local"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return weights(repo)


def login_stage(cluster: NetnsCluster, repo: Path, env: dict, **popen) -> subprocess.Popen:
    """`astrai stage pretrain` on the login node (its namespace), launcher slurm over both compute nodes."""
    set_params(repo, {"cluster": TWO_NODES, "pretrain": {"nproc": 1}})
    return subprocess.Popen([*cluster.enter("login"), VENV_BIN / "astrai", "stage", "pretrain"], cwd=repo, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            **popen)


def assert_on_both_nodes(cluster: NetnsCluster, out: str, stage: str) -> None:
    """`stage`'s output (`out`) is one Slurm job of one rank on each compute node: the rendezvous and each node's
    gloo address are the nodes' own (10.99.N.x on the bridge's veths, not loopback)."""
    assert re.search(rf"{stage}: Slurm job \d+, 2 node\(s\) x 1 process\(es\)", out), out[-3000:]
    n1, n2 = (cluster.ns[n] for n in ("n1", "n2"))
    rdzv = re.search(r"astrai: rendezvous at (\S+):\d+", out)
    assert rdzv and rdzv.group(1) == cluster.addr[n1], out[-3000:]
    for node, rank in ((n1, 0), (n2, 1)):
        m = re.search(rf"astrai: node {node} \(rank {rank}\) at (\S+), gloo on (\S+)", out)
        assert m and m.group(1) == cluster.addr[node] and m.group(2).startswith("astv"), out[-3000:]
        assert not ipaddress.ip_address(m.group(1)).is_loopback


def _sql(uri: str, query: str, args: tuple = ()) -> list[tuple]:
    import psycopg2

    conn = psycopg2.connect(uri)
    try:
        with conn.cursor() as cur:
            cur.execute(query, args)
            return cur.fetchall()
    finally:
        conn.close()


def test_the_pipeline_as_a_deployment_run_trains_on_both_nodes_registers_and_serves_from_a_node(
        cluster, project, local_weights, tmp_path):
    """`prefect deploy` and `prefect deployment run` in the login namespace; the services' worker runs the whole
    pipeline there, its overrides (this run only: params.yaml is the user's again after it) sending each training
    stage to Slurm as a 2-node job, one rank per node, over the namespaces' addresses. Pretrain's weights equal the
    local 2-rank run's bit for bit; the flow run is COMPLETED in Prefect's PostgreSQL, and pretrain's and sft's loss
    curves and the registered champion are in MLflow's; `astrai serve --model models:/NAME@champion` started on
    node n2 pulls the weights through the MLflow server and answers a request sent over the bridge."""
    from astrai.services import database, wait_healthy, with_driver
    from astrai_core.runtime.io import sha256_file
    from tasks.run.table import MODEL_STAGES, model_dir

    repo, env = project
    env = {**env, "PREFECT_HOME": str(tmp_path / "prefect")}
    prefect, name = VENV_BIN / "prefect", "netns-pipeline"
    overrides = {**{f"cluster.{k}": v for k, v in TWO_NODES.items()}, **{f"{s}.nproc": 1 for s in MODEL_STAGES}}
    user_params = (repo / "params.yaml").read_text()
    deployment = make_deploy(repo, env, *cluster.enter("login"))
    t = time.monotonic()
    out = cluster.run("login", [prefect, "deployment", "run", deployment, "--params",
                                json.dumps({"overrides": overrides}), "--flow-run-name", name, "--watch",
                                "--watch-timeout", "1500"], cwd=repo, env=env, capture_output=True, text=True,
                      timeout=1600)
    log = repo / ".astrai" / "logs" / f"pipeline-{name}.log"
    text = log.read_text() if log.exists() else ""
    assert out.returncode == 0, f"{out.stdout[-2000:]}{out.stderr[-2000:]}\n--- {log} ---\n{text[-6000:]}"
    print(f"the pipeline as a deployment run on the namespace cluster: {time.monotonic() - t:.0f} s", file=sys.stderr)
    assert (repo / "params.yaml").read_text() == user_params  # the overrides were this run's only

    # Every training stage ran as one Slurm job over both nodes ("--- stage X": the flow's log, tasks/run/log.py).
    parts = re.split(r"^--- stage (\S+)\n", text, flags=re.M)
    stages = dict(zip(parts[1::2], parts[2::2]))
    for model_stage in MODEL_STAGES:
        assert_on_both_nodes(cluster, stages.get(model_stage, ""), model_stage)
    assert_bitwise_equal(weights(repo), local_weights)

    # The flow run and its stages' runs, in the two databases on the login node's PostgreSQL
    server = with_driver(cluster.services["postgres"], None)
    flow_runs = _sql(database(server, "prefect"), "SELECT id, state_type FROM flow_run WHERE name = %s", (name,))
    assert [state for _, state in flow_runs] == ["COMPLETED"], flow_runs
    mlflow_db = database(server, "mlflow")
    curves = dict(_sql(mlflow_db, "SELECT s.value, count(m.step) FROM tags f JOIN tags s ON s.run_uuid = f.run_uuid "
                                  "JOIN metrics m ON m.run_uuid = f.run_uuid WHERE f.key = 'prefect.flow_run_id' AND "
                                  "f.value = %s AND s.key = 'astrai.stage' AND m.key = 'train/loss' GROUP BY s.value",
                       (str(flow_runs[0][0]),)))
    sft = TINY_PARAMS["sft"]
    assert curves.get("pretrain", 0) >= STEPS // 5 and curves.get("sft", 0) >= sft["max_steps"] // sft["log_every"], \
        curves  # every log_every steps, by rank 0 on n1
    model = yaml.safe_load(user_params)["register"]["model_name"]
    champion = _sql(mlflow_db, "SELECT v.version, v.status, v.source, t.value FROM registered_model_aliases a JOIN "
                               "model_versions v ON v.name = a.name AND v.version = a.version JOIN model_version_tags t "
                               "ON t.name = v.name AND t.version = v.version WHERE a.name = %s AND a.alias = "
                               "'champion' AND t.key = 'weights_sha256'", (model,))
    assert len(champion) == 1 and champion[0][1] == "READY", champion
    version, _, source, sha = champion[0]
    registration = json.loads((repo / "data" / "register" / "registration.json").read_text())
    assert registration["version"] == version, registration
    assert sha == sha256_file(model_dir(repo, registration["stage"]) / "model.safetensors")
    # the weights are where only the MLflow server reaches them (proxied artifacts), not at a path of the nodes
    location = _sql(mlflow_db, "SELECT artifact_location FROM logged_models WHERE model_id = %s",
                    (source.removeprefix("models:/"),))
    assert len(location) == 1 and location[0][0].startswith("mlflow-artifacts:/"), (source, location)

    # Served from node n2: the weights come through the MLflow server; the request crosses the bridge.
    addr, port, key = cluster.addr[cluster.ns["n2"]], 8000, "netns-test-key"
    serve_log = tmp_path / "serve.log"
    with serve_log.open("w") as f:
        proc = subprocess.Popen([*cluster.enter("n2"), VENV_BIN / "astrai", "serve", "--model",
                                 f"models:/{model}@champion", "--host", addr, "--port", str(port), "--api-key", key,
                                 "--engine-thread", "--no-compile"], cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"}, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(f"http://{addr}:{port}/health", proc.pid, serve_log, timeout=300)
        answer = served_completion(f"http://{addr}:{port}", model, key)
        assert answer["model"] == f"{model}/{version}" and answer["choices"][0]["text"], answer
    finally:
        stop_group(proc)


def _lose_a_node(cluster: NetnsCluster, project, node: str, how: str) -> tuple[str, float]:
    """Start pretrain on both nodes; at step 20 lose `node` (`how`: kill its processes, or set its link down);
    returns the stage's output and the seconds from the loss to the stage's exit (its error line last)."""
    repo, env = project
    shutil.rmtree(repo / "data/pretrain.ckpts", ignore_errors=True)
    proc = login_stage(cluster, repo, env)
    try:
        seen = lines_until(proc, "step 20/", timeout=300)
        assert proc.poll() is None, "".join(seen[-30:])
        t = time.monotonic()
        cluster.kill(node) if how == "kill" else cluster.link(node, up=False)
        rest = proc.communicate(timeout=300)[0]
        lost = time.monotonic() - t
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = "".join(seen) + rest
    print(f"node {node} lost ({how}): the stage failed {lost:.1f} s later: {out.strip().splitlines()[-1]}",
          file=sys.stderr)
    return out, lost


def _resumes_to_the_same_weights(cluster, project, local_weights) -> None:
    repo, env = project
    assert list((repo / "data/pretrain.ckpts").iterdir()), "no checkpoint to resume from"
    proc = login_stage(cluster, repo, env)
    try:
        out = proc.communicate(timeout=600)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-4000:]
    assert "resuming from" in out, out[-3000:]
    assert_bitwise_equal(weights(repo), local_weights)


@pytest.mark.parametrize("node, how", [("n2", "kill"), ("n2", "link down"), ("n1", "kill"), ("n1", "link down")])
def test_a_lost_node_fails_the_stage_with_one_line_and_the_rerun_resumes_bitwise(cluster, project, local_weights,
                                                                                  node, how):
    """A node dies mid-job, its processes killed, or its link goes down: n2 (rank 1), or n1 (rank 0, which also
    hosts the rendezvous): the job ends and the stage fails within peer_timeout + 2 x kill_wait seconds, its last
    line the error naming the lost peer; with the node back (slurmd restarted, link up) the stage run again resumes
    from the last checkpoint on the shared directory and ends bit for bit on the uninterrupted run's weights."""
    try:
        out, lost = _lose_a_node(cluster, project, node, how)
        last = out.strip().splitlines()[-1]
        assert last.startswith("astrai: error: "), out[-3000:]
        rank = "rank 1" if node == "n2" else "rank 0"
        assert cluster.addr[cluster.ns[node]] in last or f"lost {rank}" in last, last
        assert lost < TWO_NODES["peer_timeout"] + 2 * TWO_NODES["kill_wait"] + 30, out[-3000:]
    finally:  # the node back (slurmd restarted, link up), also when an assertion above failed
        cluster.heal()
    _resumes_to_the_same_weights(cluster, project, local_weights)
