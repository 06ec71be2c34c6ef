"""Stage `pretrain`: launch the training core with torchrun on the packed HDF5 data.

Alone: `astrai stage pretrain` (what dvc.yaml runs), or the core directly: `astrai train --config FILE --nproc N`.

With `pretrain.resume: auto` (the default) a run that crashed or was stopped continues from its newest
checkpoint in data/pretrain.ckpts (written every `checkpoint_every` steps and on SIGTERM) when the stage is run
again with the same params; after a successful run those checkpoints are deleted, so a later run (new code, new
data) starts from scratch.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

from astrai_core.config import TrainConfig
from astrai_core.distributed import resolve_nproc, run_torchrun
from astrai_core.io import write_json
from tasks.params import Params
from tasks.tokenizer import check_vocab_size


PROJECT_ROOT = Path(__file__).resolve().parents[1]


def train_config(params: Params, packed_dir: Path, tokenizer_path: Path, out_dir: Path) -> TrainConfig:
    p = params.pretrain
    return TrainConfig(
        model=params.model,
        optim=p.optim,
        train_data=str(packed_dir / "train.h5"),
        val_data=str(packed_dir / "validation.h5"),
        tokenizer=str(tokenizer_path),
        out_dir=str(out_dir),
        seq_len=p.seq_len,
        batch_size=p.batch_size,
        grad_accum=p.grad_accum,
        max_steps=p.max_steps,
        max_tokens=p.max_tokens,
        dtype=p.dtype,
        device=p.device,
        backend=p.backend,
        parallel=p.parallel,
        seed=p.seed,
        log_every=p.log_every,
        eval_every=p.eval_every,
        eval_batches=p.eval_batches,
        early_stopping_patience=p.early_stopping_patience,
        early_stopping_min_delta=p.early_stopping_min_delta,
        label_smoothing=p.label_smoothing,
        activation_checkpointing=p.activation_checkpointing,
        compile=p.compile,
        compile_cache_dir=str(PROJECT_ROOT / ".cache" / "torchinductor") if p.compile else None,
        checkpoint_every=p.checkpoint_every,
        keep_checkpoints=p.keep_checkpoints,
        resume=p.resume,
        two_stage=p.two_stage,
        init_from=p.init_from,
    )


def pretrain(
    params: Params,
    packed_dir: Path,
    tokenizer_path: Path,
    out_dir: Path,
    *,
    run_id: str | None = None,
    on_line: Callable[[str], None] = print,
) -> dict:
    """Train (or resume an interrupted run); the checkpoint lands in `out_dir` (written atomically by rank 0).
    Returns its summary."""
    p = params.pretrain
    check_vocab_size(tokenizer_path, params.model.vocab_size)  # a copied tokenizer's size is known only now
    cfg = train_config(params, packed_dir, tokenizer_path, out_dir)
    return launch(cfg, resolve_nproc(p.nproc, p.device), p.max_restarts, run_id=run_id, on_line=on_line)


def launch(cfg: TrainConfig, nproc: int, max_restarts: int = 0, *, run_id: str | None = None,
           on_line: Callable[[str], None] = print) -> dict:
    """Run the training core under torchrun with `cfg` (every training stage does); returns the summary of the
    checkpoint it wrote to cfg.out_dir. Metrics go to MLflow run `run_id` (rank 0 only)."""
    out_dir = Path(cfg.out_dir)
    config_path = out_dir.parent / f"{out_dir.name}.train_config.json"
    write_json(config_path, cfg.model_dump(mode="json"))
    env = dict(os.environ)
    if run_id:
        env["MLFLOW_RUN_ID"] = run_id
    on_line(f"{out_dir.name}: torchrun with {nproc} process(es), strategy {cfg.strategy}, config {config_path}")
    try:
        run_torchrun(config_path, nproc, env=env, on_line=on_line, max_restarts=max_restarts)
    finally:
        config_path.unlink(missing_ok=True)
    shutil.rmtree(cfg.checkpoints, ignore_errors=True)  # they only serve to resume an unfinished run
    return json.loads((out_dir / "summary.json").read_text())
