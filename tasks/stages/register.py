"""Stage `register`: pick the chain's best model on one held-out metric, log it as an MLflow pyfunc model,
register a version, move the aliases.

The metric is `register.metric` in params (tasks/evaluation/metrics.py says which way is better): the registered model
is the best of the chain on it in the evaluation's metrics.json (a tie goes to the later stage), not blindly the last
one. Every new version gets alias `candidate`, and its model card as description (tasks/registry/model_card.py). Alias
`champion` moves to it only if it learned some task (no_skill) and its value of the same metric beats the current
champion's (or there is no champion, or the champion was registered without that metric); with a
registry lock (ASTRAI_REGISTRY_LOCK_URI / tracking.registry_lock_uri, a PostgreSQL advisory lock:
tasks/registry/lock.py) registrations of one name, on any machine, go one after the other, so that decision is a
compare-and-set. Weights already registered (the same sha256 of model.safetensors under the same name) are not
registered again: the stage reports that version and moves no alias. A flow run with a profile registers under
"<model_name>-<profile>" (the quick profile's throwaway models never become `astrai@candidate`), and every version is
tagged with its profile; `register.enabled: false` registers nothing. Each version
is tagged with the metric it was chosen by, the stage that trained it and its held-out metrics. The model's
artifacts are the checkpoint and its Hugging Face export (`hf`, see astrai_core/convert/hf.py), so a version loads with
transformers too; with `register.gguf: f32|q8_0` also one GGUF file for llama.cpp (`gguf`: artifacts/model.gguf). Alone: `astrai stage register`.
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
from astrai_core.checkpoint.model_dir import read_model_config
from astrai_core.convert.gguf_export import export_gguf
from astrai_core.convert.hf import export_hf
from astrai_core.runtime.errors import AstraiError
from astrai_core.runtime.io import sha256_file, write_json
from astrai_core.runtime.progress import advance, expect
from tasks.evaluation.metrics import METRICS, better
from tasks.evaluation.samples import sample_prompts
from tasks.registry.gate import (FORGETTING, GATE_ITEMS, PENDING, REGISTRATION, champion_record, gate, gate_record,
                                 no_skill, version_by_alias, versions_with_weights)
from tasks.registry.lock import registry_lock, registry_lock_uri
from tasks.registry.model_card import REGISTERED_MODEL, model_card, shape_line
from tasks.run.schema import Params
from tasks.run.table import CORPUS, MODEL_STAGES, model_dir
from tasks.run.tracking import FLOW_RUN_ENV

PREDICT_PARAMS = {"max_new_tokens": 64, "temperature": 0.0, "top_k": 0, "seed": 0}


def git_commit(project_dir: Path) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=project_dir, capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# What a run itself changes in a checkout (a run's params stand in for params.yaml while it lasts; DVC writes
# dvc.lock): not the code's state.
RUN_WRITES = ("params.yaml", "dvc.lock")


def git_dirty(project_dir: Path) -> str:
    """The tag git_dirty: "no" when the checkout's files are its commit's, else what differs (`git status
    --porcelain`: up to 10 paths, then a count), so that a model trained from uncommitted edits says so."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=normal"], cwd=project_dir,
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    changed = [line[3:] for line in out.splitlines() if line[3:].strip('"') not in RUN_WRITES]
    if not changed:
        return "no"
    more = f" and {len(changed) - 10} more" if len(changed) > 10 else ""
    return f"yes: {', '.join(changed[:10])}{more}"


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


def best_model(metrics: dict, metric: str) -> str:
    """The stage whose model is best on `metric` in the evaluation's metrics (`<stage>/<metric>`); a tie goes to the
    later stage of the chain."""
    scored = [s for s in MODEL_STAGES if f"{s}/{metric}" in metrics]
    if not scored:
        raise AstraiError(f"register.metric {metric!r}: no model of the chain has it in the evaluation's metrics")
    best = scored[0]
    for stage in scored[1:]:
        if not better(metric, metrics[f"{best}/{metric}"], metrics[f"{stage}/{metric}"]):
            best = stage
    return best


def champion_value(client: mlflow.MlflowClient, name: str, metric: str) -> tuple[str | None, float | None]:
    """(version, its tag `metric` as a number) of the current champion; (None, None) without one, and a value of
    None when the champion was registered without that metric."""
    champ = version_by_alias(client, name, "champion")
    if champ is None:
        return None, None
    value = champ.tags.get(metric)
    return str(champ.version), (float(value) if value is not None else None)


def claim_champion(client: mlflow.MlflowClient, name: str, version: str, metric: str, new: dict,
                   settle: float = 0.5) -> tuple[bool, str]:
    """Move alias `champion` to `version` if it passes the gate against the current champion (gate); returns
    (promoted, why).

    Another registration may decide at the same moment (two users, one registry), and MLflow has no
    compare-and-set for aliases. So after moving the alias this waits `settle` s and reads it again: if another
    version took it meanwhile, the comparison is made again against that one. Both sides end agreeing with the
    registry: the better version is champion, the other says it stays candidate.
    """
    value = new["values"][metric]
    compared: tuple[str | None, float | None, str] = (None, None, "")
    for _ in range(20):
        champ_version, champ = champion_record(client, name)
        if champ_version == version:
            return True, decision_line(version, metric, value, *compared)
        champ_value = champ["values"].get(metric) if champ else None
        why = ""
        if champ_value is not None:
            promote, why = gate(metric, new, champ)
            if not promote:
                verb = "beats" if better(metric, value, champ_value) else "does not beat"
                return False, (f"version {version} stays candidate: {metric} {value:.4f} {verb} champion "
                               f"version {champ_version}'s {champ_value:.4f} ({why})")
        compared = (champ_version, champ_value, why)
        try:
            client.set_registered_model_alias(name, "champion", version)
        except MlflowException:  # another registration set it at the same instant (sqlite: unique constraint)
            time.sleep(settle * random.random())
            continue
        time.sleep(settle * (1 + random.random()))  # let a racing registration's move land, then look again
    raise AstraiError(f"model {name!r}: alias champion keeps moving; another registration is racing this one")


def decision_line(version: str, metric: str, value: float, old_version: str | None, old_value: float | None,
                  why: str = "") -> str:
    if old_version is None:
        why = " (no previous champion)"
    elif old_value is None:
        why = f" (champion version {old_version} has no {metric} to compare)"
    else:
        why = f" beats version {old_version}'s {old_value:.4f}" + (f" ({why})" if why else "")
    return f"version {version} is champion: {metric} {value:.4f}{why}"


def register(params: Params, metrics_path: Path, out_dir: Path, project_dir: Path) -> dict:
    """Registers the best model of the chain under project_dir on `register.metric` in metrics_path (the evaluate
    stage's metrics.json). Must run inside an active MLflow run (the stage's). Writes out_dir/registration.json;
    returns it."""
    profile = params.register.profile
    name = params.register.model_name if profile == "default" else f"{params.register.model_name}-{profile}"
    metric = params.register.metric
    metrics = json.loads(metrics_path.read_text())
    stage = best_model(metrics, metric)
    value = float(metrics[f"{stage}/{metric}"])
    checkpoint_dir = model_dir(project_dir, stage)
    print(f"register: {stage}'s model is the chain's best on {metric} ({value:.4f}; "
          + ", ".join(f"{s} {metrics[f'{s}/{metric}']:.4f}" for s in MODEL_STAGES if f"{s}/{metric}" in metrics)
          + ")", flush=True)
    base = {"model_name": name, "profile": profile, "stage": stage, "metric": metric}
    if not params.register.enabled:
        return _report(out_dir, {**base, "registered": False, "version": None, "model_uri": None, "aliases": [],
                                 "champion_version": None, "decision": "register.enabled is false: nothing registered"})
    client = mlflow.MlflowClient()
    items_path = metrics_path.with_name("items.json")
    items = json.loads(items_path.read_text()) if items_path.is_file() else {}
    record = gate_record(metrics, items, stage)  # what the gate compares, item by item
    # Under the lock, "same weights already registered?", the new version and the champion decision are one step for
    # every registration of this name on any machine (see registry_lock); without one, claim_champion looks again.
    with registry_lock(registry_lock_uri(params), name) as locked:
        weights_sha256 = sha256_file(checkpoint_dir / "model.safetensors")
        # weights_sha256 is written with the version itself (one transaction), so this finds every version of these
        # weights, also one whose registration a kill cut short before its aliases: that one is finished here.
        same = versions_with_weights(client, name, weights_sha256)
        if same:
            # search_model_versions leaves aliases empty: the version itself has them
            mv = client.get_model_version(name, min(same, key=lambda v: int(v.version)).version)
            if mv.tags.get(REGISTRATION) == PENDING:
                print(f"register: version {mv.version} holds these weights but its registration was cut short "
                      f"(run {mv.tags.get('mlflow_run_id')}): finishing it", flush=True)
                return _decide(client, name, str(mv.version), metric, record, base, dict(mv.tags), out_dir, locked)
            decision = (f"version {mv.version} already holds these weights (sha256 {weights_sha256[:12]}): not "
                        "registered again; the aliases stay where they are")
            mlflow.set_tag("astrai.registration", decision)
            champion = champion_value(client, name, metric)[0]
            return _report(out_dir, {**base, "registered": False, "version": int(mv.version),
                                     "model_uri": f"models:/{name}/{mv.version}", "aliases": sorted(mv.aliases),
                                     "champion_version": int(champion) if champion else None, "decision": decision})

        # The Hugging Face export travels with the version as the model artifact "hf" (transformers loads it directly:
        # download_artifacts("models:/NAME@champion") has artifacts/hf). Options transformers lacks are registered
        # without it, and the tag hf_export says why.
        expect(2, "steps (Hugging Face export, MLflow model)")
        with tempfile.TemporaryDirectory() as tmp:
            artifacts = {"checkpoint": str(checkpoint_dir)}
            try:
                artifacts["hf"] = str(export_hf(checkpoint_dir, Path(tmp) / "hf"))
                hf_export = json.loads((Path(tmp) / "hf" / "config.json").read_text())["architectures"][0]
            except AstraiError as e:
                hf_export = f"none: {e}"
            advance()
            # register.gguf: the GGUF file as the artifact "gguf" (artifacts/model.gguf); the tag gguf_export says
            # its type, or why there is none.
            gguf_export = "none: register.gguf is null"
            if params.register.gguf:
                try:
                    artifacts["gguf"] = str(export_gguf(checkpoint_dir, Path(tmp) / "model.gguf", params.register.gguf))
                    gguf_export = params.register.gguf
                except AstraiError as e:
                    gguf_export = f"none: {e}"
            example = sample_prompts(params.evaluate.prompts, params.corpus.source, project_dir / CORPUS)[:1]
            info = mlflow.pyfunc.log_model(
                name="model",
                python_model=str(Path(__file__).parents[1] / "registry" / "pyfunc_model.py"),
                artifacts=artifacts,
                code_paths=[str(Path(astrai_core.__file__).parent)],
                # An input example (and predict's type hints) give the signature, params included, and spare the log
                # MLflow's warnings; MLflow runs predict on it once, so the logged model is known to load and answer.
                input_example=(example, PREDICT_PARAMS),  # the corpus's own text
                pip_requirements=[f"{p}=={version(p)}" for p in ("torch", "safetensors", "tokenizers", "numpy", "pydantic")],
            )
            advance()
        tags = {
            "git_commit": git_commit(project_dir),
            "git_dirty": git_dirty(project_dir),  # uncommitted edits the model was trained from
            "params_hash": params.digest(),
            "prefect_flow_run_id": os.environ.get(FLOW_RUN_ENV, "none"),
            "mlflow_run_id": mlflow.active_run().info.run_id,
            "register_metric": metric,  # what this version was chosen by and is compared with the champion on
            "stage": stage,  # which training stage of the chain made this model
            # its held-out metrics (evaluation of this model, not of the chain's last one)
            **{f"{k}{end}": f"{metrics[f'{stage}/{k}{end}']:.6f}" for k in METRICS for end in ("", "_low", "_high")
               if f"{stage}/{k}{end}" in metrics},
            **({FORGETTING: f"{record['values'][FORGETTING]:.6f}"} if FORGETTING in record["values"] else {}),
            "hf_export": hf_export,
            "gguf_export": gguf_export,
            "weights_sha256": weights_sha256,  # a later registration of the same weights finds this version
            "profile": profile,
            "corpus": params.corpus.source,  # what it learned from, for its card (tasks/registry/model_card.py)
            "model": shape_line(read_model_config(checkpoint_dir / "config.json")),
            "dvc_experiment": os.environ.get("DVC_EXP_NAME") or "none",  # `dvc exp show` / `dvc exp apply` name
            **dvc_hashes(project_dir),
        }
        mlflow.log_dict(record, GATE_ITEMS)  # in the version's run before the version exists: a later gate reads it
        # The version and all its tags in one step (one transaction in the store): never a version without them.
        mv = mlflow.register_model(info.model_uri, name, tags={**tags, REGISTRATION: PENDING}).version
        if not client.get_registered_model(name).description:  # the model's own page says what its versions are
            client.update_registered_model(name, description=REGISTERED_MODEL)
        return _decide(client, name, str(mv), metric, record, base, tags, out_dir, locked)



def _decide(client: mlflow.MlflowClient, name: str, mv: str, metric: str, record: dict, base: dict, tags: dict,
            out_dir: Path, locked: bool) -> dict:
    """A new version's aliases: candidate, and champion if it passes the gate against the champion; then its
    registration is done."""
    client.set_registered_model_alias(name, "candidate", mv)
    # Its card, as the version's description (the Models page shows it; `astrai export-hf` writes the same README.md)
    # and as the README.md of its Hugging Face export, which transformers users pull from the registry. The card names
    # the version, so it joins the export only now that the version exists.
    card = model_card(f"{name} version {mv}", f"models:/{name}/{mv}",
                      {k: v for k, v in tags.items() if k != REGISTRATION})
    client.update_model_version(name, mv, description=card)
    if not tags.get("hf_export", "none").startswith("none"):
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "README.md").write_text(card)
            logged = client.get_model_version(name, mv).source.removeprefix("models:/")  # the logged model's id
            client.log_model_artifact(logged, str(Path(tmp) / "README.md"), artifact_path="artifacts/hf")
    unskilled = no_skill(metric, record["values"])
    if unskilled:
        promote, decision = False, f"version {mv} stays candidate: {unskilled}"
    else:  # under the registry lock nothing else moves champion: the compare and the set are one step, no look again
        promote, decision = claim_champion(client, name, mv, metric, record, settle=0.0 if locked else 0.5)
    champion = mv if promote else champion_value(client, name, metric)[0]  # None: a first version left candidate
    client.set_model_version_tag(name, mv, REGISTRATION, "done")
    mlflow.set_tag("astrai.registration", decision)
    mlflow.log_text(decision + "\n", "registration_decision.txt")
    tags = {k: v for k, v in tags.items() if k != REGISTRATION}
    return _report(out_dir, {**base, "registered": True, "version": int(mv), "model_uri": f"models:/{name}/{mv}",
                             "aliases": ["candidate"] + (["champion"] if promote else []),
                             "champion_version": int(champion) if champion else None,
                             "decision": decision, "tags": tags})


def _report(out_dir: Path, result: dict) -> dict:
    print(f"register: {result['decision']}", flush=True)
    write_json(out_dir / "registration.json", result)
    return result
