"""The team services on PostgreSQL (`astrai services start|stop`, astrai/services.py): a real PostgreSQL 15 in a temp
directory, the MLflow tracking server on it with proxied artifacts, the Prefect server on it and a process worker,
all on loopback ports. Two checkouts pointed at them by settings alone run the quick pipeline at once, each as a
deployment run; their runs, registered versions (two, once each), tags and aliases are then in PostgreSQL, checked
in its tables. `astrai promote` copies the champion to MODEL-prod under the registry lock, and `astrai serve` pulls
it through the MLflow server. Two registrations racing into one registry decide the champion one after the other
(tasks/registry/lock.py registry_lock).

Skipped with the reason where Debian's postgresql-15 or root (PostgreSQL then runs as user postgres) is missing;
ASTRAI_REQUIRE_POSTGRES=1 (set by .ci/run) turns the skip into a failure.
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from conftest import PROJECT_ROOT, VENV_BIN, free_port, make_deploy, make_project, run_ok, served_completion, stop_group

pytestmark = pytest.mark.integration

MODEL = "astrai-team-test"


def _require_postgres() -> None:
    from astrai.services import PG_BIN, PG_USER

    why = None
    if not (PG_BIN / "initdb").exists():
        why = f"no PostgreSQL in {PG_BIN} (apt-get install postgresql-15)"
    elif os.geteuid() != 0:
        why = f"the test PostgreSQL runs as user {PG_USER}, which needs root"
    elif subprocess.run(["id", PG_USER], capture_output=True).returncode != 0:
        why = f"no user {PG_USER} to run PostgreSQL as"
    if why:
        if os.environ.get("ASTRAI_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"ASTRAI_REQUIRE_POSTGRES=1 but {why}")
        pytest.skip(why)


@pytest.fixture(scope="module")
def services():
    """`astrai services start DIR` on free loopback ports; `astrai services stop DIR` afterwards, failed or not."""
    _require_postgres()
    d = Path(tempfile.mkdtemp(prefix="astrai-team-"))  # /tmp: user postgres must reach DIR/postgres
    d.chmod(0o755)
    astrai = str(VENV_BIN / "astrai")
    t0 = time.time()
    try:
        out = subprocess.run([astrai, "services", "start", str(d), "--pg-port", str(free_port()), "--mlflow-port",
                              str(free_port()), "--prefect-port", str(free_port())],
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout + out.stderr
        print(f"services up in {time.time() - t0:.0f} s", file=sys.stderr)
        env = dict(line.removeprefix("export ").split("=", 1) for line in out.stdout.splitlines())
        yield {"dir": d, "env": env, "state": json.loads((d / "services.json").read_text())}
    finally:
        subprocess.run([astrai, "services", "stop", str(d)], capture_output=True, timeout=300)
        shutil.rmtree(d, ignore_errors=True)


def _sql(uri: str, query: str) -> list[tuple]:
    import psycopg2

    conn = psycopg2.connect(uri)
    try:
        with conn.cursor() as cur:
            cur.execute(query)
            return cur.fetchall()
    finally:
        conn.close()


def _db(services, name: str) -> str:
    from astrai.services import database

    return database(services["state"]["postgres"], name)


def test_services_run_on_postgres(services):
    """Every process up, listening on loopback only, the two schemas migrated, the process pool there."""
    from astrai.services import _alive

    assert set(services["state"]["pids"]) == {"mlflow", "prefect", "worker"}
    assert all(_alive(pid) for pid in services["state"]["pids"].values())
    version = _sql(_db(services, "postgres"), "SHOW server_version")[0][0]
    assert version.startswith("15."), version
    assert _sql(_db(services, "mlflow"), "SELECT count(*) FROM alembic_version")[0][0] == 1
    assert _sql(_db(services, "prefect"), "SELECT name, type FROM work_pool WHERE name = 'astrai-local'") == \
        [("astrai-local", "process")]
    # `pg_ctl -o "-c listen_addresses=127.0.0.1"`: nothing else answers
    assert _sql(_db(services, "postgres"), "SHOW listen_addresses") == [("127.0.0.1",)]
    # `services env` prints again what start printed (while the servers run; after a stop it refuses)
    again = subprocess.run([str(VENV_BIN / "astrai"), "services", "env", str(services["dir"])], capture_output=True,
                           text=True, timeout=60)
    assert dict(line.removeprefix("export ").split("=", 1) for line in again.stdout.splitlines()) == services["env"]


def test_prefect_ui_calls_this_servers_api(services):
    """The UI's pages call the API at /ui-settings' api_url: the server's own port (the fixture's, never 4200), not
    Prefect's default of 127.0.0.1:4200."""
    import urllib.request

    api = services["env"]["PREFECT_API_URL"]
    with urllib.request.urlopen(f"{api.removesuffix('/api')}/ui-settings", timeout=30) as r:
        assert json.load(r)["api_url"] == api


def test_a_second_team_on_the_same_ports_is_refused(services):
    """Started beside the running team on its MLflow and Prefect ports, `start` used to exit 0 printing the running
    team's URLs while its own servers had died (address in use). Now: one line naming the ports, nothing started, and
    the running team untouched."""
    import urllib.parse

    mlflow_port = urllib.parse.urlsplit(services["env"]["MLFLOW_TRACKING_URI"]).port
    prefect_port = urllib.parse.urlsplit(services["env"]["PREFECT_API_URL"]).port
    d = Path(tempfile.mkdtemp(prefix="astrai-team2-"))
    d.chmod(0o755)  # user postgres must reach it, were a trial database started
    astrai = str(VENV_BIN / "astrai")
    try:
        out = subprocess.run([astrai, "services", "start", str(d), "--pg-port", str(free_port()), "--mlflow-port",
                              str(mlflow_port), "--prefect-port", str(prefect_port)],
                             cwd=d, capture_output=True, text=True, timeout=600)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1, (out.returncode, out.stdout, out.stderr)
        assert f"127.0.0.1:{mlflow_port} (--mlflow-port), 127.0.0.1:{prefect_port} (--prefect-port)" in lines[0]
        assert not (d / "services.json").exists() and out.stdout == ""
    finally:
        if (d / "services.json").exists():
            subprocess.run([astrai, "services", "stop", str(d)], capture_output=True, timeout=300)
        shutil.rmtree(d, ignore_errors=True)
    from astrai.services import _alive

    assert all(_alive(pid) for pid in services["state"]["pids"].values())


@pytest.fixture(scope="module")
def deployment_runs(services, tmp_path_factory):
    """Two people's quick pipelines started together as `prefect deployment run` on the services' worker, each from
    a checkout of its own that knows the services by environment alone (MLFLOW_TRACKING_URI, PREFECT_API_URL,
    ASTRAI_REGISTRY_LOCK_URI) and has a deployment of its own (`make deploy` names it after the checkout); b's
    pretrain seed differs, so its weights do. Both register under MODEL-quick."""
    prefect = str(VENV_BIN / "prefect")
    checkouts = {}
    for who, seed in (("a", None), ("b", 1338)):
        root = tmp_path_factory.mktemp(f"team-{who}")
        repo = root / "project"
        env = make_project(repo, root / "remote", MODEL)
        shutil.copytree(PROJECT_ROOT / "profiles", repo / "profiles")
        if seed is not None:
            params = (repo / "params.yaml").read_text()
            (repo / "params.yaml").write_text(params.replace("  seed: 1337\n", f"  seed: {seed}\n", 1))
        run_ok(["git", "add", "-A"], repo, env)
        run_ok(["git", "commit", "-q", "-m", "profiles"], repo, env)
        env.update(services["env"])
        env["PREFECT_HOME"] = str(root / "prefect")
        checkouts[who] = {"repo": repo, "env": env, "deployment": make_deploy(repo, env)}
    t0 = time.time()
    procs = {who: subprocess.Popen([prefect, "deployment", "run", c["deployment"], "-p", "profile=quick", "--watch",
                                    "--watch-timeout", "2400"], cwd=c["repo"], env=c["env"], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True) for who, c in checkouts.items()}
    outs = {who: p.communicate(timeout=2500)[0] for who, p in procs.items()}
    worker_log = (services["dir"] / "worker.log").read_text()
    assert all(p.returncode == 0 for p in procs.values()), (f"{outs}\n--- the worker log's errors ---\n" +
                                                       "\n".join(line for line in worker_log.splitlines()
                                                                 if "error" in line.lower())[-6000:])
    print(f"two deployment runs (quick profile) at once took {time.time() - t0:.0f} s", file=sys.stderr)
    return checkouts


@pytest.fixture(scope="module")
def deployment_run(deployment_runs):
    """The first person's checkout, after its pipeline ran."""
    return deployment_runs["a"]


def test_pipeline_runs_and_registers_through_the_servers(services, deployment_run, tmp_path):
    import mlflow

    client = mlflow.MlflowClient(services["env"]["MLFLOW_TRACKING_URI"])
    name = f"{MODEL}-quick"  # a profile's run registers under NAME-PROFILE
    mv = client.get_model_version_by_alias(name, "champion")
    assert "champion" in mv.aliases
    for tag in ("git_commit", "weights_sha256", "params_hash", "mlflow_run_id", "register_metric"):
        assert mv.tags.get(tag, "unknown") != "unknown", (tag, mv.tags)
    assert mv.tags["profile"] == "quick"
    assert mv.tags["prefect_flow_run_id"] != "none"

    # Runs and artifacts: every stage's run is a child of the flow's run, artifacts proxied by the server.
    exp = client.get_experiment_by_name("astrai")
    runs = client.search_runs([exp.experiment_id])
    stages = {r.data.tags.get("astrai.stage") for r in runs}
    assert {"pretrain", "sft", "dpo", "grpo", "evaluate", "register"} <= stages, stages
    assert all(r.info.artifact_uri.startswith("mlflow-artifacts:/") for r in runs), [r.info.artifact_uri for r in runs]
    assert client.download_artifacts(mv.run_id, "registration_decision.txt", str(tmp_path)).endswith(".txt")
    pretrain = next(r for r in runs if r.data.tags.get("astrai.stage") == "pretrain")
    assert len(client.get_metric_history(pretrain.info.run_id, "train/loss")) >= 2  # the ranks logged over HTTP

    # The same facts in PostgreSQL: the server wrote them there, not to a file of this machine.
    mlflow_db = _db(services, "mlflow")
    assert _sql(mlflow_db, f"SELECT version FROM registered_model_aliases WHERE name = '{name}' AND alias = "
                "'champion'") == [(int(mv.version),)]
    assert _sql(mlflow_db, f"SELECT count(*) FROM runs WHERE experiment_id = {exp.experiment_id}")[0][0] == len(runs)
    assert _sql(_db(services, "prefect"), "SELECT state_type FROM flow_run") == [("COMPLETED",)] * 2
    assert not (deployment_run["repo"] / "mlflow" / "mlflow.db").exists()  # no local store on the side


def test_two_pipelines_at_once_register_once_each(services, deployment_runs):
    """Both pipelines registered, under one name: in MLflow's tables, two versions, each once, each the weights of
    its checkout; `candidate` on the later one; `champion` where the register gate, run again here on the two
    versions' records, says; and each stage's report says what the tables show."""
    import mlflow

    from astrai_core.runtime.io import sha256_file
    from tasks.registry.gate import gate, version_record
    from tasks.run.table import model_dir

    name, db = f"{MODEL}-quick", _db(services, "mlflow")
    reports = {who: json.loads((c["repo"] / "data" / "register" / "registration.json").read_text())
               for who, c in deployment_runs.items()}
    assert all(r["registered"] for r in reports.values()), reports
    rows = _sql(db, f"SELECT version, run_id, status FROM model_versions WHERE name = '{name}' ORDER BY version")
    assert [v for v, _, _ in rows] == [1, 2] and len({run for _, run, _ in rows}) == 2, rows  # none lost or doubled
    assert {status for _, _, status in rows} == {"READY"}, rows
    assert sorted(r["version"] for r in reports.values()) == [1, 2], reports
    weights = dict(_sql(db, f"SELECT version, value FROM model_version_tags WHERE name = '{name}' AND key = "
                            "'weights_sha256'"))
    for who, r in reports.items():
        repo = deployment_runs[who]["repo"]
        assert weights[r["version"]] == sha256_file(model_dir(repo, r["stage"]) / "model.safetensors"), who
    assert weights[1] != weights[2]

    mlflow.set_tracking_uri(services["env"]["MLFLOW_TRACKING_URI"])  # version_record reads runs' artifacts
    client = mlflow.MlflowClient()
    first, second = (client.get_model_version(name, str(v)) for v in (1, 2))
    metric = second.tags["register_metric"]
    second_wins, why = gate(metric, version_record(second), version_record(first))
    champion = 2 if second_wins else 1
    aliases = dict(_sql(db, f"SELECT alias, version FROM registered_model_aliases WHERE name = '{name}'"))
    assert aliases == {"candidate": 2, "champion": champion}, (aliases, why)
    by_version = {r["version"]: r for r in reports.values()}
    assert "no previous champion" in by_version[1]["decision"], by_version
    assert ("champion" in by_version[2]["aliases"]) == second_wins, (by_version[2], why)
    print(f"two pipelines: versions 1 and 2, champion {champion} ({why})", file=sys.stderr)


def test_promote_to_prod_under_the_lock_and_serve_it(services, deployment_run, tmp_path):
    """`astrai promote models:/MODEL-quick@champion --to MODEL-prod` waits for the registry lock of MODEL-prod while
    another holder has it, then copies the version with its lineage, moves MODEL-prod@champion, and `astrai serve
    --model models:/MODEL-prod@champion` pulls those weights through the MLflow server and answers."""
    import mlflow

    from astrai.services import wait_healthy
    from tasks.registry.lock import registry_lock

    client = mlflow.MlflowClient(services["env"]["MLFLOW_TRACKING_URI"])
    source, target = client.get_model_version_by_alias(f"{MODEL}-quick", "champion"), f"{MODEL}-prod"
    env, astrai = deployment_run["env"], str(VENV_BIN / "astrai")
    with registry_lock(services["env"]["ASTRAI_REGISTRY_LOCK_URI"], target) as locked:
        assert locked
        proc = subprocess.Popen([astrai, "promote", f"models:/{MODEL}-quick@champion", "--to", target], cwd=tmp_path,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: [lines.append(line) for line in proc.stdout], daemon=True)
        reader.start()
        deadline = time.time() + 300
        while not any("waiting for another registration or promotion" in line for line in lines):
            assert proc.poll() is None and time.time() < deadline, lines  # it waits, and only for the lock
            time.sleep(0.5)
        assert _sql(_db(services, "mlflow"), f"SELECT count(*) FROM model_versions WHERE name = '{target}'") == [(0,)]
    assert proc.wait(timeout=300) == 0, lines
    reader.join(timeout=30)
    rest = "".join(lines)
    assert f"copied to {target} version 1, now {target}@champion; {target} has no champion" in rest, rest
    copy = client.get_model_version_by_alias(target, "champion")
    assert {k: copy.tags[k] for k in source.tags} == dict(source.tags)  # the lineage, every tag of the source
    assert copy.tags["promoted_from"] == f"models:/{MODEL}-quick/{source.version}"
    assert copy.tags["promoted_by"] == f"{getpass.getuser()}@{socket.gethostname()}"
    assert _sql(_db(services, "mlflow"), f"SELECT version FROM registered_model_aliases WHERE name = '{target}'") \
        == [(1,)]

    # astrai serve pulls the promoted version's weights through the MLflow server and answers.
    port = free_port()
    serve_env = {**env, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([astrai, "serve", "--model", f"models:/{target}@champion", "--port", str(port),
                             "--engine-thread", "--no-compile"], cwd=tmp_path, env=serve_env,
                            stdout=open(tmp_path / "serve.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc.pid, tmp_path / "serve.log", timeout=300)
        answer = served_completion(f"http://127.0.0.1:{port}", target)
        assert answer["model"] == f"{target}/1" and answer["choices"][0]["text"], answer
    finally:
        stop_group(proc)


def test_registrations_race_into_one_registry(services, deployment_run, tmp_path):
    """Three register stages at once on the pipeline's models: A and A2 register the chain's best (the same
    weights), B (metrics edited so another stage's model is better still) registers that one. Two versions exist,
    once each, and B's is champion, whichever decided first; each decision says what the registry shows."""
    from astrai_core.runtime.io import sha256_file
    from tasks.evaluation.metrics import better
    from tasks.run.params import load_params
    from tasks.run.table import MODEL_STAGES, model_dir
    from tasks.stages.register import best_model

    repo, env = deployment_run["repo"], deployment_run["env"]
    metrics = json.loads((repo / "data" / "evaluate" / "metrics.json").read_text())
    metric = load_params(repo / "params.yaml").register.metric  # what register compares on
    a_stage = best_model(metrics, metric)
    a_sha = sha256_file(model_dir(repo, a_stage) / "model.safetensors")
    other = next(s for s in MODEL_STAGES if f"{s}/{metric}" in metrics
                 and sha256_file(model_dir(repo, s) / "model.safetensors") != a_sha)
    step = 0.5 if better(metric, 1.0, 0.0) else -0.5  # which way is better for this metric
    # B: the other stage's model, scored as A's on everything but the register metric, where it is better by far
    # (a narrow interval: the gate, which has no per-item results here, compares the intervals)
    b_metrics = dict(metrics, **{k.replace(f"{a_stage}/", f"{other}/", 1): v for k, v in metrics.items()
                                 if k.startswith(f"{a_stage}/")})
    better_value = metrics[f"{a_stage}/{metric}"] + step
    b_metrics.update({f"{other}/{metric}": better_value, f"{other}/{metric}_low": better_value - 0.01,
                      f"{other}/{metric}_high": better_value + 0.01})
    (tmp_path / "b.json").write_text(json.dumps(b_metrics))
    code = ("import sys; from pathlib import Path; from tasks.run.params import load_params; "
            "from tasks.run.tracking import stage_run; from tasks.stages.register import register; "
            "p = load_params('params.yaml'); p.register.profile = 'race';\n"
            "with stage_run('register', p, Path('.')): register(p, Path(sys.argv[1]), Path(sys.argv[2]), Path('.'))")
    race_env = {**env, "PYTHONPATH": str(repo)}  # register.profile race: registers as MODEL-race
    a_metrics = repo / "data" / "evaluate" / "metrics.json"
    procs = {who: subprocess.Popen([sys.executable, "-c", code, str(path), str(tmp_path / who)], cwd=repo,
                                   env=race_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for who, path in (("a", a_metrics), ("a2", a_metrics), ("b", tmp_path / "b.json"))}
    outs = {who: p.communicate(timeout=600)[0] for who, p in procs.items()}
    assert all(p.returncode == 0 for p in procs.values()), outs
    reports = {who: json.loads((tmp_path / who / "registration.json").read_text()) for who in procs}
    print("waited for the lock:", {who: "waiting for another registration" in out for who, out in outs.items()},
          file=sys.stderr)

    import mlflow

    client = mlflow.MlflowClient(services["env"]["MLFLOW_TRACKING_URI"])
    name = f"{MODEL}-race"
    versions = client.search_model_versions(f"name = '{name}'")
    assert sorted(v.tags["stage"] for v in versions) == sorted([a_stage, other]), reports  # none doubled
    assert sorted(r["registered"] for r in reports.values()) == [False, True, True], reports
    assert reports["a"]["version"] == reports["a2"]["version"]
    champion = client.get_model_version_by_alias(name, "champion")
    assert champion.tags["stage"] == other and str(champion.version) == str(reports["b"]["version"])
    assert reports["b"]["aliases"] == ["candidate", "champion"]
    first, second = sorted((r for r in reports.values() if r["registered"]), key=lambda r: r["version"])
    assert "no previous champion" in first["decision"] and "no previous champion" not in second["decision"], reports


def test_champion_decisions_are_one_step_under_the_lock(services, monkeypatch):
    """The compare-and-set alone, made to race: two clients, each with its own session on PostgreSQL, decide at
    once. Each one's first read of the champion waits (up to 1 s) for the other's, then the worse one (version 2)
    is slower to act on it: without the lock both would read "no champion", the better one claim it and see it
    held, then the worse one claim it and see it held, both winning and the worse ending champion. Under the lock
    one decides first ("no previous champion"), the other compares with it."""
    import mlflow

    import tasks.stages.register as register
    from tasks.registry.lock import registry_lock
    from tasks.stages.register import claim_champion

    client = mlflow.MlflowClient(services["env"]["MLFLOW_TRACKING_URI"])
    lock_uri = services["env"]["ASTRAI_REGISTRY_LOCK_URI"]
    run = client.create_run("0")  # the versions' source: the server takes only sources of a run it knows
    read, first_read = register.champion_record, threading.local()

    def read_together(*args):
        value = read(*args)
        if not getattr(first_read, "done", False):
            first_read.done = True
            try:
                reads_met.wait(timeout=1)
            except threading.BrokenBarrierError:  # the other is waiting for the lock (or has decided)
                pass
            if first_read.version == "2":
                time.sleep(0.5)
        return value

    monkeypatch.setattr(register, "champion_record", read_together)
    for round_ in range(2):
        name = f"cas-{round_}"
        client.create_registered_model(name)
        bpc = {"1": 2.4, "2": 2.5}  # version 1 is better (bits per char: lower)
        for v, value in bpc.items():
            client.create_model_version(name, source=f"{run.info.artifact_uri}/model", run_id=run.info.run_id)
            client.set_model_version_tag(name, v, "test_bits_per_char", f"{value:.6f}")
        reads_met, results = threading.Barrier(2), {}

        def decide(version):
            first_read.done, first_read.version = False, version
            with registry_lock(lock_uri, name) as locked:
                assert locked
                new = {"values": {"test_bits_per_char": bpc[version]}, "items": {}, "item_sets": {}}
                results[version] = claim_champion(client, name, version, "test_bits_per_char", new, settle=0)

        threads = [threading.Thread(target=decide, args=(v,)) for v in bpc]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sum("no previous champion" in why for _, why in results.values()) == 1, (round_, results)
        assert str(client.get_model_version_by_alias(name, "champion").version) == "1", (round_, results)
        assert results["1"][0] is True, (round_, results)


def test_a_stage_logging_through_a_postgres_restart(services, data_tokenizer, core_write_packed, tmp_path):
    """PostgreSQL stopped for 5 s and started again under `astrai stage pretrain` (a tiny model, 300 steps, rank 0
    logging every step to the stage's run on the MLflow server): with the retries astrai_core/runtime/env.py sets, the
    stage finishes, its run is FINISHED and holds every step's metrics once. Without retries
    (MLFLOW_HTTP_REQUEST_MAX_RETRIES=0) an outage that lasts until the stage ends fails it with one line; its run, which
    it could not end while the database was down, is left RUNNING, and the stage run again marks it FAILED (its process
    is gone) and finishes."""
    import urllib.parse

    import mlflow
    import numpy as np
    import yaml

    from astrai.services import _pg, start_postgres
    from astrai_core.runtime.io import sha256_file

    d, db = services["dir"], _db(services, "mlflow")
    data = d / "postgres" / "data"
    port = urllib.parse.urlsplit(services["state"]["postgres"]).port
    project = tmp_path / "project"  # what pretrain reads: a tokenizer (the tokenizer stage's kind) and packed splits
    (project / "data" / "tokenizer").mkdir(parents=True)
    (project / "data" / "packed").mkdir(parents=True)
    data_tokenizer.save(str(project / "data" / "tokenizer" / "tokenizer.json"))
    vocab = data_tokenizer.get_vocab_size()
    ids = np.random.default_rng(0).integers(0, vocab, 1 << 14)
    for split in ("train", "validation"):
        core_write_packed(project / "data" / "packed" / f"{split}.h5", ids, split=split, vocab_size=vocab,
                          tokenizer_sha256=sha256_file(project / "data" / "tokenizer" / "tokenizer.json"))
    params = yaml.safe_load((PROJECT_ROOT / "params.yaml").read_text())
    params["tokenizer"]["vocab_size"] = params["model"]["vocab_size"] = vocab
    params["model"].update(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=32)
    params["pretrain"].update(nproc=1, seq_len=32, batch_size=4, max_steps=300, log_every=1, eval_every=0,
                              checkpoint_every=0, dtype="fp32")
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    client = mlflow.MlflowClient(services["env"]["MLFLOW_TRACKING_URI"])
    metrics = project / "data" / "pretrain.logs" / "metrics.jsonl"

    def run_stage(restart: bool, until_exit: bool = False, **env: str) -> tuple[subprocess.Popen, str, str, list[int],
                                                                                  bool]:
        """The stage from scratch; with `restart`, PostgreSQL down for 5 s once 20 steps are logged (`until_exit`:
        until the stage has ended, so that a metrics batch is sent while it is down, whenever the sender sends).
        Returns (its process, ended; its stderr; its MLflow run's id; the steps of its metrics.jsonl; whether it still
        ran when PostgreSQL was back)."""
        shutil.rmtree(project / "data" / "pretrain", ignore_errors=True)
        metrics.unlink(missing_ok=True)
        proc = subprocess.Popen([str(VENV_BIN / "astrai"), "stage", "pretrain"], cwd=project,
                                env={**os.environ, **services["env"], **env}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        if restart:
            deadline = time.time() + 300
            while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 20):
                assert proc.poll() is None and time.time() < deadline, proc.communicate()
                time.sleep(0.2)
            before = (data / "postmaster.pid").read_text().split()[0]
            _pg("pg_ctl", "-D", str(data), "-m", "fast", "-w", "stop", log=d / "postgres" / "pg_ctl.log")
            time.sleep(5)
            if until_exit:
                proc.wait(timeout=600)
            start_postgres(d, "127.0.0.1", port)
            assert (data / "postmaster.pid").read_text().split()[0] != before  # a new postmaster
        running = proc.poll() is None
        err = proc.communicate(timeout=600)[1]
        run = client.search_runs(["0", client.get_experiment_by_name("astrai").experiment_id],
                                 f"tags.`astrai.pid` = '{proc.pid}'")
        steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
        return proc, err, run[0].info.run_id, steps, restart and running

    survived, err, run_id, steps, through = run_stage(restart=True)
    assert through and survived.returncode == 0, err[-3000:]  # it ran (and logged) through the outage
    assert _sql(db, f"SELECT status FROM runs WHERE run_uuid = '{run_id}'") == [("FINISHED",)]
    logged = [s for (s,) in _sql(db, f"SELECT step FROM metrics WHERE run_uuid = '{run_id}' AND key = 'train/loss' "
                                     "ORDER BY step")]
    assert steps == list(range(1, 301)) and logged == steps  # every step, once, through the outage

    failed, err, dead_run, _, _ = run_stage(restart=True, until_exit=True, MLFLOW_HTTP_REQUEST_MAX_RETRIES="0")
    lines = err.strip().splitlines()
    assert failed.returncode != 0 and lines[-1].startswith("astrai: error: "), err[-3000:]
    print(f"without retries the stage failed with: {lines[-1]}", file=sys.stderr)
    assert _sql(db, f"SELECT status FROM runs WHERE run_uuid = '{dead_run}'") == [("RUNNING",)]

    rerun, err, run_id, _, _ = run_stage(restart=False)
    assert rerun.returncode == 0, err[-3000:]
    assert _sql(db, f"SELECT status FROM runs WHERE run_uuid IN ('{dead_run}', '{run_id}') ORDER BY status") == \
        [("FAILED",), ("FINISHED",)]
