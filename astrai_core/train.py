"""The training loop, read top to bottom in train(): every strategy (seq, sft, dpo, grpo), DDP, FSDP2 or tensor
parallelism across ranks, exact resume.

Run it alone (cfg.json is a TrainConfig as JSON):

    python -m astrai_core.train --config cfg.json                                        # one process
    torchrun --standalone --nproc_per_node=2 -m astrai_core.train --config cfg.json      # 2 ranks, one machine
    torchrun --nnodes=2 --node_rank=$NODE --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 --rdzv_id=RUN \\
        --nproc_per_node=8 -m astrai_core.train --config cfg.json --resume auto          # on each of 2 nodes
    torchrun --standalone --nproc_per_node=2 --max-restarts=3 -m astrai_core.train \\
        --config cfg.json --resume auto          # a rank that dies restarts the group, which resumes on its own

Data: the training tokens are cut into non-overlapping windows of seq_len + 1, shuffled once per epoch by
(seed, epoch). Step s trains on the global samples [s*G, (s+1)*G), G = ranks x grad_accum x batch_size, and
micro-step m of rank r takes slice m * ranks + r of them. So a run is a pure function of (config, step): 2 ranks
x batch B trains exactly like 1 rank x batch 2B, 4 micro-steps of 1 like one batch of 4, and the sampler's
position is a sample count. "Ranks" here are the data-parallel ones: with tensor parallelism (parallel tp or
fsdp+tp, astrai_core/parallel.py) the tp_size ranks of a TP group split one model and share its batches, so
TP=2 x batch B trains like 1 rank x batch B.

Loss: summed over target tokens and divided by the number of target tokens of the whole step (every micro-step
on every data-parallel rank; targets equal to IGNORE_INDEX do not count), times the data-parallel size because
DDP and FSDP average gradients over those ranks (a TP group computes one loss and is one such rank). Masking and
the split into micro-steps and ranks therefore never change the gradient.

One step: the strategy's micro-batches -> forward and backward over the accumulation window -> the gradient norm
(stop if it or the loss is not finite) -> clipping -> optimizer and schedule -> validation and early stopping ->
metrics -> a resumable checkpoint when due. Callbacks (astrai_core/callbacks.py) observe each point; the run's
counters live in RunState, which a checkpoint keeps with the model, optimizer, schedule, data position and RNGs.

Stopping and resuming: SIGTERM asks for a stop; the current step (all its micro-steps) finishes, the ranks agree
by an all-reduce, a resumable checkpoint is written and the process exits 0. A killed run (SIGKILL, a lost node)
resumes from the newest periodic checkpoint (checkpoint_every). On CPU with the same config a resumed run ends
with weights bitwise equal to an uninterrupted run's.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from astrai_core.callbacks import Callback, ProgressBar, RunState
from astrai_core.checkpoint import (clear_resumable, find_resumable, load_weights, save_checkpoint, save_resumable,
                                    verify_checkpoint)
from astrai_core.config import TrainConfig, check_ranks
from astrai_core.distributed import ERROR_PREFIX, DataGroup, Dist, cleanup, init_distributed, uses_bf16
from astrai_core.errors import AstraiError, TrainingError
from astrai_core.io import OUTPUT_MARK, sha256_file
from astrai_core.metric_log import MetricLogger
from astrai_core.model import Transformer
from astrai_core.optim import Chain, build_optimizer
from astrai_core.parallel import (apply_fsdp, apply_tensor_parallel, build_mesh, full_optimizer_state_dict,
                                  full_state_dict, load_full_optimizer_state_dict, load_full_state_dict, load_sharded,
                                  save_sharded)
from astrai_core.strategies import STRATEGIES, Strategy

# Config fields that may change between a run and its resumption without changing what it computes.
# The parallelism is one of them: a checkpoint (full or sharded) loads under any other, as does its format.
RESUME_MAY_CHANGE = {"train_data", "val_data", "tokenizer", "out_dir", "log_every", "compile", "compile_cache_dir",
                     "checkpoint_every", "checkpoint_dir", "keep_checkpoints", "resume", "parallel", "tp_size",
                     "checkpoint_format"}


def default_callbacks() -> list[Callback]:
    """What a run shows besides its metrics files: the progress line (a tqdm bar on a terminal)."""
    return [ProgressBar()]


def emit(callbacks: list[Callback], hook: str, run: RunState, *args) -> None:
    for cb in callbacks:
        getattr(cb, hook)(run, *args)


def due(step: int, every: int) -> bool:
    """Whether a periodic action (every `every` steps; 0: never) falls on `step`."""
    return every > 0 and step % every == 0


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


def all_gather(obj: Any, d: Dist) -> list[Any]:
    if d.world_size == 1:
        return [obj]
    out = [None] * d.world_size
    dist.all_gather_object(out, obj)
    return out



class StopFlag:
    """Set by the SIGTERM handler. A plain attribute and no lock: threading.Event.set takes one, and a second
    SIGTERM landing while the handler holds it (torchrun forwards to each rank the SIGTERM a scheduler may also
    send it) runs the handler again inside itself, which then waits on its own lock forever."""

    requested = False

    def set(self, *_) -> None:
        self.requested = True


# ---- what a run trains: built once, saved and restored as a whole -------------------------------------------

@dataclass
class Trainee:
    """Everything the loop trains with, and what a checkpoint holds besides RunState: the bare model (`wrapped` is
    what forward calls: DDP and compile wrap it; FSDP and TP split it in place), its optimizer and schedule, and
    the strategy (its data position and anything it carries across steps). A checkpoint holds either the full
    single-rank state (checkpoint_format "full": `sharded` models gather it to rank 0, the optimizer state then
    keyed by parameter name; DDP's own is keyed by position) or every rank's shards of the model and optimizer
    ("sharded", torch.distributed.checkpoint); either loads under any parallelism and number of ranks."""

    model: Transformer
    wrapped: torch.nn.Module
    optimizer: torch.optim.Optimizer | Chain  # Chain: Muon and AdamW together (optim.name muon)
    scheduler: torch.optim.lr_scheduler.LRScheduler | Chain
    strategy: Strategy
    dp: DataGroup  # the data-parallel ranks (under TP: one per TP group)
    device: torch.device
    autocast: Any  # the mixed-precision context every forward runs in (weights and optimizer stay fp32)
    max_steps: int
    tokens_per_step: int
    sharded: bool  # FSDP or TP: the weights are DTensors
    tp_size: int  # ranks per TP group (1: none); they hold one strategy state between them
    n_params: int
    trainable: int
    describe: str  # one line: what trains where

    def save(self, run: RunState, callbacks: list[Callback], cfg: TrainConfig, d: Dist) -> Path | None:
        """Write a resumable checkpoint in cfg.checkpoints; rank 0 returns its path. Every rank must call. The one
        place the format is chosen: "full" gathers the weights and optimizer state to rank 0, which writes them;
        "sharded" has every rank write its own shards into a staging directory first, which rank 0 moves into the
        checkpoint (then renamed into place as a whole, like a full one). Either way rank 0 adds the rest."""
        shards = None
        if cfg.checkpoint_format == "sharded":
            shards = Path(cfg.checkpoints) / ".dcp.tmp"  # the shards of the checkpoint being written
            if d.is_main:
                shutil.rmtree(shards, ignore_errors=True)  # an interrupted write's: no stale rank's file may stay
            if d.world_size > 1:
                dist.barrier()
            save_sharded(self.model, self.optimizer, shards)  # returns when every rank's files and .metadata are in
        weights, state = self.state(run, callbacks, cfg, d, gather=shards is None)
        if not d.is_main:
            return None
        return save_resumable(cfg.checkpoints, run.step, cfg.keep_checkpoints, model=self.model, model_cfg=cfg.model,
                              tokenizer_path=cfg.tokenizer, train_config=cfg, train_state=state, model_state=weights,
                              shards=shards)

    def state(self, run: RunState, callbacks: list[Callback], cfg: TrainConfig, d: Dist, gather: bool = True):
        """(full model state dict, train_state); every rank must call (gathers shards, RNG and strategy states).
        gather False: (None, train_state without the optimizer), for a sharded checkpoint that holds both."""
        if not gather:
            weights, optim = None, None
        elif self.sharded:
            weights = full_state_dict(self.model, rank0_only=True)
            optim = full_optimizer_state_dict(self.model, self.optimizer, rank0_only=True)
        else:  # replicas are identical: this rank's state is the model's
            weights, optim = self.model.state_dict(), self.optimizer.state_dict()
        sampler = self.strategy.sampler
        # One strategy state per data-parallel rank (TP groups are consecutive ranks: the first of each).
        strategies = all_gather(self.strategy.state_dict(), d)[::self.tp_size]
        state = {**run.state_dict(), "epoch": sampler.epoch, "consumed_samples": sampler.consumed,
                 "consumed_tokens": sampler.consumed * cfg.seq_len, "sampler": sampler.state_dict(),
                 "scheduler": self.scheduler.state_dict(), "rng": all_gather(rng_state(), d),
                 "strategy": strategies, "world_size": d.world_size,
                 "callbacks": {type(cb).__name__: cb.state_dict() for cb in callbacks}}
        if optim is not None:
            state["optimizer"] = optim
        return weights, state

    def restore(self, ckpt: Path, run: RunState, callbacks: list[Callback], cfg: TrainConfig, d: Dist) -> None:
        """Load a resumable checkpoint (written under any parallelism) into the (already wrapped) model, optimizer,
        scheduler, strategy, RunState, callbacks and this rank's RNGs."""
        state = torch.load(ckpt / "train_state.pt", weights_only=True, map_location="cpu")
        if (ckpt / "dcp").is_dir():  # a sharded checkpoint: each rank reads the parts it holds now
            load_sharded(self.model, self.optimizer, ckpt / "dcp")
        elif self.sharded:
            weights = load_weights(ckpt, cfg.model.tie_embeddings)
            load_full_state_dict(self.model, weights)
            load_full_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        else:
            self.model.load_state_dict(load_weights(ckpt, cfg.model.tie_embeddings))
            if any(isinstance(k, str) for k in state["optimizer"].get("state", {})):  # written by a sharded model
                load_full_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
            else:
                self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.strategy.sampler.load_state_dict(state["sampler"])
        if "strategy" in state:
            self.strategy.load_state_dict(state["strategy"][self.dp.rank % len(state["strategy"])])
        for cb in callbacks:
            cb.load_state_dict(state["callbacks"].get(type(cb).__name__, {}))
        if state["world_size"] != d.world_size:
            warnings.warn(f"{ckpt}: written by {state['world_size']} ranks, resuming on {d.world_size}; "
                          "the data order is kept, the RNG streams are not", stacklevel=2)
        set_rng_state(state["rng"][d.rank % len(state["rng"])])
        run.load_state_dict(state)
        run.epoch = self.strategy.sampler.epoch


def save_final(cfg: TrainConfig, weights: dict[str, torch.Tensor], state: dict[str, Any], model: Transformer,
               summary: dict[str, Any], log: MetricLogger) -> None:
    """Rank 0: the finished run's checkpoint in cfg.out_dir (with LoRA: the merged plain model, and the adapters
    on their own)."""
    files = [log.path]
    with contextlib.ExitStack() as stack:
        if cfg.lora is not None:
            from astrai_core.lora import merge_lora, save_adapters

            adapter_dir = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "adapter"
            save_adapters(model, adapter_dir, targets=cfg.lora.targets, rank=cfg.lora.rank, alpha=cfg.lora.alpha,
                          dropout=cfg.lora.dropout)
            files += sorted(p for p in adapter_dir.iterdir() if p.name != OUTPUT_MARK)  # the checkpoint has its own
            merge_lora(model)
            weights = model.state_dict()
        save_checkpoint(cfg.out_dir, model, cfg.model, cfg.tokenizer, extra=summary, train_config=cfg,
                        train_state=state, files=files, model_state=weights)
    log.log_artifact(Path(cfg.out_dir) / "train_config.json")


def resumable_checkpoint(cfg: TrainConfig) -> Path | None:
    """The newest valid checkpoint of this same run (config equal up to RESUME_MAY_CHANGE), or None."""
    ckpt = find_resumable(cfg.checkpoints)
    if ckpt is None:
        return None
    saved = TrainConfig.model_validate_json((ckpt / "train_config.json").read_text()).model_dump()
    now = cfg.model_dump()
    differ = sorted(k for k in now if k not in RESUME_MAY_CHANGE and saved.get(k) != now[k])
    if differ:
        warnings.warn(f"{ckpt}: written with a different config ({', '.join(differ)}); starting from scratch",
                      stacklevel=2)
        return None
    return ckpt


def resume_point(cfg: TrainConfig, d: Dist) -> Path | None:
    """The checkpoint this run continues from (resume auto), the same on every rank: rank 0 picks it (verifying
    its manifest) and tells the others; a fresh run clears stale ones."""
    ckpt = [resumable_checkpoint(cfg) if cfg.resume == "auto" and d.is_main else None]
    if d.world_size > 1:
        dist.broadcast_object_list(ckpt, src=0)
    if ckpt[0] is None and d.is_main:
        clear_resumable(cfg.checkpoints)
    return ckpt[0]


# ---- the model ---------------------------------------------------------------------------------------------------

def build(cfg: TrainConfig, d: Dist) -> Trainee:
    """Data, model, parallel layout and optimizer of a fresh run (restore() then loads a checkpoint into them)."""
    bf16 = uses_bf16(cfg.dtype, d.device)
    autocast = torch.autocast(d.device.type, dtype=torch.bfloat16, enabled=bf16)
    # Tensor parallelism: a ("dp", "tp") mesh; the ranks of one TP group share their batches, so the data is split
    # over the dp dimension only (without TP every rank is a data-parallel rank).
    mesh, dp = None, DataGroup(d.rank, d.world_size)
    if cfg.parallel in ("tp", "fsdp+tp"):
        try:
            check_ranks(cfg.parallel, cfg.tp_size, d.world_size)
        except ValueError as e:
            raise AstraiError(str(e)) from None
        mesh = build_mesh(d.world_size, cfg.tp_size, d.device.type)
        dp = DataGroup(mesh["dp"].get_local_rank(), mesh["dp"].size(), mesh["dp"].get_group())

    # Data (the strategy's): refuse files packed with another tokenizer or ids the model cannot embed.
    tok_sha = sha256_file(cfg.tokenizer)
    strategy = STRATEGIES[cfg.strategy](cfg, dp.rank, dp.size, d.device, tok_sha, autocast)
    per_step = dp.size * cfg.grad_accum * cfg.batch_size  # samples in one optimizer step
    max_steps = math.ceil(cfg.max_tokens / (per_step * cfg.seq_len)) if cfg.max_tokens else cfg.max_steps

    # Model: the same seed gives every rank the same initial weights (DDP also broadcasts rank 0's at wrap time).
    torch.manual_seed(cfg.seed)
    model = Transformer(cfg.model).to(d.device)
    if cfg.init_from:
        load_initial_weights(model, cfg, tok_sha)
    strategy.setup(model)  # e.g. GRPO freezes its reference here
    if cfg.lora is not None:
        from astrai_core.lora import apply_lora

        if cfg.parallel == "fsdp" and d.world_size > 1:
            raise AstraiError("lora with parallel 'fsdp' is not supported: use ddp (adapters are small)")
        apply_lora(model, cfg.lora.targets, cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout)
    n_params = model.num_params()
    if mesh is not None:  # every rank holds the same weights here (seed or init_from): each keeps its shards
        apply_tensor_parallel(model, mesh["tp"])
    if cfg.activation_checkpointing:
        checkpoint_blocks(model)
    wrapped = wrap(model, cfg, d, mesh)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)  # after wrap: FSDP's shards
    optimizer, scheduler = build_optimizer(model, cfg.optim, d.device, max_steps)
    layout = f"{cfg.parallel}, {dp.size} x tp {cfg.tp_size}" if mesh is not None else cfg.parallel
    describe = (f"{cfg.strategy}: training {trainable:,} of {n_params:,} parameters on {d.world_size} rank(s) "
                f"({d.device}, {'bf16' if bf16 else 'fp32'}, {layout}), {max_steps} steps of {per_step} samples")
    return Trainee(model, wrapped, optimizer, scheduler, strategy, dp, d.device, autocast, max_steps, per_step * cfg.seq_len,
                   sharded=mesh is not None or (cfg.parallel == "fsdp" and d.world_size > 1),
                   tp_size=cfg.tp_size if mesh is not None else 1, n_params=n_params, trainable=trainable,
                   describe=describe)


def load_initial_weights(model: Transformer, cfg: TrainConfig, tokenizer_sha256: str) -> None:
    """Start from cfg.init_from: a checkpoint of the same model shape and tokenizer (a pipeline stage's output or
    `astrai import-hf`'s)."""
    ckpt = Path(cfg.init_from)
    verify_checkpoint(ckpt)
    saved = json.loads((ckpt / "config.json").read_text())
    now = cfg.model.model_dump(mode="json")
    differ = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
    if differ:
        raise AstraiError(f"{ckpt / 'config.json'}: model differs from this run's ({', '.join(differ)}); init_from "
                          "needs the same model shape")
    if sha256_file(ckpt / "tokenizer.json") != tokenizer_sha256:
        raise AstraiError(f"{ckpt / 'tokenizer.json'}: not this run's tokenizer ({cfg.tokenizer}); init_from needs the "
                          "tokenizer the data was packed with")
    model.load_state_dict(load_weights(ckpt, cfg.model.tie_embeddings))


def checkpoint_blocks(model: Transformer) -> None:
    """Activation checkpointing: each decoder block keeps only its input and recomputes the rest in backward
    (non-reentrant, so it composes with DDP, FSDP and torch.compile)."""
    for block in model.layers:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def wrap(raw_model: Transformer, cfg: TrainConfig, d: Dist, mesh) -> torch.nn.Module:
    """What forward calls: the bare model compiled and/or wrapped for DDP, or sharded in place by FSDP2 (over the
    mesh's dp dimension with fsdp+tp; the TP split is already done). DDP cannot wrap TP's DTensor weights, and
    needs not: pure tp has no data parallelism."""
    if cfg.compile and cfg.compile_cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(cfg.compile_cache_dir).resolve())  # compiled kernels persist
    if mesh is not None:
        if cfg.parallel == "fsdp+tp":
            apply_fsdp(raw_model, mesh["dp"])
        return torch.compile(raw_model) if cfg.compile else raw_model
    if cfg.parallel == "fsdp" and d.world_size > 1:
        from torch.distributed.fsdp import fully_shard

        for block in raw_model.layers:  # one all-gather per block, the embedding and head with the root
            fully_shard(block)
        fully_shard(raw_model)
        return torch.compile(raw_model) if cfg.compile else raw_model
    model = torch.compile(raw_model) if cfg.compile else raw_model
    if d.world_size > 1:
        # A routed expert that got no tokens on this rank has no gradient: DDP must be told to expect that.
        model = DDP(model, device_ids=[d.local_rank] if d.device.type == "cuda" else None,
                    find_unused_parameters=bool(getattr(cfg.model, "n_experts", 0)))
    return model


def grad_sync(model: torch.nn.Module, raw_model: torch.nn.Module, enabled: bool):
    """Context for one backward: gradient reduction across ranks on (last micro-step) or off (the earlier ones)."""
    if isinstance(model, DDP) and not enabled:
        return model.no_sync()
    if hasattr(raw_model, "set_requires_gradient_sync"):  # FSDP2 (the root module, sharded in place)
        raw_model.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()


def total_grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP: a DTensor over the shards


def mean_over_ranks(sums: dict[str, torch.Tensor], stats: dict[str, tuple[float, float]], units: int,
                    dp: DataGroup, device: torch.device) -> dict[str, float]:
    """The strategy's metrics of this step, averaged over the data-parallel ranks: `sums` per loss unit (divided by
    the step's unit count), `stats` as (sum, count) pairs. Every rank holds the same keys, so one all-reduce does."""
    keys, stat_keys = sorted(sums), sorted(stats)
    if not keys and not stat_keys:
        return {}
    values = [sums[k].reshape(()).to(device) for k in keys]
    values += [torch.tensor(float(stats[k][i]), device=device) for k in stat_keys for i in (0, 1)]
    total = dp.all_reduce_sum(torch.stack(values).double()).tolist()
    out = {k: total[i] / units for i, k in enumerate(keys)}
    for j, k in enumerate(stat_keys):
        s, n = total[len(keys) + 2 * j], total[len(keys) + 2 * j + 1]
        out[k] = s / n if n else float("nan")
    return out


# ---- one step ------------------------------------------------------------------------------------------------

@dataclass
class StepResult:
    loss_sum: torch.Tensor  # this rank's summed loss
    units: int  # loss units (target tokens, pairs, completion tokens) of the whole step, every data rank
    tokens: int  # tokens fed to the model in the whole step
    grad_norm: torch.Tensor


def train_step(t: Trainee, run: RunState, callbacks: list[Callback], cfg: TrainConfig) -> StepResult:
    """One optimizer step: the strategy's preparation (GRPO's rollouts) and this rank's micro-batches, forward and
    backward over the accumulation window, the gradient norm (stop if it or the loss is not finite), clipping,
    the update. The step's strategy metrics go to run.metrics."""
    stats = t.strategy.prepare(run.step, t.model, t.dp)
    batches = t.strategy.micro_batches(run.step)
    counts = torch.tensor([float(sum(b.count for b in batches)), float(sum(b.n_tokens for b in batches))],
                          device=t.device)
    units, tokens = (int(v) for v in t.dp.all_reduce_sum(counts).tolist())
    if units == 0:
        raise TrainingError(f"step {run.step + 1}: no {t.strategy.unit} to learn from in the whole step "
                            "(every target masked); check the data")

    # The loss is summed over units and divided by the whole step's count (times the data-parallel size: DDP and
    # FSDP average the ranks' gradients; a TP group computes one loss, whose gradient its ranks share).
    loss_sum = torch.zeros((), device=t.device)
    metric_sums: dict[str, torch.Tensor] = {}
    for run.micro, batch in enumerate(batches):
        emit(callbacks, "on_batch_begin", run)
        # Gradients are all-reduced only on the last micro-step; the earlier ones just accumulate locally.
        with grad_sync(t.wrapped, t.model, enabled=run.micro == cfg.grad_accum - 1):
            loss, metrics = t.strategy.loss(batch.logits(t.wrapped, t.autocast), batch)
            scaled = loss * (t.dp.size / units)
            aux = getattr(t.model, "aux_loss", None)  # e.g. a mixture-of-experts balance loss
            if isinstance(aux, torch.Tensor):
                scaled = scaled + aux / cfg.grad_accum
            scaled.backward()
        loss_sum += loss.detach()
        for k, v in metrics.items():
            metric_sums[k] = metric_sums.get(k, 0) + v.detach().float()
        emit(callbacks, "on_batch_end", run)
    run.metrics.update(mean_over_ranks(metric_sums, stats, units, t.dp, loss_sum.device))

    # Stop before the update can spread NaNs into the weights. The norm is taken after the all-reduce, so it is
    # the same on every rank (and a non-finite loss on one rank makes it non-finite everywhere).
    params = list(t.model.parameters())
    grad_norm = total_grad_norm(params)
    if not math.isfinite(grad_norm.item()) or not math.isfinite(loss_sum.item()):
        raise TrainingError(f"step {run.step + 1}: non-finite loss ({loss_sum.item()}) or gradient norm "
                            f"({grad_norm.item()}); lower optim.lr, raise optim.warmup_steps or use fp32")
    if cfg.optim.grad_clip > 0:
        torch.nn.utils.clip_grads_with_norm_(params, cfg.optim.grad_clip, grad_norm)
    emit(callbacks, "on_optimizer_step_begin", run)
    t.optimizer.step()
    t.scheduler.step()
    t.optimizer.zero_grad(set_to_none=True)
    return StepResult(loss_sum, units, tokens, grad_norm)


def validate(t: Trainee, run: RunState, cfg: TrainConfig) -> bool:
    """The strategy's held-out metrics into run.metrics (held-out loss, or GRPO's held-out task accuracy), and
    early stopping on val/loss: True when the run should end here."""
    run.metrics.update(t.strategy.validate(t.wrapped, t.model, t.dp))
    run.val_loss = run.metrics.get("val/loss")
    if not cfg.early_stopping_patience:
        return False
    if run.val_loss < run.best_val - cfg.early_stopping_min_delta:
        run.best_val, run.bad_validations = run.val_loss, 0
    else:
        run.bad_validations += 1
    if run.bad_validations < cfg.early_stopping_patience or run.step >= t.max_steps:
        return False
    run.stop = (f"early stopping: no val/loss improvement in {run.bad_validations} validations "
                f"(best {run.best_val:.4f})")
    return True


class Throughput:
    """Tokens per second: over the log window (reset each time it is read), and over the run without its first
    step (warm-up) for the summary. Steps only: validation and checkpoints are not timed."""

    def __init__(self) -> None:
        self.window_seconds, self.window_tokens = 0.0, 0
        self.seconds, self.tokens = 0.0, 0

    def add(self, seconds: float, tokens: int, warm: bool) -> None:
        self.window_seconds, self.window_tokens = self.window_seconds + seconds, self.window_tokens + tokens
        if warm:
            self.seconds, self.tokens = self.seconds + seconds, self.tokens + tokens

    def window(self) -> float:
        rate = self.window_tokens / self.window_seconds
        self.window_seconds, self.window_tokens = 0.0, 0
        return rate

    def overall(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")


def stop_requested(stop: StopFlag, d: Dist) -> bool:
    """Whether any rank got SIGTERM: every rank must agree to stop at the same step."""
    flag = torch.tensor(float(stop.requested), device=d.device)
    if d.world_size > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.SUM)
    return flag.item() > 0


@contextlib.contextmanager
def sigterm_stops(stop: StopFlag):
    """SIGTERM (a scheduler's preemption, torchrun stopping the group) sets `stop` while the run lasts (signals
    reach the main thread only: a run in another thread keeps the default)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, stop.set)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# ---- the loop ----------------------------------------------------------------------------------------------------

def train(cfg: TrainConfig, callbacks: list[Callback] | None = None) -> dict:
    """Train (resuming if cfg.resume == "auto" finds a checkpoint of this run); rank 0 writes the final checkpoint
    to cfg.out_dir. Returns the run summary (on every rank). `callbacks` replaces default_callbacks()."""
    t_start = time.time()
    d = init_distributed(cfg.backend, cfg.device)
    print0 = functools.partial(print, flush=True) if d.is_main else (lambda *a, **k: None)
    callbacks = default_callbacks() if callbacks is None else callbacks
    t = build(cfg, d)
    run = RunState(max_steps=t.max_steps, is_main=d.is_main)
    ckpt = resume_point(cfg, d)
    if ckpt is not None:
        t.restore(ckpt, run, callbacks, cfg, d)
        if run.step > t.max_steps:  # the loop would never reach max_steps
            raise AstraiError(f"{ckpt}: checkpoint at step {run.step} is beyond max_steps {t.max_steps}; raise "
                              "max_steps or delete the checkpoint directory to start over")
        print0(f"resuming from {ckpt} (step {run.step})")
    # metrics.jsonl + MLflow on rank 0, a no-op elsewhere; a resumed run keeps the lines up to its checkpoint.
    log = MetricLogger(Path(cfg.out_dir).with_name(Path(cfg.out_dir).name + ".logs"), enabled=d.is_main,
                       resume_step=run.resumed_from)
    print0(t.describe)

    stop, speed = StopFlag(), Throughput()
    finished = run.step >= t.max_steps  # the run is complete (last step, or early stopping): the final save follows
    try:
        with sigterm_stops(stop):
            emit(callbacks, "on_train_begin", run)
            log.log_params(cfg.model_dump())
            emit(callbacks, "on_epoch_begin", run)
            while not finished and not run.stop:
                t0, lr, run.metrics = time.perf_counter(), t.scheduler.get_last_lr()[0], {}
                step = train_step(t, run, callbacks, cfg)
                run.step += 1
                finished = run.step >= t.max_steps
                if stop_requested(stop, d) and not finished:
                    run.stop = "SIGTERM"  # finish this step, checkpoint, exit 0
                speed.add(time.perf_counter() - t0, step.tokens,
                          warm=run.step > (run.resumed_from or 0) + 1 or t.max_steps == 1)

                # Validation every eval_every steps and after the last; early stopping ends a complete run.
                if cfg.val_data and (due(run.step, cfg.eval_every) or finished):
                    finished = validate(t, run, cfg) or finished
                # Metrics every log_every steps, on the last step and on a stop; the train loss is the mean over
                # the step's units on all ranks.
                if due(run.step, cfg.log_every) or finished or run.stop:
                    run.train_loss = t.dp.all_reduce_sum(step.loss_sum.clone()).item() / step.units
                    run.metrics.update({"train/loss": run.train_loss, "train/lr": lr,
                                        "train/grad_norm": float(step.grad_norm),
                                        "train/tokens_per_sec": speed.window()})
                if run.metrics:
                    log.log(run.metrics, step=run.step)
                # A resumable checkpoint every checkpoint_every steps and when asked to stop.
                if not finished and (due(run.step, cfg.checkpoint_every) or run.stop):
                    if path := t.save(run, callbacks, cfg, d):
                        print0(f"checkpoint {path}")
                emit(callbacks, "on_optimizer_step_end", run)
                if t.strategy.sampler.epoch != run.epoch:
                    emit(callbacks, "on_epoch_end", run)
                    run.epoch = t.strategy.sampler.epoch
                    emit(callbacks, "on_epoch_begin", run)
            emit(callbacks, "on_epoch_end", run)

            if run.stop:
                print0(f"stopped at step {run.step}/{t.max_steps}: {run.stop}")
            run.summary = summarize(cfg, t, run, d, speed.overall(), time.time() - t_start)
            if finished:  # else interrupted: the resumable checkpoint is what the run leaves
                weights, state = t.state(run, callbacks, cfg, d)
                if d.is_main:
                    save_final(cfg, weights, state, t.model, run.summary, log)
                    print0(f"saved {cfg.out_dir} | {run.summary['tokens_per_sec']:,.0f} tok/s | "
                           f"{run.summary['wall_seconds']:.1f} s")
            emit(callbacks, "on_train_end", run)
    except BaseException as e:
        emit(callbacks, "on_error", run, e)
        raise
    teardown(t, d)
    return run.summary


def summarize(cfg: TrainConfig, t: Trainee, run: RunState, d: Dist, tokens_per_sec: float, seconds: float) -> dict:
    return {
        "strategy": cfg.strategy,
        "final_train_loss": run.train_loss,
        "final_val_loss": run.val_loss if cfg.val_data else None,
        "steps": run.step,
        "max_steps": t.max_steps,
        "tokens_seen": run.step * t.tokens_per_step if cfg.strategy == "seq" else None,
        "tokens_per_sec": tokens_per_sec,
        "n_params": t.n_params,
        "trainable_params": t.trainable,
        "wall_seconds": seconds,
        "world_size": d.world_size,
        "resumed_from_step": run.resumed_from,
        "stopped": run.stop,
    }


def teardown(t: Trainee, d: Dist) -> None:
    """Free the DDP wrapper (its reducer holds the process group) while the group is alive, then let every rank's
    gloo workers drain in a barrier, during which this thread does not hold the GIL: a gloo group destroyed while a
    worker still needs the GIL to free a finished operation's tensors deadlocks at exit (torch issue 56297)."""
    t.wrapped = None
    if d.world_size > 1:
        dist.barrier()
    cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="TrainConfig as JSON")
    parser.add_argument("--resume", choices=["auto", "never"], default=None,
                        help="auto: continue from the newest valid checkpoint of this run (default: the config's)")
    args = parser.parse_args(argv)
    try:
        cfg = TrainConfig.model_validate_json(Path(args.config).read_text())
        if args.resume:
            cfg = cfg.model_copy(update={"resume": args.resume})
        train(cfg)
    except Exception as e:  # noqa: BLE001 - every rank's failure becomes the one line its launcher reports
        if not isinstance(e, AstraiError):
            traceback.print_exc()  # a bug: its traceback stays in the log, the line below says what failed
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"{ERROR_PREFIX}{message if isinstance(e, AstraiError) else f'{type(e).__name__}: {message}'}",
              file=sys.stderr, flush=True)
        # A failing rank leaves at once, its process group as it is: destroying a gloo group that DDP's reducer or
        # an unfinished collective still holds can hang the rank forever (torch issue 56297; in CI both ranks of a
        # non-finite step hung there and torchrun waited on them). torchrun stops the other ranks when one exits.
        sys.stdout.flush()
        os._exit(2)


if __name__ == "__main__":
    main()
