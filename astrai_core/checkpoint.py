"""Checkpoint directories: everything needed to use (and audit) a trained model, written atomically.

    model.safetensors   weights (a tied lm_head is stored once, as embed_tokens.weight); or, in a resumable checkpoint
                        written with checkpoint_format "sharded":
    dcp/                the model and optimizer state as torch.distributed.checkpoint files, each rank's shards
                        written by that rank (.metadata + __<rank>_<i>.distcp), nothing gathered; loads under any
                        parallelism and number of ranks (train.Trainee.restore)
    config.json         ModelConfig
    tokenizer.json      the tokenizer the model was trained with
    train_config.json   the resolved TrainConfig (when given)
    train_state.pt      step, epoch, consumed samples/tokens, sampler position, optimizer (unless in dcp/), scheduler
                        and callback state, every rank's RNG states (when given; loads with
                        torch.load(weights_only=True))
    summary.json        run summary: final losses, throughput, ... (when given)
    <extra files>       copied in as they are (e.g. metrics.jsonl)
    manifest.json       sha256 of every file above (those under dcp/ too, by relative path)

The directory is built beside `out_dir` and renamed into place, so readers never see a half-written checkpoint.

Resumable checkpoints of a run live in one directory (TrainConfig.checkpoints):

    step_00000100/      a checkpoint directory as above, with train_state.pt
    step_00000200/
    latest              the name of the newest complete one ("step_00000200"), replaced after it is in place

save_resumable writes one, moves `latest`, then deletes all but the newest K; find_resumable returns the newest
one whose manifest verifies, skipping (with a warning) any that is corrupt or incomplete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from pydantic import BaseModel
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from astrai_core.config import ModelConfig
from astrai_core.errors import AstraiError
from astrai_core.io import CHECKPOINT, atomic_path, sha256_file
from astrai_core.model import Transformer

REQUIRED_FILES = ("config.json", "tokenizer.json")
WEIGHT_FILES = ("model.safetensors", "dcp/.metadata")  # a checkpoint has one: full or sharded


def save_checkpoint(
    out_dir: str | os.PathLike,
    model: Transformer,
    model_cfg: ModelConfig,
    tokenizer_path: str | os.PathLike,
    extra: dict | None = None,
    *,
    train_config: BaseModel | None = None,
    train_state: dict[str, Any] | None = None,
    files: Iterable[str | os.PathLike] = (),
    model_state: Mapping[str, torch.Tensor] | None = None,
    shards: str | os.PathLike | None = None,
    kind: str = CHECKPOINT,
    force: bool = False,
    inputs: Iterable[str | os.PathLike] = (),
) -> Path:
    """Write the checkpoint directory `out_dir` (replacing any previous one) and return its path.

    `model` must be the bare Transformer (not DDP- or compile-wrapped) so the state dict keys are plain;
    `model_state` (e.g. a sharded model's gathered full state dict) replaces model.state_dict() when given.
    `shards`: a directory of torch.distributed.checkpoint files (every rank's shards of the model and optimizer,
    written beside `out_dir` by dcp.save); it is moved in as dcp/ and no model.safetensors is written.
    `kind`, `force`, `inputs`: whether an existing `out_dir` may be replaced (astrai_core.io.check_output).
    """
    with atomic_path(out_dir, kind, force=force, inputs=inputs) as tmp:
        tmp.mkdir()
        if shards is not None:
            Path(shards).rename(tmp / "dcp")  # the same filesystem: both live beside out_dir
        else:
            state = model.state_dict() if model_state is None else model_state
            state = {k: v.detach().cpu().contiguous() for k, v in state.items()}
            if model_cfg.tie_embeddings:
                # safetensors refuses tensors that share storage; load_model re-ties lm_head to embed_tokens.
                state.pop("lm_head.weight", None)
            save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        _write_json(tmp / "config.json", model_cfg.model_dump())
        shutil.copyfile(tokenizer_path, tmp / "tokenizer.json")
        template = Path(tokenizer_path).with_name("chat_template.jinja")  # the chat format goes with its tokenizer
        if template.is_file():
            shutil.copyfile(template, tmp / template.name)
        if train_config is not None:
            _write_json(tmp / "train_config.json", train_config.model_dump())
        if train_state is not None:
            torch.save(train_state, tmp / "train_state.pt")
        if extra is not None:
            _write_json(tmp / "summary.json", extra)
        for f in files:
            shutil.copyfile(f, tmp / Path(f).name)
        manifest = {p.relative_to(tmp).as_posix(): sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        _write_json(tmp / "manifest.json", {"files": manifest})
    return Path(out_dir)


STEP_DIR = re.compile(r"^step_(\d{8,})$")


def save_resumable(root: str | os.PathLike, step: int, keep: int, **checkpoint) -> Path:
    """Write checkpoint `root/step_<step>` (save_checkpoint's arguments), point `root/latest` at it, then delete
    all but the newest `keep` checkpoints. A crash at any point leaves `latest` naming a complete checkpoint."""
    root = Path(root)
    path = save_checkpoint(root / f"step_{step:08d}", **checkpoint)
    with atomic_path(root / "latest", "checkpoint pointer") as tmp:
        tmp.write_text(path.name + "\n")
    for old in _step_dirs(root)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def find_resumable(root: str | os.PathLike) -> Path | None:
    """The newest checkpoint under `root` whose files match its manifest and that holds a training state, or None.
    Corrupt or incomplete ones are skipped with a warning."""
    for path in _step_dirs(Path(root)):
        try:
            if "train_state.pt" not in verify_checkpoint(path):
                raise AstraiError(f"{path}: no train_state.pt; not resumable")
            return path
        except AstraiError as e:
            warnings.warn(f"skipping checkpoint: {e}", stacklevel=2)
    return None


def clear_resumable(root: str | os.PathLike) -> None:
    """Delete every checkpoint under `root` (a fresh run must not later resume from another run's state)."""
    root = Path(root)
    for path in _step_dirs(root):
        shutil.rmtree(path, ignore_errors=True)
    (root / "latest").unlink(missing_ok=True)


def _step_dirs(root: Path) -> list[Path]:
    """step_* directories, newest first (staging directories start with a dot and never match)."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def verify_checkpoint(ckpt_dir: str | os.PathLike) -> dict[str, str]:
    """Check every file against manifest.json; return the manifest's {name: sha256}. AstraiError on any mismatch."""
    ckpt_dir = Path(ckpt_dir)
    manifest_path = ckpt_dir / "manifest.json"
    if not manifest_path.is_file():
        raise AstraiError(f"{ckpt_dir}: not a checkpoint (manifest.json missing)")
    try:
        hashes: dict[str, str] = json.loads(manifest_path.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise AstraiError(f"{manifest_path}: unreadable manifest ({e})") from None
    for name in REQUIRED_FILES:
        if name not in hashes:
            raise AstraiError(f"{manifest_path}: {name} is not listed; the checkpoint is incomplete")
    if not any(name in hashes for name in WEIGHT_FILES):
        raise AstraiError(f"{manifest_path}: {' or '.join(WEIGHT_FILES)} is not listed; the checkpoint is incomplete")
    for name, expected in hashes.items():
        path = ckpt_dir / name
        if not path.is_file():
            raise AstraiError(f"{path}: missing (listed in manifest.json)")
        if sha256_file(path) != expected:
            raise AstraiError(f"{path}: sha256 does not match manifest.json; the file was modified or corrupted")
    return hashes


def load_weights(ckpt_dir: str | os.PathLike, tie_embeddings: bool) -> dict[str, torch.Tensor]:
    """The checkpoint's weights as a state dict; with tie_embeddings, lm_head.weight (stored once, as
    embed_tokens.weight) is put back, so a strict load_state_dict accepts it."""
    if not (Path(ckpt_dir) / "model.safetensors").is_file() and (Path(ckpt_dir) / "dcp").is_dir():
        raise AstraiError(f"{ckpt_dir}: a sharded training checkpoint (dcp/), only for resuming its run; use the "
                          "run's final model directory, which is always full")
    weights = load_file(Path(ckpt_dir) / "model.safetensors")
    if tie_embeddings:
        weights["lm_head.weight"] = weights["embed_tokens.weight"]
    return weights


def load_model(
    ckpt_dir: str | os.PathLike, device: str | torch.device = "cpu"
) -> tuple[Transformer, Tokenizer, ModelConfig]:
    """Verify and load a checkpoint: (model in eval mode on `device`, tokenizer, model config)."""
    ckpt_dir = Path(ckpt_dir)
    verify_checkpoint(ckpt_dir)
    cfg = ModelConfig.model_validate_json((ckpt_dir / "config.json").read_text())
    model = Transformer(cfg)
    try:  # strict: a missing, unexpected or misshapen tensor is refused
        model.load_state_dict(load_weights(ckpt_dir, cfg.tie_embeddings))
    except (RuntimeError, KeyError) as e:
        detail = " ".join(str(e).split())[:300]  # one line
        raise AstraiError(f"{ckpt_dir / 'model.safetensors'}: does not match config.json ({detail})") from None
    assert not cfg.tie_embeddings or model.lm_head.weight is model.embed_tokens.weight
    tokenizer = Tokenizer.from_file(str(ckpt_dir / "tokenizer.json"))
    return model.to(device).eval(), tokenizer, cfg


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
