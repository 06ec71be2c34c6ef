"""MLflow for the stages: where the store is, the experiment, and one run per stage under the pipeline's run.

The Prefect flow opens a parent run and passes its id to every stage process as ASTRAI_PARENT_RUN_ID; each
stage opens a child run under it. A stage run by plain `dvc repro` (no parent) opens a top-level run.
The torchrun children learn the stage's run from MLFLOW_RUN_ID (see astrai_core.training.metric_log). A DVC experiment's
stages, also those DVC runs in a temporary copy of the project, log to the project's own store (project_root).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import urllib.parse
import warnings
from pathlib import Path
from typing import Iterator

import mlflow
import yaml
from mlflow.exceptions import MlflowException

from astrai_core.runtime.errors import AstraiError
from astrai_core.runtime.proc import record
from astrai_core.training.config import TrainConfig
from astrai_core.training.metric_log import mlflow_params as flatten  # the MLflow params of a config tree
from tasks.run.schema import Params
from tasks.run.table import MODEL_STAGES

PARENT_RUN_ENV = "ASTRAI_PARENT_RUN_ID"
FLOW_RUN_ENV = "ASTRAI_FLOW_RUN_ID"
# The experiment's type ("Machine learning"), which MLflow's UI reads where its workflow switch does not decide
# (3.17's does: see ui_link).
EXPERIMENT_KIND, TRAINING_RUNS = "mlflow.experimentKind", "custom_model_development"
DVC_EXPERIMENT_TAG = "astrai.dvc_experiment"  # the DVC experiment a run belongs to (`dvc exp show` names it)


def ui_link(uri: str, experiment_id: str, run_id: str | None = None) -> str:
    """An experiment's (or one run's) page in MLflow's UI, opening on its runs: MLflow 3.x's UI opens experiments on
    its GenAI pages unless its URL says workflowType=machine_learning or the sidebar's switch was set to "Model
    training" (the browser remembers that). A tracking server's UI is at its URI (without a user and password: the
    link is printed); a local store's is `make mlflow-ui`'s, on MLFLOW_PORT where set (the Makefile's variable, and
    the port `mlflow server` takes from the environment), else 5000."""
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme.lower() in ("http", "https"):
        netloc = parts.netloc.rpartition("@")[2]
        base = urllib.parse.urlunsplit((parts.scheme.lower(), netloc, parts.path.rstrip("/"), "", ""))
    else:
        base = f"http://127.0.0.1:{os.environ.get('MLFLOW_PORT') or 5000}"
    page = f"experiments/{experiment_id}" + (f"/runs/{run_id}" if run_id else "")
    return f"{base}/#/{page}?workflowType=machine_learning"


def project_root(project_dir: Path) -> Path:
    """The project a stage runs for: project_dir itself, or the DVC repository whose experiment workspace it is.

    DVC runs a queued or `--temp` experiment in a copy under .dvc/tmp/exps/, deleted afterwards, and names the real
    repository in DVC_ROOT: what the project keeps (the MLflow store and registry) is the real repository's.
    """
    project_dir = Path(project_dir).resolve()
    root = os.environ.get("DVC_ROOT")
    if root and project_dir.is_relative_to(Path(root).resolve() / ".dvc" / "tmp" / "exps"):
        return Path(root).resolve()
    return project_dir


def tracking_uri(params: Params, project_dir: Path) -> str:
    """MLFLOW_TRACKING_URI from the environment, else params.tracking.uri, else sqlite under mlflow/. A relative
    sqlite path (sqlite:///mlflow/mlflow.db) is taken from the project's root (project_root), not the working
    directory, so a DVC experiment's temporary workspace logs to the project's store too."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or params.tracking.uri or "sqlite:///mlflow/mlflow.db"
    path = uri.removeprefix("sqlite:///")
    if uri.startswith("sqlite:///") and not Path(path).is_absolute():
        return f"sqlite:///{(project_root(project_dir) / path).resolve()}"
    return uri


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """One process at a time through a local sqlite store's first use: MLflow creates (migrates) the schema
    then, and two processes doing it at once crash one of them. Other stores handle their own concurrency."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    db = Path(uri.removeprefix("sqlite:///"))
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when the process dies
        yield


def setup(params: Params, project_dir: Path) -> str:
    """Point MLflow at the store and make sure the experiment exists; returns the experiment id."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # tqdm bars are noise in a stage's log
    uri = tracking_uri(params, project_dir)
    mlflow.set_tracking_uri(uri)
    os.environ["MLFLOW_TRACKING_URI"] = uri  # for child processes (torchrun ranks)
    with store_lock(uri):  # also makes "create the experiment if missing" one step
        exp = mlflow.get_experiment_by_name(params.tracking.experiment)
        if exp is None:
            artifacts = None
            if uri.startswith("sqlite:///"):
                # Keep artifacts beside the sqlite file, not in whatever directory the process happens to run in.
                artifacts = (Path(uri.removeprefix("sqlite:///")).parent / "artifacts").resolve().as_uri()
            try:  # created with its kind in one call: two pipelines starting at once do not both write the tag
                return _use(mlflow.create_experiment(params.tracking.experiment, artifact_location=artifacts,
                                                     tags={EXPERIMENT_KIND: TRAINING_RUNS}))
            except MlflowException as e:  # a server's store: another pipeline created it at the same moment
                if e.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                exp = mlflow.get_experiment_by_name(params.tracking.experiment)
        check_artifacts_here(uri, exp)
        if EXPERIMENT_KIND not in exp.tags:  # one made before the kind was set gets it too
            try:
                mlflow.MlflowClient().set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND, TRAINING_RUNS)
            except MlflowException:  # another pipeline set it at the same moment (a server's store): it is there
                if EXPERIMENT_KIND not in mlflow.get_experiment(exp.experiment_id).tags:
                    raise
    return _use(exp.experiment_id)


def check_artifacts_here(uri: str, exp) -> None:
    """A local sqlite store keeps its experiment's artifacts beside it (setup). A copied checkout's mlflow.db still
    names the original's folder (the location is absolute, recorded when the experiment was made): every run would
    write there. AstraiError naming both, before anything is logged. A location that is not another store's
    artifacts folder (one chosen when the experiment was made) is the user's choice and stays."""
    if not uri.startswith("sqlite:///") or not exp.artifact_location.startswith("file:"):
        return
    store = Path(uri.removeprefix("sqlite:///"))
    here = (store.parent / "artifacts").resolve()
    there = Path(urllib.parse.unquote(urllib.parse.urlparse(exp.artifact_location).path))
    if there != here and there.name == "artifacts" and (there.parent / store.name).exists():
        raise AstraiError(f"{uri.removeprefix('sqlite:///')}: experiment {exp.name!r} keeps its artifacts in {there}, "
                          f"not beside this store ({here}): a copy of another checkout's store; move this mlflow/ "
                          "folder away to start a store of this checkout's, or set tracking.uri to the original's")


def _use(exp_id: str) -> str:
    mlflow.set_experiment(experiment_id=exp_id)
    return exp_id


@contextlib.contextmanager
def stage_run(stage: str, params: Params, project_dir: Path) -> Iterator[mlflow.ActiveRun]:
    """Open the stage's MLflow run (a child of ASTRAI_PARENT_RUN_ID when set) with its params logged."""
    exp_id = setup(params, project_dir)
    close_dead_runs(exp_id, stage)
    parent = os.environ.get(PARENT_RUN_ENV) or None
    # host + pid let a later run tell a stage that was killed (its run left RUNNING) from one still going.
    tags = {"astrai.stage": stage, "astrai.source": "prefect" if parent else "dvc",
            "astrai.host": socket.gethostname(), "astrai.pid": str(os.getpid())}
    if os.environ.get(FLOW_RUN_ENV):
        tags["prefect.flow_run_id"] = os.environ[FLOW_RUN_ENV]
    if os.environ.get("DVC_EXP_NAME"):  # `dvc exp run` (workspace, queue or temp) names its experiment here
        tags[DVC_EXPERIMENT_TAG] = os.environ["DVC_EXP_NAME"]
    run = mlflow.start_run(run_name=stage, parent_run_id=parent, nested=parent is not None, tags=tags)
    try:
        record({"mlflow_run": run.info.run_id, "tracking_uri": mlflow.get_tracking_uri()})  # a kill: marked KILLED
        if section := stage_params(params, stage):
            mlflow.log_params(flatten(section, f"{stage}."))
        mlflow.log_text(json.dumps(params.model_dump(mode="json"), indent=2), "params.json")
        log_stage_inputs(stage, project_dir)
        yield run
    except BaseException:
        try:
            mlflow.end_run("FAILED")
        except MlflowException as e:  # the store may be what failed: the stage's own error stays the one reported
            why = str(e.message).splitlines()[0][:200]
            print(f"{stage}: could not mark MLflow run {run.info.run_id} FAILED ({why}); the next run of this stage on "
                  "this host will", file=sys.stderr, flush=True)
        raise
    mlflow.end_run("FINISHED")


def stage_params(params: Params, stage: str) -> dict:
    """The params.yaml section a stage's run shows as its params (`<stage>.<key>`). A training stage's training
    core logs the TrainConfig it trains with (TrainConfig.used: `optim.lr`, `dpo.beta`), so its run shows here only
    what the section says beyond that (nproc, max_restarts, enabled): no setting twice under two names."""
    section = params.model_dump(mode="json").get(stage)
    if not isinstance(section, dict) or stage not in MODEL_STAGES:
        return section or {}
    # `objective` is the TrainConfig's `dpo` / `grpo`
    return {k: v for k, v in section.items() if k not in TrainConfig.model_fields and k != "objective"}


def close_dead_runs(experiment_id: str, stage: str) -> None:
    """Mark FAILED the runs of `stage` left RUNNING by a process of this host that no longer exists (a stage
    killed with SIGKILL never ends its run)."""
    client = mlflow.MlflowClient()
    runs = client.search_runs([experiment_id], filter_string=f"tags.`astrai.stage` = '{stage}' and "
                              f"tags.`astrai.host` = '{socket.gethostname()}' and attributes.status = 'RUNNING'")
    for run in runs:
        pid = int(run.data.tags.get("astrai.pid", "0"))
        if pid and pid != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            client.set_tag(run.info.run_id, "astrai.ended", f"process {pid} was gone; marked failed by the next run")
            client.set_terminated(run.info.run_id, status="FAILED")


def log_stage_inputs(stage: str, project_dir: Path) -> None:
    """MLflow's Datasets column: each data directory the stage reads (its `data/` deps in dvc.yaml), named by
    its path, with the DVC hash dvc.lock records for it as digest (what `dvc checkout` would restore)."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset

    dvc_yaml, lock = project_dir / "dvc.yaml", project_dir / "dvc.lock"
    if not dvc_yaml.is_file() or not lock.is_file():
        return
    deps = (yaml.safe_load(dvc_yaml.read_text())["stages"].get(stage) or {}).get("deps", [])
    md5 = {out["path"]: out.get("md5", "") for s in (yaml.safe_load(lock.read_text()) or {}).get("stages", {}).values()
           for out in s.get("outs", [])}
    for dep in deps:
        if dep.startswith("data/") and md5.get(dep):
            with warnings.catch_warnings():  # MLflow registers its local source twice and warns of the ambiguity
                warnings.simplefilter("ignore", UserWarning)
                source = resolve_dataset_source(str((project_dir / dep).resolve()))
            dataset = MetaDataset(source, name=dep, digest=md5[dep].removesuffix(".dir"))
            try:
                mlflow.log_input(dataset, context=stage)
            except MlflowException as e:  # another pipeline inserted the same dataset (name, digest) at this moment:
                if e.error_code != "BAD_REQUEST":  # a server's PostgreSQL says UniqueViolation; now it is there
                    raise
                mlflow.log_input(dataset, context=stage)
