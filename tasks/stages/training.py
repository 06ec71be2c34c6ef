"""The training stages of the stage table (tasks/run/table.py: pretrain -> sft -> dpo -> grpo): each is the training
core under torchrun, configured by the TrainConfig of its params.yaml section (tasks/run/configs.py train_config: the
section's RunSettings and its strategy's settings, the model, the paths). Alone: `astrai stage NAME`.

Each post-training stage starts from the previous enabled stage's model, and trains its shape; a disabled one
(`enabled: false`) writes only skipped.json and the next stage starts from the model before it. Pretraining starts
from `pretrain.init_from` (any model reference: tasks/registry/models.py) when it is set; with `pretrain.enabled: false`
its output is that model as it is, so post-training fine-tunes it.

Resuming (`resume: auto`, the default): a run that crashed or was stopped continues from its newest checkpoint in
data/<stage>.ckpts (written every `checkpoint_every` steps and on SIGTERM) when the stage is run again with the
same params; after a successful run those checkpoints are deleted, so a later run starts from scratch.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

from pydantic import ValidationError

from astrai_core.checkpoint.model_dir import read_model_config
from astrai_core.model.config import ModelConfig
from astrai_core.runtime.errors import AstraiError
from astrai_core.runtime.io import CHECKPOINT, atomic_path, write_json
from astrai_core.training.config import TrainConfig
from astrai_core.training.distributed import launch, resolve_nproc
from astrai_core.training.train import check_train_inputs
from tasks.run.configs import start_model, train_config
from tasks.run.params import validation_message
from tasks.run.schema import Params
from tasks.run.table import TOKENIZER, TRAINING, model_dir, previous_model


def write_skipped(out_dir: Path, why: str, kind: str = CHECKPOINT) -> None:
    """A disabled stage's output folder: skipped.json says why (`kind`: what the stage writes there otherwise)."""
    with atomic_path(out_dir, kind) as tmp:
        tmp.mkdir()
        write_json(tmp / "skipped.json", {"skipped": why})


def train_stage(params: Params, stage: str, root: Path, *, run_id: str | None = None,
                on_line: Callable[[str], None] = print) -> dict | None:
    """Run training stage `stage` (pretrain, sft, dpo or grpo); returns the run summary, None when disabled."""
    section = getattr(params, stage)
    if TRAINING[stage].post_training:
        if not section.enabled:
            write_skipped(model_dir(root, stage), f"{stage}.enabled is false")
            on_line(f"{stage}: disabled; the next stage starts from {previous_model(root, stage)}")
            return None
        return _launch(params, stage, root, start_model(params, root, stage), run_id, on_line)
    if not section.init_from:
        return _launch(params, stage, root, None, run_id, on_line)
    from tasks.registry.models import local_model

    with local_model(section.init_from, root) as start:
        if note := check_start_shape(params, start):
            on_line(note)
        if section.enabled:
            return _launch(params, stage, root, start, run_id, on_line)
        with atomic_path(model_dir(root, stage), CHECKPOINT) as tmp:
            shutil.copytree(start, tmp)
        on_line(f"pretrain: disabled; post-training starts from pretrain.init_from ({section.init_from}), copied to "
                f"{model_dir(root, stage)}")
        return None


def check_start_shape(params: Params, start: Path) -> str | None:
    """With pretrain.init_from the shape is the model's (`start`, its checkpoint), whatever params.yaml's `model:`
    says: the demo's keys there need no edit to fine-tune a published model. Returns a line naming the keys written
    there that the model overrides (compared with defaults resolved), or None when they agree."""
    shape = read_model_config(start / "config.json")
    written = params.model.model_dump(include=params.model.model_fields_set)
    mine = ModelConfig(**{**shape.model_dump(), **written})
    differ = [k for k in mine.differences(shape) if k in written]
    if not differ:
        return None
    return (f"model: the shape of pretrain.init_from ({params.pretrain.init_from}), not params.yaml's: "
            + ", ".join(f"{k} {getattr(shape, k)} (params.yaml: {getattr(mine, k)})" for k in differ))


def _launch(params: Params, stage: str, root: Path, start: Path | None, run_id: str | None,
            on_line: Callable[[str], None]) -> dict:
    """Launch `stage` under torchrun (or Slurm). A stage that starts from a model (`start`) trains that model's
    shape and tokenizer (the tokenizer stage copied pretrain.init_from's)."""
    from tasks.stages.tokenizer import check_vocab_size

    section = getattr(params, stage)
    cfg = train_config(params, stage, root)
    if start is not None and (start / "config.json").is_file():  # a missing start: check_train_inputs says so
        try:
            cfg = TrainConfig(**{**cfg.model_dump(), "model": read_model_config(start / "config.json"),
                                 "init_from": str(start)})
        except ValidationError as e:  # e.g. this stage's seq_len beyond the start model's context
            raise AstraiError(f"params.yaml: {stage}: {validation_message(e)}, the shape of the model it starts "
                              f"from ({start / 'config.json'})") from None
    check_vocab_size(root / TOKENIZER / "tokenizer.json", cfg.model.vocab_size)  # a copied tokenizer: only now
    check_train_inputs(cfg)  # a missing or corrupt input: one line, before torchrun or sbatch
    if params.cluster.launcher == "slurm":
        from tasks.run.checks import check_cluster
        from tasks.run.slurm import launch_slurm

        check_cluster(params, root)
        return launch_slurm(cfg, params.cluster, params.cluster.ranks_per_node(section.nproc), section.max_restarts,
                            root, run_id=run_id, on_line=on_line)
    return launch(cfg, resolve_nproc(section.nproc, section.device), section.max_restarts, run_id=run_id,
                  on_line=on_line)
