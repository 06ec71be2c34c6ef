"""Stage `register`: log the checkpoint as an MLflow pyfunc model, register a version, move the aliases.

Every new version gets alias `candidate`. Alias `champion` moves to it only if its test bits per character beat
the current champion's (or there is none). The model's artifacts are the checkpoint and its Hugging Face export
(`hf`, see astrai_core/hf.py), so a version loads with transformers too. Alone: `astrai stage register`.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import mlflow
import yaml
from mlflow.exceptions import MlflowException

import astrai_core
from astrai_core.errors import AstraiError
from astrai_core.hf import export_hf
from astrai_core.io import write_json
from tasks.params import Params
from tasks.tracking import FLOW_RUN_ENV

PREDICT_PARAMS = {"max_new_tokens": 64, "temperature": 0.0, "top_k": 0, "seed": 0}


def git_commit(project_dir: Path) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=project_dir, capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def dvc_hashes(project_dir: Path) -> dict[str, str]:
    """md5 of the corpus and packed-data outputs as recorded in dvc.lock (what `dvc checkout` restores)."""
    lock = project_dir / "dvc.lock"
    if not lock.is_file():
        return {}
    stages = (yaml.safe_load(lock.read_text()) or {}).get("stages", {})
    hashes = {}
    for stage in ("corpus", "pack"):
        for out in stages.get(stage, {}).get("outs", []):
            hashes[f"dvc_md5.{out['path']}"] = out.get("md5", "unknown")
    return hashes


def champion_bpc(client: mlflow.MlflowClient, name: str) -> tuple[str | None, float | None]:
    try:
        champ = client.get_model_version_by_alias(name, "champion")
    except MlflowException:
        return None, None
    bpc = champ.tags.get("test_bits_per_char")
    return str(champ.version), (float(bpc) if bpc is not None else None)


def claim_champion(client: mlflow.MlflowClient, name: str, version: str, bpc: float,
                   settle: float = 0.5) -> tuple[bool, str]:
    """Move alias `champion` to `version` if its test bpc beats the current champion's; returns (promoted, why).

    Another registration may decide at the same moment (two users, one registry), and MLflow has no
    compare-and-set for aliases. So after moving the alias this waits `settle` s and reads it again: if another
    version took it meanwhile, the comparison is made again against that one. Both sides end agreeing with the
    registry: the better version is champion, the other says it stays candidate.
    """
    compared: tuple[str | None, float | None] = (None, None)
    for _ in range(20):
        champ_version, champ_bpc = champion_bpc(client, name)
        if champ_version == version:
            return True, decision_line(version, bpc, *compared)
        if champ_bpc is not None and bpc >= champ_bpc:
            return False, (f"version {version} stays candidate: test bpc {bpc:.4f} does not beat champion version "
                           f"{champ_version}'s {champ_bpc:.4f}")
        compared = (champ_version, champ_bpc)
        try:
            client.set_registered_model_alias(name, "champion", version)
        except MlflowException:  # another registration set it at the same instant (sqlite: unique constraint)
            time.sleep(settle * random.random())
            continue
        time.sleep(settle * (1 + random.random()))  # let a racing registration's move land, then look again
    raise AstraiError(f"model {name!r}: alias champion keeps moving; another registration is racing this one")


def decision_line(version: str, bpc: float, old_version: str | None, old_bpc: float | None) -> str:
    return (f"version {version} is champion: test bpc {bpc:.4f}"
            + (f" beats version {old_version}'s {old_bpc:.4f}" if old_bpc is not None else " (no previous champion)"))


def register(params: Params, checkpoint_dir: Path, metrics_path: Path, out_dir: Path, project_dir: Path) -> dict:
    """Must run inside an active MLflow run (the stage's). Writes out_dir/registration.json; returns it."""
    name = params.register.model_name
    metrics = json.loads(metrics_path.read_text())
    bpc = float(metrics["test_bits_per_char"])
    client = mlflow.MlflowClient()

    # The Hugging Face export travels with the version as the model artifact "hf" (transformers loads it directly:
    # download_artifacts("models:/NAME@champion") has artifacts/hf). Options transformers lacks are registered
    # without it, and the tag hf_export says why.
    with tempfile.TemporaryDirectory() as tmp:
        artifacts = {"checkpoint": str(checkpoint_dir)}
        try:
            artifacts["hf"] = str(export_hf(checkpoint_dir, Path(tmp) / "hf"))
            hf_export = json.loads((Path(tmp) / "hf" / "config.json").read_text())["architectures"][0]
        except AstraiError as e:
            hf_export = f"none: {e}"
        info = mlflow.pyfunc.log_model(
            name="model",
            python_model=str(Path(__file__).with_name("pyfunc_model.py")),
            artifacts=artifacts,
            code_paths=[str(Path(astrai_core.__file__).parent)],
            # An input example (and predict's type hints) give the signature, params included, and spare the log
            # MLflow's warnings; MLflow runs predict on it once, so the logged model is known to load and answer.
            input_example=(["ROMEO.\n"], PREDICT_PARAMS),
            pip_requirements=[f"{p}=={version(p)}" for p in ("torch", "safetensors", "tokenizers", "numpy", "pydantic")],
            registered_model_name=name,
        )
    mv = info.registered_model_version
    tags = {
        "git_commit": git_commit(project_dir),
        "params_hash": params.digest(),
        "prefect_flow_run_id": os.environ.get(FLOW_RUN_ENV, "none"),
        "mlflow_run_id": mlflow.active_run().info.run_id,
        "test_bits_per_char": f"{bpc:.6f}",
        "final_stage": str(metrics.get("final_model", "pretrain")),  # which training stage made this model
        **{k.split("/")[1]: f"{v:.6f}" for k, v in metrics.items()
           if k.startswith(f"{metrics.get('final_model')}/") and k.split("/")[1] in ("task_accuracy", "preference_accuracy")},
        "hf_export": hf_export,
        **dvc_hashes(project_dir),
    }
    for key, value in tags.items():
        client.set_model_version_tag(name, str(mv), key, value)
    client.set_registered_model_alias(name, "candidate", str(mv))

    promote, decision = claim_champion(client, name, str(mv), bpc)
    mlflow.set_tag("astrai.registration", decision)
    mlflow.log_text(decision + "\n", "registration_decision.txt")

    result = {"model_name": name, "version": int(mv), "model_uri": f"models:/{name}/{mv}", "aliases": ["candidate"] + (["champion"] if promote else []),
              "champion_version": int(mv) if promote else int(champion_bpc(client, name)[0]),
              "decision": decision, "tags": tags}
    write_json(out_dir / "registration.json", result)
    return result
