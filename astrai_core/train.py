"""The training loop: next-token prediction on packed tokens, DDP or FSDP2 across ranks, exact resume.

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
position is a sample count.

Loss: summed over target tokens and divided by the number of target tokens of the whole step (every micro-step
on every rank; targets equal to IGNORE_INDEX do not count), times the world size because DDP and FSDP average
gradients over ranks. Masking and the split into micro-steps and ranks therefore never change the gradient.

Stopping and resuming: SIGTERM asks for a stop; the current step (all its micro-steps) finishes, the ranks agree
by an all-reduce, a resumable checkpoint is written and the process exits 0. A killed run (SIGKILL, a lost node)
resumes from the newest periodic checkpoint (checkpoint_every). On CPU with the same config a resumed run ends
with weights bitwise equal to an uninterrupted run's.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import random
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from astrai_core.callbacks import (Callback, Checkpointing, EarlyStopping, GradientClipping, MetricLogging,
                                   ProgressBar, Validation)
from astrai_core.checkpoint import clear_resumable, find_resumable, save_checkpoint, save_resumable
from astrai_core.config import TrainConfig
from astrai_core.data import PackedTokens
from astrai_core.distributed import Dist, cleanup, init_distributed
from astrai_core.errors import AstraiError
from astrai_core.io import sha256_file
from astrai_core.model import Transformer
from astrai_core.schedules import lr_at
from astrai_core.tracking import MetricLogger

IN_MEMORY_TOKENS = 1 << 28  # below this (512 MB as uint16) read the token file into RAM once: no disk reads per batch
IGNORE_INDEX = -100  # a target with this id is masked: no loss, not counted
VAL_SEED_OFFSET = 10**9  # the validation sampler's seed: never equal to the training sampler's
# Config fields that may change between a run and its resumption without changing what it computes.
RESUME_MAY_CHANGE = {"train_data", "val_data", "tokenizer", "out_dir", "log_every", "compile", "compile_cache_dir",
                     "checkpoint_every", "checkpoint_dir", "keep_checkpoints", "resume"}


def open_tokens(path: str, tokenizer_sha256: str, vocab_size: int, seq_len: int):
    """The token ids of a packed file, checked against the tokenizer and the model: a numpy array if small,
    else the on-disk h5py dataset (both slice the same way)."""
    data = PackedTokens(path, expected_tokenizer_sha256=tokenizer_sha256)
    if data.vocab_size > vocab_size:
        raise AstraiError(f"{path}: token vocabulary {data.vocab_size} exceeds model.vocab_size {vocab_size}")
    if data.n_tokens < seq_len + 1:
        raise AstraiError(f"{path}: {data.n_tokens} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    return data.tokens[:] if data.n_tokens < IN_MEMORY_TOKENS else data.tokens


class WindowSampler:
    """Start offsets of non-overlapping (seq_len + 1)-token windows, in a fresh random order every epoch.

    Sample k is window perm_e[k mod n_windows] of epoch e = k // n_windows, perm_e seeded by (seed, e): a pure
    function of k, so the state is the number of samples consumed.
    """

    def __init__(self, n_tokens: int, seq_len: int, seed: int) -> None:
        self.seq_len, self.seed = seq_len, seed
        self.n_windows = (n_tokens - 1) // seq_len
        assert self.n_windows >= 1
        self.consumed = 0
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    @property
    def epoch(self) -> int:
        return self.consumed // self.n_windows

    def starts(self, first: int, n: int) -> np.ndarray:
        """Token offsets of samples first .. first + n - 1."""
        epochs, pos = np.divmod(np.arange(first, first + n), self.n_windows)
        out = np.empty(n, dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._permutation(int(e))[pos[sel]] * self.seq_len
        return out

    def next_starts(self, n: int) -> np.ndarray:
        out = self.starts(self.consumed, n)
        self.consumed += n
        return out

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:  # one epoch's order is cached: a step needs at most two
            self._perm_epoch, self._perm = epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
        return self._perm

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed = int(state["consumed_samples"])


def read_windows(tokens, starts: np.ndarray, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y), each (len(starts), seq_len): the windows at `starts`, y shifted by one token."""
    windows = torch.from_numpy(np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int64))
    if device.type == "cuda":
        windows = windows.pin_memory().to(device, non_blocking=True)
    return windows[:, :-1], windows[:, 1:]


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Sum of next-token cross-entropy over targets != IGNORE_INDEX, in fp32. logits (..., V), targets (...)."""
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum", label_smoothing=label_smoothing)


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


@dataclass
class Run:
    """What the loop and its callbacks share: the run's objects and counters."""

    cfg: TrainConfig
    d: Dist
    raw_model: Transformer  # the bare module (DDP/compile wrap it; FSDP shards it in place)
    model: torch.nn.Module  # what forward calls
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: WindowSampler
    callbacks: list[Callback]
    evaluate: Callable[[], float]
    max_steps: int
    tokens_per_step: int
    log: MetricLogger | None = None  # metrics.jsonl + MLflow on rank 0, a no-op elsewhere
    step: int = 0  # optimizer steps done
    micro: int = 0  # micro-step within the current step
    epoch: int = 0
    lr: float = 0.0
    loss_sum: torch.Tensor = field(default_factory=lambda: torch.zeros(()))  # this rank's summed token loss, this step
    step_targets: int = 0  # target tokens in this step, all ranks
    grad_norm: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    metrics: dict[str, float] = field(default_factory=dict)  # logged at the end of this step
    train_loss: float = math.nan
    val_loss: float = math.nan
    stop: str | None = None  # why the run stops before max_steps
    finished: bool = False  # the run is complete (last step, or early stopping): a final checkpoint follows
    resumed_from: int | None = None
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def is_main(self) -> bool:
        return self.d.is_main

    @property
    def is_last_step(self) -> bool:
        return self.step == self.max_steps

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return list(self.raw_model.parameters())

    @property
    def fsdp(self) -> bool:
        return self.cfg.parallel == "fsdp" and self.d.world_size > 1

    def print0(self, *args, **kwargs) -> None:
        if self.is_main:
            print(*args, **kwargs)

    def emit(self, hook: str, *args) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.d.world_size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return x

    # --- checkpoints: collective (every rank calls), rank 0 writes -------------------------------------------

    def training_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(full model state dict, train_state) on rank 0; every rank must call (gathers shards and RNG states)."""
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                                 get_optimizer_state_dict)

            full = StateDictOptions(full_state_dict=True, cpu_offload=True)
            weights = get_model_state_dict(self.raw_model, options=full)
            optim = get_optimizer_state_dict(self.raw_model, self.optimizer, options=full)
        else:  # replicas are identical: this rank's state is the model's
            weights, optim = self.raw_model.state_dict(), self.optimizer.state_dict()
        rngs = [rng_state()]
        if self.d.world_size > 1:
            rngs = [None] * self.d.world_size
            dist.all_gather_object(rngs, rng_state())
        state = {"step": self.step, "epoch": self.sampler.epoch, "consumed_samples": self.sampler.consumed,
                 "consumed_tokens": self.sampler.consumed * self.cfg.seq_len, "sampler": self.sampler.state_dict(),
                 "optimizer": optim, "scheduler": self.scheduler.state_dict(), "rng": rngs,
                 "world_size": self.d.world_size,
                 "callbacks": {type(cb).__name__: cb.state_dict() for cb in self.callbacks}}
        return weights, state

    def save_resumable(self) -> Path | None:
        weights, state = self.training_state()
        if not self.is_main:
            return None
        return save_resumable(self.cfg.checkpoints, self.step, self.cfg.keep_checkpoints, model=self.raw_model,
                              model_cfg=self.cfg.model, tokenizer_path=self.cfg.tokenizer, train_config=self.cfg,
                              train_state=state, model_state=weights)

    def save_final(self) -> None:
        weights, state = self.training_state()
        if self.is_main:
            save_checkpoint(self.cfg.out_dir, self.raw_model, self.cfg.model, self.cfg.tokenizer, extra=self.summary,
                            train_config=self.cfg, train_state=state, files=[self.log.path], model_state=weights)
            self.log.log_artifact(Path(self.cfg.out_dir) / "train_config.json")
            self.print0(f"saved {self.cfg.out_dir} | {self.summary['tokens_per_sec']:,.0f} tok/s | "
                        f"{self.summary['wall_seconds']:.1f} s", flush=True)

    def restore(self, ckpt: Path) -> None:
        """Load a resumable checkpoint into the (already wrapped) model, optimizer, scheduler, sampler, callbacks
        and this rank's RNGs."""
        state = torch.load(ckpt / "train_state.pt", weights_only=True, map_location="cpu")
        weights = load_file(ckpt / "model.safetensors")
        if self.cfg.model.tie_embeddings:
            weights["lm_head.weight"] = weights["embed_tokens.weight"]
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                                 set_optimizer_state_dict)

            full = StateDictOptions(full_state_dict=True)
            set_model_state_dict(self.raw_model, weights, options=full)
            set_optimizer_state_dict(self.raw_model, self.optimizer, state["optimizer"], options=full)
        else:
            self.raw_model.load_state_dict(weights)
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        for cb in self.callbacks:
            cb.load_state_dict(state["callbacks"].get(type(cb).__name__, {}))
        if state["world_size"] != self.d.world_size:
            warnings.warn(f"{ckpt}: written by {state['world_size']} ranks, resuming on {self.d.world_size}; "
                          "the data order is kept, the RNG streams are not", stacklevel=2)
        set_rng_state(state["rng"][self.d.rank % len(state["rng"])])
        self.step = self.resumed_from = int(state["step"])
        self.epoch = self.sampler.epoch


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


def checkpoint_blocks(model: Transformer) -> None:
    """Activation checkpointing: each decoder block keeps only its input and recomputes the rest in backward
    (non-reentrant, so it composes with DDP, FSDP and torch.compile)."""
    for block in model.layers:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


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


def default_callbacks(cfg: TrainConfig) -> list[Callback]:
    """In call order: clip, validate, maybe stop early, log, show, checkpoint (which sees the stop decision)."""
    callbacks: list[Callback] = []
    if cfg.optim.grad_clip > 0:
        callbacks.append(GradientClipping(cfg.optim.grad_clip))
    if cfg.val_data:
        callbacks.append(Validation(cfg.eval_every))
        if cfg.early_stopping_patience:
            callbacks.append(EarlyStopping(cfg.early_stopping_patience, cfg.early_stopping_min_delta))
    return callbacks + [MetricLogging(cfg.log_every), ProgressBar(), Checkpointing(cfg.checkpoint_every)]


def train(cfg: TrainConfig, callbacks: list[Callback] | None = None) -> dict:
    """Train (resuming if cfg.resume == "auto" finds a checkpoint of this run); rank 0 writes the final checkpoint
    to cfg.out_dir. Returns the run summary (on every rank). `callbacks` replaces default_callbacks(cfg)."""
    t_start = time.time()
    d = init_distributed(cfg.backend, cfg.device)

    # Data: refuse tokens packed with another tokenizer or ids the model cannot embed.
    tok_sha = sha256_file(cfg.tokenizer)
    train_tokens = open_tokens(cfg.train_data, tok_sha, cfg.model.vocab_size, cfg.seq_len)
    val_tokens = open_tokens(cfg.val_data, tok_sha, cfg.model.vocab_size, cfg.seq_len) if cfg.val_data else None
    sampler = WindowSampler(len(train_tokens), cfg.seq_len, cfg.seed)
    val_sampler = WindowSampler(len(val_tokens), cfg.seq_len, cfg.seed + VAL_SEED_OFFSET) if cfg.val_data else None
    per_step = d.world_size * cfg.grad_accum * cfg.batch_size  # samples in one optimizer step
    tokens_per_step = per_step * cfg.seq_len
    max_steps = math.ceil(cfg.max_tokens / tokens_per_step) if cfg.max_tokens else cfg.max_steps

    # Resume? Rank 0 picks the checkpoint (verifying its manifest) and tells the others; a fresh run clears stale ones.
    ckpt = [resumable_checkpoint(cfg) if cfg.resume == "auto" and d.is_main else None]
    if d.world_size > 1:
        dist.broadcast_object_list(ckpt, src=0)
    ckpt = ckpt[0]
    if ckpt is None and d.is_main:
        clear_resumable(cfg.checkpoints)

    # Model: the same seed gives every rank the same initial weights (DDP also broadcasts rank 0's at wrap time).
    torch.manual_seed(cfg.seed)
    raw_model = Transformer(cfg.model).to(d.device)
    n_params = raw_model.num_params()
    if cfg.activation_checkpointing:
        checkpoint_blocks(raw_model)
    if cfg.compile and cfg.compile_cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(cfg.compile_cache_dir).resolve())  # compiled kernels persist
    if cfg.parallel == "fsdp" and d.world_size > 1:
        from torch.distributed.fsdp import fully_shard

        for block in raw_model.layers:  # one all-gather per block, the embedding and head with the root
            fully_shard(block)
        fully_shard(raw_model)
        model = torch.compile(raw_model) if cfg.compile else raw_model
    else:
        model = torch.compile(raw_model) if cfg.compile else raw_model
        if d.world_size > 1:
            # A routed expert that got no tokens on this rank has no gradient: DDP must be told to expect that.
            model = DDP(model, device_ids=[d.local_rank] if d.device.type == "cuda" else None,
                        find_unused_parameters=bool(getattr(cfg.model, "n_experts", 0)))
    autocast = torch.autocast(d.device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bf16")

    # Optimizer: weight decay on matrices (and the embedding) only, not on norm gains. The fused kernel exists on
    # CUDA and CPU (one pass over each parameter instead of several).
    params = list(raw_model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.optim.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = cfg.optim.fused == "on" or (cfg.optim.fused == "auto" and d.device.type in ("cuda", "cpu"))
    optimizer = torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), fused=fused)
    # LambdaLR scales optim.lr by the factor; it counts optimizer steps from 0, as the schedules do.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg.optim, max_steps) / cfg.optim.lr)

    @torch.no_grad()
    def evaluate() -> float:
        """Loss per target token over cfg.eval_batches fixed validation batches of every rank."""
        model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=d.device)  # loss sum, target count
        for i in range(cfg.eval_batches):
            starts = val_sampler.starts(i * d.world_size * cfg.batch_size, d.world_size * cfg.batch_size)
            x, y = read_windows(val_tokens, starts[d.rank * cfg.batch_size : (d.rank + 1) * cfg.batch_size],
                                cfg.seq_len, d.device)
            with autocast:
                logits = model(x)
            total += torch.stack([token_loss_sum(logits, y).double(), (y != IGNORE_INDEX).sum().double()])
        model.train()
        total = run.all_reduce_sum(total)
        return (total[0] / total[1]).item()

    run = Run(cfg=cfg, d=d, raw_model=raw_model, model=model, optimizer=optimizer, scheduler=scheduler,
              sampler=sampler, callbacks=default_callbacks(cfg) if callbacks is None else callbacks,
              evaluate=evaluate, max_steps=max_steps, tokens_per_step=tokens_per_step)
    if ckpt is not None:
        run.restore(ckpt)
        run.print0(f"resuming from {ckpt} (step {run.step})", flush=True)
    # A resumed run keeps the metrics up to its checkpoint and appends.
    run.log = MetricLogger(Path(cfg.out_dir).with_name(Path(cfg.out_dir).name + ".logs"), enabled=d.is_main,
                           resume_step=run.resumed_from)
    run.print0(f"training {n_params:,} parameters on {d.world_size} rank(s) ({d.device}, {cfg.dtype}, "
               f"{cfg.parallel}), {max_steps} steps of {tokens_per_step:,} tokens", flush=True)

    # SIGTERM (a scheduler's preemption, torchrun stopping the group): finish the step, checkpoint, exit 0.
    stop_requested = threading.Event()
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous_handler = signal.signal(signal.SIGTERM, lambda *_: stop_requested.set()) if in_main_thread else None
    timed_seconds, timed_steps = 0.0, 0  # throughput excludes the first step (compilation, allocator warm-up)
    try:
        run.emit("on_train_begin")
        run.emit("on_epoch_begin")
        while not run.finished and not run.stop:
            t0 = time.perf_counter()
            run.lr, run.metrics = scheduler.get_last_lr()[0], {}
            # This step's micro-batches for this rank, and the number of target tokens across all ranks.
            starts = sampler.next_starts(per_step)
            batches = []
            for micro in range(cfg.grad_accum):
                first = (micro * d.world_size + d.rank) * cfg.batch_size
                batches.append(read_windows(train_tokens, starts[first : first + cfg.batch_size], cfg.seq_len, d.device))
            n_targets = torch.tensor(float(sum(int((y != IGNORE_INDEX).sum()) for _, y in batches)), device=d.device)
            run.step_targets = int(run.all_reduce_sum(n_targets).item())
            run.loss_sum = torch.zeros((), device=d.device)
            for run.micro, (x, y) in enumerate(batches):
                run.emit("on_batch_begin")
                # Gradients are all-reduced only on the last micro-step; the earlier ones just accumulate locally.
                with grad_sync(model, raw_model, enabled=run.micro == cfg.grad_accum - 1):
                    with autocast:
                        logits = model(x)
                    loss_sum = token_loss_sum(logits, y, cfg.label_smoothing)
                    loss = loss_sum * (d.world_size / run.step_targets)  # ranks' gradients are averaged, not summed
                    aux = getattr(raw_model, "aux_loss", None)  # e.g. a mixture-of-experts balance loss
                    if isinstance(aux, torch.Tensor):
                        loss = loss + aux / cfg.grad_accum
                    loss.backward()
                run.loss_sum += loss_sum.detach()
                run.emit("on_batch_end")
            # Stop before the update can spread NaNs into the weights. The norm is taken after the all-reduce, so
            # it is the same on every rank (and a non-finite loss on one rank makes it non-finite everywhere).
            run.grad_norm = total_grad_norm(params)
            if not math.isfinite(run.grad_norm.item()) or not math.isfinite(run.loss_sum.item()):
                raise RuntimeError(f"step {run.step + 1}: non-finite loss ({run.loss_sum.item()}) or gradient norm "
                                   f"({run.grad_norm.item()}); lower optim.lr, raise optim.warmup_steps or use fp32")
            run.emit("on_optimizer_step_begin")
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            run.step += 1
            run.finished = run.is_last_step
            # Every rank must agree to stop at the same step, whichever ranks saw the signal.
            if run.all_reduce_sum(torch.tensor(float(stop_requested.is_set()), device=d.device)).item() > 0 \
                    and not run.finished:
                run.stop = "SIGTERM"
            if run.step > (run.resumed_from or 0) + 1 or max_steps == 1:
                timed_seconds, timed_steps = timed_seconds + time.perf_counter() - t0, timed_steps + 1
            run.emit("on_optimizer_step_end")
            if sampler.epoch != run.epoch:
                run.emit("on_epoch_end")
                run.epoch = sampler.epoch
                run.emit("on_epoch_begin")
        run.emit("on_epoch_end")
        if run.stop:
            run.print0(f"stopped at step {run.step}/{max_steps}: {run.stop}", flush=True)
        run.summary = {
            "final_train_loss": run.train_loss,
            "final_val_loss": run.val_loss if val_tokens is not None else None,
            "steps": run.step,
            "max_steps": max_steps,
            "tokens_seen": run.step * tokens_per_step,
            "tokens_per_sec": timed_steps * tokens_per_step / timed_seconds if timed_seconds else float("nan"),
            "n_params": n_params,
            "wall_seconds": time.time() - t_start,
            "world_size": d.world_size,
            "resumed_from_step": run.resumed_from,
            "stopped": run.stop,
        }
        run.emit("on_train_end")
    except BaseException as e:
        run.emit("on_error", e)
        raise
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous_handler)
    cleanup()
    return run.summary


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
    except AstraiError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    finally:
        cleanup()


if __name__ == "__main__":
    main()
