"""A training stage's params.yaml section -> the training core's TrainConfig: the section's RunSettings and its
strategy's settings, the model, and the paths of the stage table (tasks/run/table.py). Params builds each stage's
config when they are read (check_train_configs), so a bad setting stops the run then, naming its section."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from astrai_core.training.config import DPOConfig, TrainConfig
from tasks.run.schema import Params
from tasks.run.table import CHAT, DPO_REFERENCE, MODEL_STAGES, TOKENIZER, TRAINING, model_dir

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def start_model(params: Params, root: Path, stage: str) -> Path:
    """The model `stage` starts from: the previous enabled stage's (pretrain's own init_from is in its params)."""
    before = [s for s in MODEL_STAGES[: MODEL_STAGES.index(stage)]
              if not TRAINING[s].post_training or getattr(params, s).enabled]
    return model_dir(root, before[-1])


def dpo_pairs(params: Params, root: Path, split: str) -> Path:
    """The packed DPO pairs of `split` that dpo trains on and evaluate scores: on-policy ones are written by the
    dpo_reference stage, static ones by chat_data."""
    on_policy = params.dpo.enabled and params.dpo.rejected == "on_policy"
    return root / (DPO_REFERENCE if on_policy else CHAT) / f"dpo_{split}.h5"


def train_config(params: Params, stage: str, root: Path) -> TrainConfig:
    """The training core's config of `stage`: its section's RunSettings and strategy settings, the model, and the
    paths of the table under `root`."""
    entry, section = TRAINING[stage], getattr(params, stage)
    settings = section.run_settings().model_dump()
    if section.compile:
        settings["compile_cache_dir"] = str(PROJECT_ROOT / ".cache" / "torchinductor")  # compiled kernels persist
    data = {"train_data": str(root / entry.train_data) if entry.train_data else None,
            "val_data": str(root / entry.val_data) if entry.val_data else None}
    if entry.strategy == "seq":
        start = {"seq_len": section.seq_len, "two_stage": section.two_stage, "init_from": section.init_from}
    else:
        start = {"seq_len": params.pretrain.seq_len, "init_from": str(start_model(params, root, stage))}
    if entry.strategy == "dpo":  # on-policy or static pairs, against the reference log-probabilities of its start
        data = {"train_data": str(dpo_pairs(params, root, "train")),
                "dpo": DPOConfig(**section.objective.model_dump(),
                                 reference_logps=str(root / DPO_REFERENCE / "train_logps.h5"))}
    elif entry.strategy == "grpo":
        data["grpo"] = section.objective
    model = params.model
    if params.pretrain.init_from:  # the shape is the model's: checked against it when the stage starts (_launch)
        model = model.model_copy(update={"max_seq_len": max(model.max_seq_len, start["seq_len"])})
    return TrainConfig(**settings, **data, **start, model=model, strategy=entry.strategy,
                       tokenizer=str(root / TOKENIZER / "tokenizer.json"), out_dir=str(model_dir(root, stage)))


def check_train_configs(params: Params, root: Path) -> None:
    """Build every training stage's config: a setting the training core refuses stops the run when the params are
    read, with the section's key (ValueError `sft.optim.lr: ...`)."""
    for stage in MODEL_STAGES:
        try:
            train_config(params, stage, root)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise ValueError(f"{stage}{'.' + where if where else ''}: "
                             f"{err['msg'].removeprefix('Value error, ')}") from None
