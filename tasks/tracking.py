"""MLflow for the stages: where the store is, the experiment, and one run per stage under the pipeline's run.

The Prefect flow opens a parent run and passes its id to every stage process as ASTRAI_PARENT_RUN_ID; each
stage opens a child run under it. A stage run by plain `dvc repro` (no parent) opens a top-level run.
The torchrun children learn the stage's run from MLFLOW_RUN_ID (see astrai_core.tracking).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Iterator

import mlflow

from astrai_core.tracking import mlflow_params as flatten  # the MLflow params of a config tree
from tasks.params import Params

PARENT_RUN_ENV = "ASTRAI_PARENT_RUN_ID"
FLOW_RUN_ENV = "ASTRAI_FLOW_RUN_ID"


def tracking_uri(params: Params, project_dir: Path) -> str:
    """MLFLOW_TRACKING_URI from the environment, else params.tracking.uri, else sqlite under mlflow/."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or params.tracking.uri
    if uri:
        return uri
    return f"sqlite:///{(project_dir / 'mlflow' / 'mlflow.db').resolve()}"


def setup(params: Params, project_dir: Path) -> str:
    """Point MLflow at the store and make sure the experiment exists; returns the experiment id."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    uri = tracking_uri(params, project_dir)
    mlflow.set_tracking_uri(uri)
    os.environ["MLFLOW_TRACKING_URI"] = uri  # for child processes (torchrun ranks)
    exp = mlflow.get_experiment_by_name(params.tracking.experiment)
    if exp is not None:
        exp_id = exp.experiment_id
    else:
        artifacts = None
        if uri.startswith("sqlite:///"):
            # Keep artifacts beside the sqlite file, not in whatever directory the process happens to run in.
            artifacts = (Path(uri.removeprefix("sqlite:///")).parent / "artifacts").resolve().as_uri()
        exp_id = mlflow.create_experiment(params.tracking.experiment, artifact_location=artifacts)
    mlflow.set_experiment(experiment_id=exp_id)
    return exp_id


@contextlib.contextmanager
def stage_run(stage: str, params: Params, project_dir: Path) -> Iterator[mlflow.ActiveRun]:
    """Open the stage's MLflow run (a child of ASTRAI_PARENT_RUN_ID when set) with its params logged."""
    setup(params, project_dir)
    parent = os.environ.get(PARENT_RUN_ENV) or None
    tags = {"astrai.stage": stage, "astrai.source": "prefect" if parent else "dvc"}
    if os.environ.get(FLOW_RUN_ENV):
        tags["prefect.flow_run_id"] = os.environ[FLOW_RUN_ENV]
    with mlflow.start_run(run_name=stage, parent_run_id=parent, nested=parent is not None, tags=tags) as run:
        section = params.model_dump(mode="json").get(stage)
        if isinstance(section, dict):
            mlflow.log_params(flatten(section, f"{stage}."))
        mlflow.log_text(json.dumps(params.model_dump(mode="json"), indent=2), "params.json")
        yield run
