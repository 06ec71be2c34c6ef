"""Model directories: a trained model on disk, everything needed to use (and audit) it, written atomically.

    model.safetensors   weights (a tied lm_head is stored once, as embed_tokens.weight); or, in a resumable checkpoint
                        written with checkpoint_format "sharded":
    dcp/                the model and optimizer state as torch.distributed.checkpoint files, each rank's shards
                        written by that rank (.metadata + __<rank>_<i>.distcp), nothing gathered; loads under any
                        parallelism and number of ranks (Checkpointer.load in astrai_core/checkpoint/checkpointer.py)
    config.json         ModelConfig
    tokenizer.json      the tokenizer the model was trained with
    train_config.json   the resolved TrainConfig (when given)
    train_state.pt      step, epoch, consumed samples/tokens, sampler position, optimizer (unless in dcp/), scheduler
                        and callback state, every rank's RNG states (when given; loads with
                        torch.load(weights_only=True))
    summary.json        run summary: final losses, throughput, ... (when given)
    <extra files>       copied in as they are (e.g. metrics.jsonl)
    manifest.json       sha256 of every file above (those under dcp/ too, by relative path)

The directory is built beside `out_dir` and renamed into place, so readers never see a half-written one.
save_checkpoint writes one, verify_checkpoint checks it against its manifest and load_model loads it (the inference
engine, serving, evaluation, the registry, GGUF and Hugging Face export); load_weights, read_model_config and
read_safetensors read its parts. A training run's resumable checkpoints are model directories too, written and
resumed by astrai_core/checkpoint/checkpointer.py.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from pydantic import BaseModel, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from astrai_core.model.config import ModelConfig
from astrai_core.model.transformer import Transformer, estimated_params
from astrai_core.runtime.device import inference_dtype
from astrai_core.runtime.errors import AstraiError
from astrai_core.runtime.io import CHECKPOINT, atomic_path, sha256_file, write_json
from astrai_core.tokenizer.bpe import SPECIALS_FILE, read_tokenizer

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
    `kind`, `force`, `inputs`: whether an existing `out_dir` may be replaced (astrai_core.runtime.io.check_output).
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
        write_json(tmp / "config.json", model_cfg.model_dump())
        shutil.copyfile(tokenizer_path, tmp / "tokenizer.json")
        for name in ("chat_template.jinja", SPECIALS_FILE):  # the chat format and its special tokens go with it
            if (beside := Path(tokenizer_path).with_name(name)).is_file():
                shutil.copyfile(beside, tmp / name)
        if train_config is not None:
            write_json(tmp / "train_config.json", train_config.model_dump())
        if train_state is not None:
            torch.save(train_state, tmp / "train_state.pt")
        if extra is not None:
            write_json(tmp / "summary.json", extra)
        for f in files:
            shutil.copyfile(f, tmp / Path(f).name)
        manifest = {p.relative_to(tmp).as_posix(): sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        write_json(tmp / "manifest.json", {"files": manifest})
    return Path(out_dir)


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
    weights = read_safetensors(Path(ckpt_dir) / "model.safetensors")
    if tie_embeddings:
        weights["lm_head.weight"] = weights["embed_tokens.weight"]
    return weights


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors; AstraiError naming the file if it is truncated, empty or not one."""
    try:
        return load_file(path)
    except (SafetensorError, OSError) as e:
        raise AstraiError(f"{path}: not a readable safetensors file ({str(e).splitlines()[0]}); the file is "
                          "truncated or corrupt") from None


def read_model_config(path: Path) -> ModelConfig:
    """A checkpoint's config.json; AstraiError naming the file (and the key) if it is not a valid ModelConfig."""
    try:
        return ModelConfig.model_validate_json(path.read_bytes())
    except ValidationError as e:
        err = e.errors()[0]
        what = (f"not valid JSON ({err['ctx']['error']})" if err["type"] == "json_invalid" else
                f"{'.'.join(str(p) for p in err['loc']) or 'the model'}: {err['msg'].removeprefix('Value error, ')}")
        raise AstraiError(f"{path}: {what}") from None


def physical_memory() -> int:
    """Bytes of RAM on this machine."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits_in_memory(cfg: ModelConfig, where: str | os.PathLike, sizes: str | None = None) -> None:
    """Refuse, before anything is allocated, a model whose fp32 parameters alone exceed this machine's memory (a
    config with dim 1e9 would otherwise ask the allocator for terabytes). `sizes`: the config's keys to name."""
    need, have = 4 * estimated_params(cfg), physical_memory()
    if need > have:
        sizes = sizes or f"dim {cfg.dim}, n_layers {cfg.n_layers}, vocab_size {cfg.vocab_size}"
        raise AstraiError(f"{where}: a model of {estimated_params(cfg):.3g} parameters needs {need / 2**30:,.0f} GiB "
                          f"(fp32), more than this machine's {have / 2**30:,.0f} GiB of memory ({sizes})")


def load_model(
    ckpt_dir: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[Transformer, Tokenizer, ModelConfig]:
    """Verify and load a checkpoint: (model in eval mode on `device` in `dtype`, tokenizer, model config)."""
    ckpt_dir = Path(ckpt_dir)
    verify_checkpoint(ckpt_dir)
    cfg = read_model_config(ckpt_dir / "config.json")
    tokenizer = read_tokenizer(ckpt_dir / "tokenizer.json")
    check_fits_in_memory(cfg, ckpt_dir / "config.json")
    model = Transformer(cfg)
    try:  # strict: a missing, unexpected or misshapen tensor is refused
        model.load_state_dict(load_weights(ckpt_dir, cfg.tie_embeddings))
    except (RuntimeError, KeyError) as e:
        detail = " ".join(str(e).split())[:300]  # one line
        raise AstraiError(f"{ckpt_dir / 'model.safetensors'}: does not match config.json ({detail})") from None
    assert not cfg.tie_embeddings or model.lm_head.weight is model.embed_tokens.weight
    return model.to(device, dtype).eval(), tokenizer, cfg


def inference_dtype_of(ckpt_dir: str | os.PathLike, choice: str, device: torch.device,
                       batch_invariant: bool = False) -> tuple[torch.dtype, str]:
    """(dtype, why) that --dtype `choice` gives the checkpoint's model on `device` (runtime.device.inference_dtype),
    from its config.json alone, before any weight is read."""
    return inference_dtype(choice, device, estimated_params(read_model_config(Path(ckpt_dir) / "config.json")),
                           batch_invariant)
