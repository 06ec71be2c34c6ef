"""A training run's checkpoints: the resumable ones it writes as it goes and resumes from, and the training state
they hold beyond the model.

Each checkpoint, resumable or the finished run's, is a model directory (astrai_core/checkpoint/model_dir.py, written by
save_checkpoint) that also holds train_config.json and train_state.pt; with checkpoint_format "sharded", a resumable
one holds dcp/ in place of model.safetensors. Resumable checkpoints of a run live in one directory
(TrainConfig.checkpoints):

    step_00000100/      one checkpoint, with train_state.pt
    step_00000200/
    latest              the name of the newest complete one ("step_00000200"), replaced after it is in place

save_resumable writes one, moves `latest`, then deletes all but the newest K; find_resumable returns the newest
one whose manifest verifies, skipping (with a warning) any that is corrupt or incomplete.

A training run's checkpoints go through one Checkpointer (what they hold, in which format, and which one the run
resumes from). Its weights and optimizer state are either the single-rank files (full_state_dict gathers a TP or
FSDP model's shards, load_full_state_dict scatters a single-rank state dict into one) or, with checkpoint_format
"sharded", torch.distributed.checkpoint files that every rank writes its own shards to (save_sharded) and that load
under any other layout (load_sharded).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from pydantic import BaseModel

from astrai_core.checkpoint.model_dir import load_weights, read_model_config, save_checkpoint, verify_checkpoint
from astrai_core.model.transformer import Transformer
from astrai_core.runtime.device import DataGroup, Dist
from astrai_core.runtime.errors import AstraiError
from astrai_core.runtime.io import OUTPUT_MARK, atomic_path, sha256_file


STEP_DIR = re.compile(r"^step_(\d{8,})$")


class Stateful(Protocol):
    """What a checkpoint holds the state of (torchtitan's contract): the optimizer and its schedule, the strategy
    (its data position), the callbacks and the loop's RunState. This module knows them by it alone, so checkpoints
    sit below the training loop that defines them (astrai_core/training/)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


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


def load_train_state(path: Path, mmap: bool = False) -> dict[str, Any]:
    """A checkpoint's train_state.pt (plain tensors and containers only: weights_only); AstraiError if it is not one."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu", mmap=mmap)
    except Exception as e:  # UnpicklingError, RuntimeError (not a zip), EOFError, ...: never load it unsafely instead
        detail = next((line.strip() for line in str(e).splitlines() if "WeightsUnpickler error" in line),
                      type(e).__name__)
        raise AstraiError(f"{path}: corrupt training state ({detail}); delete this checkpoint directory, or run "
                          "with resume: never") from None


# ---- weights and optimizer state under any parallel layout ------------------------------------------------------
# torch.distributed's state-dict and checkpoint modules are imported where they are used: only a sharded model (FSDP,
# TP) or a sharded checkpoint needs them.

def full_state_dict(model: nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The whole model's state dict as plain tensors (the single-rank checkpoint's), on every rank; rank0_only:
    on rank 0 only, in CPU memory, the other ranks get {} (what a checkpoint save needs, and no rank but the
    writer holds a full copy). Collective: every rank of the mesh must call it. On one rank (no parallelism) the
    tensors are the live weights: save or copy them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=rank0_only))


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a single-rank (full) state dict into a TP or FSDP+TP model: each rank keeps its own shards.
    Collective; every rank passes the same full state dict (a tied lm_head.weight included)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    # A copy of the mapping: set_model_state_dict replaces its values by this rank's shards (the caller's dict
    # would come back full of DTensors).
    set_model_state_dict(model, dict(state), options=StateDictOptions(full_state_dict=True))


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                              rank0_only: bool = False) -> dict[str, Any]:
    """The optimizer's state with full tensors, keyed by parameter name (not by position as
    optimizer.state_dict() is), so it loads into the same model under any parallelism, one rank included.
    rank0_only and the live tensors as full_state_dict. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=rank0_only))


def load_full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load full_optimizer_state_dict's output (from any parallelism) into this rank's optimizer, or a one-rank
    optimizer.state_dict() (keyed by position: what DDP checkpoints hold; `optimizer` must then list its
    parameters in the same order as the one that saved it, as the training loop builds it). Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if all(isinstance(i, int) for group in state["param_groups"] for i in group["params"]):
        state = _keyed_by_name(model, optimizer, state)
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def _keyed_by_name(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """optimizer.state_dict()'s positions (the optimizer's parameters in group order) -> parameter names."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    names = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return {"state": {names[i]: s for i, s in state["state"].items()},
            "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                             for group in state["param_groups"]]}


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | os.PathLike) -> None:
    """Write the model's and the optimizer's state as torch.distributed.checkpoint files in `path` (a directory):
    each rank writes the shards it holds (a DTensor's local part; a tensor every rank holds alike, once), so no
    rank ever holds the full state. The optimizer state is keyed by parameter name. Collective; on one process
    without a process group it writes one rank's files."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    with _one_process_is_fine():
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=path)


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | os.PathLike) -> None:
    """Load save_sharded's files into this rank's model and optimizer, whatever the parallelism and number of
    ranks that wrote them: each rank reads the part of every tensor it holds now (DCP reshards by the tensors'
    global shapes and offsets). Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)  # this rank's layout: what to read, and where
    state = {"model": model_state, "optimizer": optim_state}
    with _one_process_is_fine():
        dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


@contextlib.contextmanager
def _one_process_is_fine() -> Iterator[None]:
    """DCP warns at every save and load without a process group (a one-rank run), where that is expected."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# ---- a training run's checkpoints ----------------------------------------------------------------------------------

# Config fields that may change between a run and its resumption without changing what it computes.
# The parallelism is one of them: a checkpoint (full or sharded) loads under any other, as does its format.
RESUME_MAY_CHANGE = {"train_data", "val_data", "tokenizer", "out_dir", "log_every", "compile", "compile_cache_dir",
                     "checkpoint_every", "checkpoint_dir", "keep_checkpoints", "resume", "parallel", "tp_size",
                     "checkpoint_format"}


def load_initial_weights(model: Transformer, cfg: BaseModel, tokenizer_sha256: str) -> None:
    """Start from cfg.init_from: a checkpoint of the same model shape and tokenizer (a pipeline stage's output or
    `astrai import-hf`'s)."""
    ckpt = Path(cfg.init_from)
    verify_checkpoint(ckpt)
    differ = cfg.model.differences(read_model_config(ckpt / "config.json"))
    if differ:
        raise AstraiError(f"{ckpt / 'config.json'}: model differs from this run's ({', '.join(differ)}); init_from "
                          "needs the same model shape")
    if sha256_file(ckpt / "tokenizer.json") != tokenizer_sha256:
        raise AstraiError(f"{ckpt / 'tokenizer.json'}: not this run's tokenizer ({cfg.tokenizer}); init_from needs the "
                          "tokenizer the data was packed with")
    model.load_state_dict(load_weights(ckpt, cfg.model.tie_embeddings))


def rng_state() -> dict[str, Any]:
    """This process's RNG states, in types torch.load(weights_only=True) accepts."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _all_gather(obj: Any, d: Dist) -> list[Any]:
    if d.world_size == 1:
        return [obj]
    out = [None] * d.world_size
    dist.all_gather_object(out, obj)
    return out


def resumable_checkpoint(cfg: BaseModel) -> Path | None:
    """The newest valid checkpoint of this same run (its TrainConfig equal up to RESUME_MAY_CHANGE), or None."""
    ckpt = find_resumable(cfg.checkpoints)
    if ckpt is None:
        return None
    saved = type(cfg).model_validate_json((ckpt / "train_config.json").read_text()).model_dump()
    now = cfg.model_dump()
    differ = sorted(k for k in now if k not in RESUME_MAY_CHANGE and saved.get(k) != now[k])
    if differ:
        warnings.warn(f"{ckpt}: written with a different config ({', '.join(differ)}); starting from scratch",
                      stacklevel=2)
        return None
    return ckpt


@dataclass
class Checkpointer:
    """A training run's checkpoints: what they hold, where and in which format they are written, and which one the
    run resumes from. Every method is collective: every rank calls it.

    What: the bare model (DDP and compile wrap it; FSDP and TP split it in place), its optimizer and schedule, the
    strategy's state (its data position and anything it carries across steps; one per data-parallel rank), RunState,
    the callbacks' state and every rank's RNG states.
    Where: a resumable checkpoint every checkpoint_every steps and on a stop in cfg.checkpoints (save_resumable), the
    finished run's in cfg.out_dir; either is staged and renamed into place (save_checkpoint).
    Format (checkpoint_format): "full" gathers a `sharded` model's weights and optimizer state to rank 0, which writes
    them (the optimizer state then keyed by parameter name; DDP's own is keyed by position); "sharded" has every rank
    write its own shards (torch.distributed.checkpoint). Either loads under any parallelism and number of ranks.
    Resume (resume "auto"): the newest checkpoint of cfg.checkpoints whose manifest verifies and whose config equals
    this run's up to RESUME_MAY_CHANGE; a fresh run deletes the checkpoints there."""

    cfg: BaseModel  # the run's TrainConfig (astrai_core/training/config.py)
    d: Dist
    model: Transformer
    optimizer: torch.optim.Optimizer | Stateful  # or a Chain: Muon and AdamW together (optim.name muon)
    scheduler: torch.optim.lr_scheduler.LRScheduler | Stateful
    strategy: Stateful  # a Strategy (astrai_core/training/strategies/): also its epoch
    dp: DataGroup  # the data-parallel ranks (under TP: one per TP group)
    callbacks: list[Stateful]
    sharded: bool  # FSDP or TP: the weights are DTensors

    def resume(self, run: Stateful) -> Path | None:
        """Load the checkpoint this run continues from into the (already wrapped) model, optimizer, scheduler,
        strategy, `run`, callbacks and this rank's RNGs, and return its path; None: a fresh start. The same on every
        rank: rank 0 picks it (verifying its manifest) and tells the others."""
        ckpt = [resumable_checkpoint(self.cfg) if self.cfg.resume == "auto" and self.d.is_main else None]
        if self.d.world_size > 1:
            dist.broadcast_object_list(ckpt, src=0)
        if ckpt[0] is None:
            if self.d.is_main:
                clear_resumable(self.cfg.checkpoints)
            return None
        self.load(ckpt[0], run)
        if run.step > run.max_steps:  # the loop would never reach max_steps
            raise AstraiError(f"{ckpt[0]}: checkpoint at step {run.step} is beyond max_steps {run.max_steps}; raise "
                              "max_steps or delete the checkpoint directory to start over")
        return ckpt[0]


    def save(self, run: Stateful) -> Path | None:
        """Write a resumable checkpoint in cfg.checkpoints; rank 0 returns its path. "full": the weights and
        optimizer state gathered to rank 0; "sharded": every rank writes its own shards into a staging directory
        first, which rank 0 moves into the checkpoint (then renamed into place as a whole, like a full one). Either
        way rank 0 adds the rest."""
        shards = None
        if self.cfg.checkpoint_format == "sharded":
            shards = Path(self.cfg.checkpoints) / ".dcp.tmp"  # the shards of the checkpoint being written
            if self.d.is_main:
                shutil.rmtree(shards, ignore_errors=True)  # an interrupted write's: no stale rank's file may stay
            if self.d.world_size > 1:
                dist.barrier()
            save_sharded(self.model, self.optimizer, shards)  # returns when every rank's files and .metadata are in
        weights, state = self._state(run, gather=shards is None)
        if not self.d.is_main:
            return None
        return save_resumable(self.cfg.checkpoints, run.step, self.cfg.keep_checkpoints, model=self.model,
                              model_cfg=self.cfg.model, tokenizer_path=self.cfg.tokenizer, train_config=self.cfg,
                              train_state=state, model_state=weights, shards=shards)

    def save_final(self, run: Stateful, files: list[Path]) -> Path | None:
        """The finished run's checkpoint in cfg.out_dir, written by rank 0 (with LoRA: the merged plain model, and
        the adapters on their own), with run.summary and `files` (the metrics file); rank 0 returns its path."""
        weights, state = self._state(run)
        if not self.d.is_main:
            return None
        cfg, files = self.cfg, list(files)
        with contextlib.ExitStack() as stack:
            if cfg.lora is not None:
                from astrai_core.model.lora import merge_lora, save_adapters

                adapter_dir = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "adapter"
                save_adapters(self.model, adapter_dir, targets=cfg.lora.targets, rank=cfg.lora.rank,
                              alpha=cfg.lora.alpha, dropout=cfg.lora.dropout)
                files += sorted(p for p in adapter_dir.iterdir() if p.name != OUTPUT_MARK)  # the checkpoint has its own
                merge_lora(self.model)
                weights = self.model.state_dict()
            save_checkpoint(cfg.out_dir, self.model, cfg.model, cfg.tokenizer, extra=run.summary, train_config=cfg,
                            train_state=state, files=files, model_state=weights)
        return Path(cfg.out_dir)

    def _state(self, run: Stateful, gather: bool = True) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any]]:
        """(full model state dict, train_state); gathers shards, RNG and strategy states. gather False: (None,
        train_state without the optimizer), for a sharded checkpoint that holds both."""
        if not gather:
            weights, optim = None, None
        elif self.sharded:
            weights = full_state_dict(self.model, rank0_only=True)
            optim = full_optimizer_state_dict(self.model, self.optimizer, rank0_only=True)
        else:  # replicas are identical: this rank's state is the model's
            weights, optim = self.model.state_dict(), self.optimizer.state_dict()
        # One strategy state per data-parallel rank (TP groups are consecutive ranks: the first of each).
        strategies = _all_gather(self.strategy.state_dict(), self.d)[::self.d.world_size // self.dp.size]
        consumed = strategies[0]["consumed_samples"]  # the data position: the same on every rank
        state = {**run.state_dict(), "epoch": self.strategy.epoch, "consumed_samples": consumed,
                 "consumed_tokens": consumed * self.cfg.seq_len, "scheduler": self.scheduler.state_dict(),
                 "rng": _all_gather(rng_state(), self.d), "strategy": strategies, "world_size": self.d.world_size,
                 "callbacks": {type(cb).__name__: cb.state_dict() for cb in self.callbacks}}
        if optim is not None:
            state["optimizer"] = optim
        return weights, state

    def load(self, ckpt: Path, run: Stateful) -> None:
        """Load a resumable checkpoint (written under any parallelism) into the model, optimizer, scheduler,
        strategy, `run`, callbacks and this rank's RNGs."""
        d, state = self.d, load_train_state(ckpt / "train_state.pt")
        if (ckpt / "dcp").is_dir():  # a sharded checkpoint: each rank reads the parts it holds now
            load_sharded(self.model, self.optimizer, ckpt / "dcp")
        elif self.sharded:
            load_full_state_dict(self.model, load_weights(ckpt, self.cfg.model.tie_embeddings))
            load_full_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        else:
            self.model.load_state_dict(load_weights(ckpt, self.cfg.model.tie_embeddings))
            if any(isinstance(k, str) for k in state["optimizer"].get("state", {})):  # written by a sharded model
                load_full_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
            else:
                self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        # Checkpoints written before the strategy's state held its data position kept it under "sampler".
        strategies = state.get("strategy") or [{}]
        self.strategy.load_state_dict({**state.get("sampler", {}), **strategies[self.dp.rank % len(strategies)]})
        for cb in self.callbacks:
            cb.load_state_dict(state["callbacks"].get(type(cb).__name__, {}))
        if state["world_size"] != d.world_size:
            warnings.warn(f"{ckpt}: written by {state['world_size']} ranks, resuming on {d.world_size}; "
                          "the data order is kept, the RNG streams are not", stacklevel=2)
        set_rng_state(state["rng"][d.rank % len(state["rng"])])
        run.load_state_dict(state)
        run.epoch = self.strategy.epoch
