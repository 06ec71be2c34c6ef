"""What `astrai stage NAME` (and so dvc.yaml) runs: each stage of the stage table (tasks/run/table.py) wired to its
MLflow run. A stage's runner calls its plain stage function on its inputs and outputs under the project (the table's
paths, which dvc.yaml lists as deps and outs) and logs what it made; every training stage has the same runner.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Callable

import mlflow

from astrai_core.runtime.progress import Progress
from tasks.run.schema import Params
from tasks.run.table import CHAT, CORPUS, EVALUATE, PACKED, REGISTER, STAGES, TOKENIZER, TRAINING, model_dir
from tasks.run.tracking import stage_run


def _corpus(params: Params, root: Path) -> None:
    from tasks.stages.corpus import build_corpus

    manifest = build_corpus(params.corpus, root / CORPUS)
    for split, info in manifest["splits"].items():
        mlflow.log_metrics({f"{split}_documents": info["documents"], f"{split}_characters": info["characters"]})
    mlflow.log_artifact(str(root / CORPUS / "manifest.json"))


def _tokenizer(params: Params, root: Path) -> None:
    from tasks.stages.tokenizer import build_tokenizer, copy_tokenizer

    if params.pretrain.init_from:  # the run's tokenizer is the model's it starts from
        from tasks.registry.models import local_model
        from tasks.stages.training import check_start_shape

        with local_model(params.pretrain.init_from, root) as start:
            if note := check_start_shape(params, start):  # said before pack and pretrain run
                print(note, flush=True)
            path = copy_tokenizer(str(start), root / TOKENIZER)
    else:
        path = build_tokenizer(params.tokenizer, root / CORPUS, root / TOKENIZER)
    mlflow.log_artifact(str(path))


def _pack(params: Params, root: Path) -> None:
    from tasks.stages.pack import pack

    stats = pack(params.pack, root / CORPUS, root / TOKENIZER / "tokenizer.json", root / PACKED)
    for split, info in stats.items():
        mlflow.log_metric(f"{split}_tokens", info["tokens"])


def _chat_data(params: Params, root: Path) -> None:
    from tasks.stages.chat_data import chat_data

    stats = chat_data(params, root / CORPUS, root / TOKENIZER / "tokenizer.json", root / CHAT,
                      replay_from=root / PACKED / "train.h5")
    mlflow.log_metrics({k: v for k, v in stats["packed"].items() if isinstance(v, int)})
    skipped = sum(v["count"] for v in stats["records"]["skipped"].values()) + len(stats["packed"]["problems"])
    mlflow.log_metric("skipped_records", skipped)
    mlflow.log_artifact(str(root / CHAT / "records" / "stats.json"))
    mlflow.log_artifact(str(root / CHAT / "pack_stats.json"))


def _train(stage: str) -> Callable[[Params, Path], None]:
    def run(params: Params, root: Path) -> None:
        from tasks.stages.training import train_stage

        summary = train_stage(params, stage, root, run_id=mlflow.active_run().info.run_id)
        if summary is None:
            mlflow.set_tag("astrai.skipped", f"{stage}.enabled is false")
            return
        mlflow.log_metrics({k if k.startswith("final_") else f"final_{k}": float(v) for k, v in summary.items()
                            if isinstance(v, (int, float)) and v is not None})
        if not TRAINING[stage].post_training:
            mlflow.log_artifact(str(model_dir(root, stage) / "config.json"))

    return run


def _dpo_reference(params: Params, root: Path) -> None:
    from tasks.stages.dpo_reference import dpo_reference

    info = dpo_reference(params, root)
    if info is not None:
        mlflow.log_metric("reference_mean_logp", info["mean_logp"])
        mlflow.set_tag("astrai.reference", info["reference"])


def _evaluate(params: Params, root: Path) -> None:
    from tasks.evaluation.checks import flag_tags
    from tasks.stages.evaluate import evaluate

    metrics, checks = evaluate(params, root, root / EVALUATE)
    mlflow.log_metrics({k.replace("/", "."): v for k, v in metrics.items() if isinstance(v, (int, float))})
    mlflow.set_tags(flag_tags(checks))  # a stage that did not beat its starting model, on the run's overview
    for name in ("evaluation.md", "chain.png", "curves.png", "samples.md", "metrics.json", "items.json",
                 "checks.json"):
        mlflow.log_artifact(str(root / EVALUATE / name))


def _register(params: Params, root: Path) -> None:
    from tasks.stages.register import register

    result = register(params, root / EVALUATE / "metrics.json", root / REGISTER, root)
    print(json.dumps(result, indent=2))


# Every stage of the table, in its order: the training stages share one runner, each other stage has its own.
OTHERS = {"corpus": _corpus, "tokenizer": _tokenizer, "pack": _pack, "chat_data": _chat_data,
          "dpo_reference": _dpo_reference, "evaluate": _evaluate, "register": _register}
RUNNERS: dict[str, Callable[[Params, Path], None]] = {
    s.name: _train(s.name) if s.name in TRAINING else OTHERS[s.name] for s in STAGES}


def run_stage(name: str, params: Params, project_dir: Path | None = None) -> None:
    """Run one stage in its own MLflow run (child of the pipeline's run when the flow started it). A stage other
    than training (whose step lines carry their eta) prints its progress at least every ASTRAI_PROGRESS_SECONDS
    (astrai_core/runtime/progress.py): what its loops count, how far they are, an eta."""
    if name not in RUNNERS:
        raise KeyError(f"unknown stage {name!r}; stages: {', '.join(RUNNERS)}")
    root = Path(project_dir or os.getcwd()).resolve()
    talk = contextlib.nullcontext() if name in TRAINING else Progress(name)
    with stage_run(name, params, root), talk:
        RUNNERS[name](params, root)
