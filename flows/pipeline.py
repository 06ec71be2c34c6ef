"""The `astrai-pipeline` Prefect flow: one task run per stage, each running that stage through DVC.

Why each task runs `dvc repro --single-item STAGE` instead of calling the stage function in-process: DVC then
records every run in dvc.lock itself, so after a Prefect run `dvc status` is clean and a later `dvc repro`
reruns nothing; a stage whose deps and params did not change is skipped by DVC in the flow too; and the
flow and `dvc repro` run literally the same command (`astrai stage STAGE`). The stage's output, the
training processes' included, is streamed line by line into the task's Prefect log.

Run locally: `astrai pipeline` (or `python -m flows.pipeline`). As a deployment: see README.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import mlflow
import yaml
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from astrai_core.proc import stream_process
from tasks import stages as S
from tasks.params import load_params, load_raw, parse_params, set_dotted
from tasks.tracking import FLOW_RUN_ENV, PARENT_RUN_ENV, flatten, setup

STAGE_ORDER = list(S.STAGES)


def dvc_command() -> list[str]:
    exe = shutil.which("dvc", path=os.path.dirname(sys.executable)) or shutil.which("dvc")
    return [exe] if exe else [sys.executable, "-m", "dvc"]


@task(task_run_name="{stage}", retries=0)
def run_dvc_stage(stage: str, project_dir: str, env: dict[str, str]) -> str:
    """Run one stage through DVC; returns "ran" or "skipped" (DVC found it up to date)."""
    logger = get_run_logger()
    skipped = False

    def on_line(line: str) -> None:
        nonlocal skipped
        skipped |= "didn't change, skipping" in line
        logger.info(line)

    stream_process(dvc_command() + ["repro", "--single-item", stage], env=env, cwd=project_dir,
                   on_line=on_line, what=f"dvc repro {stage}")
    return "skipped" if skipped else "ran"


def _apply_overrides(project_dir: Path, params_path: str, overrides: dict[str, Any] | None) -> None:
    """DVC reads params.yaml, so another params file or overrides are written there (as `dvc exp run -S` does)."""
    source = (project_dir / params_path).resolve()
    target = (project_dir / "params.yaml").resolve()
    if source == target and not overrides:
        return
    raw = load_raw(source)
    for key, value in (overrides or {}).items():
        set_dotted(raw, key, value)
    parse_params(raw, str(source))  # validate before touching params.yaml
    tmp = target.with_suffix(".yaml.tmp")
    tmp.write_text(yaml.safe_dump(raw, sort_keys=False))
    os.replace(tmp, target)


@flow(name="astrai-pipeline", log_prints=True)
def pipeline(params_path: str = "params.yaml", overrides: dict[str, Any] | None = None,
             project_dir: str | None = None) -> dict[str, Any]:
    """Corpus -> tokenizer -> pack -> pretrain -> chat_data -> sft -> dpo_reference -> dpo -> grpo -> evaluate ->
    register, one Prefect task per stage (a post-training stage disabled in params passes its input on).

    `overrides` maps dotted keys to values, e.g. {"pretrain.max_steps": 50}; they are validated and written
    into params.yaml so that DVC's record stays true.
    """
    logger = get_run_logger()
    root = Path(project_dir or os.getcwd()).resolve()
    _apply_overrides(root, params_path, overrides)
    params = load_params(root / "params.yaml")
    setup(params, root)

    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.setdefault("DVC_NO_ANALYTICS", "1")
    env[FLOW_RUN_ENV] = str(flow_run.get_id() or "none")
    with mlflow.start_run(run_name=f"pipeline {flow_run.get_name() or ''}".strip(),
                          tags={"astrai.stage": "pipeline", "prefect.flow_run_id": env[FLOW_RUN_ENV]}) as parent:
        mlflow.log_params(flatten(params.model_dump(mode="json")))
        env[PARENT_RUN_ENV] = parent.info.run_id
        status = {}
        for stage in STAGE_ORDER:
            status[stage] = run_dvc_stage(stage, str(root), env)
            if stage == "evaluate":
                _publish_evaluation(root)
        mlflow.log_dict(status, "stage_status.json")

    result = {
        "mlflow_tracking_uri": mlflow.get_tracking_uri(),
        "mlflow_experiment": params.tracking.experiment,
        "mlflow_parent_run_id": parent.info.run_id,
        "stages": status,
        "metrics": json.loads((root / S.EVALUATE / "metrics.json").read_text()),
        "registration": json.loads((root / S.REGISTER / "registration.json").read_text()),
        "samples": str(root / S.EVALUATE / "samples.md"),
    }
    logger.info("pipeline done: %s", json.dumps({k: result[k] for k in ("stages", "registration")}, default=str))
    return result


def _publish_evaluation(root: Path) -> None:
    table = (root / S.EVALUATE / "evaluation.md").read_text()
    samples = (root / S.EVALUATE / "samples.md").read_text()
    create_markdown_artifact(key="evaluation", markdown=f"{table}\n{samples}",
                             description="Every model of the chain on held-out data, and samples")


if __name__ == "__main__":
    print(json.dumps(pipeline(), indent=2, default=str))
