"""The training stages pretrain -> sft -> dpo -> grpo: each is the training core under torchrun, configured by the
TrainConfig its params.yaml section became when the params were read (tasks/params.py train_config: the section's
RunSettings and objective, the model, the paths). Alone: `astrai stage NAME`.

Each post-training stage starts from the previous enabled stage's model; a disabled one (`enabled: false`) writes
only skipped.json and the next stage starts from the model before it.

Resuming (`resume: auto`, the default): a run that crashed or was stopped continues from its newest checkpoint in
data/<stage>.ckpts (written every `checkpoint_every` steps and on SIGTERM) when the stage is run again with the
same params; after a successful run those checkpoints are deleted, so a later run starts from scratch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from astrai_core.distributed import launch, resolve_nproc
from astrai_core.train import check_train_inputs
from astrai_core.errors import AstraiError
from astrai_core.io import CHECKPOINT, atomic_path, write_json
from tasks.layout import MODEL_STAGES, TOKENIZER, model_dir
from tasks.params import Params


def previous_model(root: Path, stage: str) -> Path:
    """The newest trained model before `stage` in MODEL_STAGES (skipped stages pass their input on)."""
    for name in reversed(MODEL_STAGES[: MODEL_STAGES.index(stage)]):
        d = model_dir(root, name)
        if (d / "model.safetensors").is_file():
            return d
    raise AstraiError(f"no trained model before stage {stage!r}; run the pretrain stage first")


def final_model(root: Path) -> Path:
    """The last trained model of the chain: what evaluation reports last and register registers."""
    return previous_model(root, "grpo") if not (model_dir(root, "grpo") / "model.safetensors").is_file() \
        else model_dir(root, "grpo")


def write_skipped(out_dir: Path, why: str, kind: str = CHECKPOINT) -> None:
    """A disabled stage's output folder: skipped.json says why (`kind`: what the stage writes there otherwise)."""
    with atomic_path(out_dir, kind) as tmp:
        tmp.mkdir()
        write_json(tmp / "skipped.json", {"skipped": why})


def train_stage(params: Params, stage: str, root: Path, *, run_id: str | None = None,
                on_line: Callable[[str], None] = print) -> dict | None:
    """Run training stage `stage` (pretrain, sft, dpo or grpo); returns the run summary, None when disabled."""
    section = getattr(params, stage)
    if stage == "pretrain":
        from tasks.tokenizer import check_vocab_size

        check_vocab_size(root / TOKENIZER / "tokenizer.json", params.model.vocab_size)  # a copied tokenizer: only now
    elif not section.enabled:
        write_skipped(model_dir(root, stage), f"{stage}.enabled is false")
        on_line(f"{stage}: disabled; the next stage starts from {previous_model(root, stage)}")
        return None
    check_train_inputs(params.train_config(stage))  # a missing or corrupt input: one line, before torchrun or sbatch
    if params.cluster.launcher == "slurm":
        from tasks.params import check_cluster
        from tasks.slurm import launch_slurm

        check_cluster(params, root)
        return launch_slurm(params.train_config(stage), params.cluster, params.cluster.ranks_per_node(section.nproc),
                            section.max_restarts, root, run_id=run_id, on_line=on_line)
    return launch(params.train_config(stage), resolve_nproc(section.nproc, section.device), section.max_restarts, run_id=run_id,
                  on_line=on_line)
