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
import json
import math
import os
import random
import signal
import sys
import tempfile
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
from astrai_core.checkpoint import (clear_resumable, find_resumable, save_checkpoint, save_resumable,
                                     verify_checkpoint)
from astrai_core.config import TrainConfig
from astrai_core.distributed import Dist, cleanup, init_distributed
from astrai_core.errors import AstraiError
from astrai_core.io import sha256_file
from astrai_core.losses import IGNORE_INDEX, token_loss_sum  # noqa: F401 (re-exported)
from astrai_core.model import Transformer, document_mask
from astrai_core.schedules import lr_at
from astrai_core.strategies import (STRATEGIES, Batch, Strategy, WindowSampler, open_tokens,  # noqa: F401
                                    read_windows)
from astrai_core.tracking import MetricLogger

# Config fields that may change between a run and its resumption without changing what it computes.
RESUME_MAY_CHANGE = {"train_data", "val_data", "tokenizer", "out_dir", "log_every", "compile", "compile_cache_dir",
                     "checkpoint_every", "checkpoint_dir", "keep_checkpoints", "resume"}


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
    strategy: Strategy  # what is trained on, and the loss (astrai_core/strategies.py)
    autocast: Any  # the mixed-precision context every forward runs in
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
    step_targets: int = 0  # the step's loss units (target tokens, pairs, completion tokens), all ranks
    step_tokens: int = 0  # tokens fed to the model this step, all ranks (throughput)
    grad_norm: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    metrics: dict[str, float] = field(default_factory=dict)  # logged at the end of this step
    train_loss: float = math.nan
    val_loss: float = math.nan
    stop: str | None = None  # why the run stops before max_steps
    finished: bool = False  # the run is complete (last step, or early stopping): a final checkpoint follows
    resumed_from: int | None = None
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def sampler(self):
        return self.strategy.sampler

    @property
    def is_main(self) -> bool:
        return self.d.is_main

    @property
    def is_last_step(self) -> bool:
        return self.step >= self.max_steps

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
        rngs, strategy = [rng_state()], [self.strategy.state_dict()]
        if self.d.world_size > 1:
            rngs, strategy = [None] * self.d.world_size, [None] * self.d.world_size
            dist.all_gather_object(rngs, rng_state())
            dist.all_gather_object(strategy, self.strategy.state_dict())
        state = {"step": self.step, "epoch": self.sampler.epoch, "consumed_samples": self.sampler.consumed,
                 "consumed_tokens": self.sampler.consumed * self.cfg.seq_len, "sampler": self.sampler.state_dict(),
                 "optimizer": optim, "scheduler": self.scheduler.state_dict(), "rng": rngs, "strategy": strategy,
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
            files = [self.log.path]
            with contextlib.ExitStack() as stack:
                if self.cfg.lora is not None:  # the adapters on their own, then the merged plain model
                    from astrai_core.lora import merge_lora, save_adapters

                    adapter_dir = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "adapter"
                    lora = self.cfg.lora
                    save_adapters(self.raw_model, adapter_dir, targets=lora.targets, rank=lora.rank, alpha=lora.alpha,
                                  dropout=lora.dropout)
                    files += sorted(adapter_dir.iterdir())
                    merge_lora(self.raw_model)
                    weights = self.raw_model.state_dict()
                save_checkpoint(self.cfg.out_dir, self.raw_model, self.cfg.model, self.cfg.tokenizer,
                                extra=self.summary, train_config=self.cfg, train_state=state, files=files,
                                model_state=weights)
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
        if "strategy" in state:
            self.strategy.load_state_dict(state["strategy"][self.d.rank % len(state["strategy"])])
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
    weights = load_file(ckpt / "model.safetensors")
    if cfg.model.tie_embeddings:
        weights["lm_head.weight"] = weights["embed_tokens.weight"]
    model.load_state_dict(weights)


def train(cfg: TrainConfig, callbacks: list[Callback] | None = None) -> dict:
    """Train (resuming if cfg.resume == "auto" finds a checkpoint of this run); rank 0 writes the final checkpoint
    to cfg.out_dir. Returns the run summary (on every rank). `callbacks` replaces default_callbacks(cfg)."""
    t_start = time.time()
    d = init_distributed(cfg.backend, cfg.device)

    # Data (the strategy's): refuse files packed with another tokenizer or ids the model cannot embed.
    tok_sha = sha256_file(cfg.tokenizer)
    strategy = STRATEGIES[cfg.strategy](cfg, d.rank, d.world_size, d.device, tok_sha)
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
    if cfg.init_from:
        load_initial_weights(raw_model, cfg, tok_sha)
    strategy.setup(raw_model)  # e.g. GRPO freezes its reference here
    if cfg.lora is not None:
        from astrai_core.lora import apply_lora

        if cfg.parallel == "fsdp" and d.world_size > 1:
            raise AstraiError("lora with parallel 'fsdp' is not supported: use ddp (adapters are small)")
        apply_lora(raw_model, cfg.lora.targets, cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout)
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

    # Optimizer: weight decay on matrices (and the embedding) only, not on norm gains; frozen weights (LoRA's base)
    # are left out. The fused kernel exists on CUDA and CPU (one pass over each parameter instead of several).
    params = [p for p in raw_model.parameters() if p.requires_grad]
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
        """Loss per unit over cfg.eval_batches fixed validation batches of every rank (plain loss: no KL term)."""
        model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=d.device)  # loss sum, unit count
        for i in range(cfg.eval_batches):
            batch = strategy.eval_batches(i)
            with autocast:
                logits = model(batch.data["x"], **{k: v for k, v in batch.data.items() if k == "positions"},
                               **({"mask": document_mask(batch.data["doc_ids"])} if "doc_ids" in batch.data else {}))
            y = batch.data["y"]
            total += torch.stack([token_loss_sum(logits, y).double(), (y != IGNORE_INDEX).sum().double()])
        model.train()
        total = run.all_reduce_sum(total)
        return (total[0] / total[1]).item()

    run = Run(cfg=cfg, d=d, raw_model=raw_model, model=model, optimizer=optimizer, scheduler=scheduler,
              strategy=strategy, autocast=autocast,
              callbacks=default_callbacks(cfg) if callbacks is None else callbacks,
              evaluate=evaluate, max_steps=max_steps, tokens_per_step=tokens_per_step)
    if ckpt is not None:
        run.restore(ckpt)
        if run.step > max_steps:  # the loop would never reach max_steps
            raise AstraiError(f"{ckpt}: checkpoint at step {run.step} is beyond max_steps {max_steps}; raise "
                              "max_steps or delete the checkpoint directory to start over")
        run.print0(f"resuming from {ckpt} (step {run.step})", flush=True)
    # A resumed run keeps the metrics up to its checkpoint and appends.
    run.log = MetricLogger(Path(cfg.out_dir).with_name(Path(cfg.out_dir).name + ".logs"), enabled=d.is_main,
                           resume_step=run.resumed_from)
    trainable = sum(p.numel() for p in params)
    run.print0(f"{cfg.strategy}: training {trainable:,} of {n_params:,} parameters on {d.world_size} rank(s) "
               f"({d.device}, {cfg.dtype}, {cfg.parallel}), {max_steps} steps of {per_step} samples", flush=True)

    # SIGTERM (a scheduler's preemption, torchrun stopping the group): finish the step, checkpoint, exit 0.
    stop_requested = threading.Event()
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous_handler = signal.signal(signal.SIGTERM, lambda *_: stop_requested.set()) if in_main_thread else None
    timed_seconds, timed_steps, timed_tokens = 0.0, 0, 0  # throughput excludes the first step (warm-up)
    try:
        run.emit("on_train_begin")
        run.emit("on_epoch_begin")
        while not run.finished and not run.stop:
            t0 = time.perf_counter()
            run.lr, run.metrics = scheduler.get_last_lr()[0], {}
            # This step's micro-batches for this rank; the loss units and tokens across all ranks.
            strategy.step_stats = {}
            batches = strategy.micro_batches(run)
            counts = torch.tensor([float(sum(b.count for b in batches)), float(sum(b.n_tokens for b in batches))],
                                  device=d.device)
            run.step_targets, run.step_tokens = (int(v) for v in run.all_reduce_sum(counts).tolist())
            if run.step_targets == 0:
                raise RuntimeError(f"step {run.step + 1}: no {strategy.unit} to learn from in the whole step "
                                   "(every target masked); check the data")
            run.loss_sum = torch.zeros((), device=d.device)
            metric_sums: dict[str, torch.Tensor] = {}
            for run.micro, batch in enumerate(batches):
                run.emit("on_batch_begin")
                # Gradients are all-reduced only on the last micro-step; the earlier ones just accumulate locally.
                with grad_sync(model, raw_model, enabled=run.micro == cfg.grad_accum - 1):
                    loss_sum, metrics = strategy.loss(run, batch)
                    loss = loss_sum * (d.world_size / run.step_targets)  # ranks' gradients are averaged, not summed
                    aux = getattr(raw_model, "aux_loss", None)  # e.g. a mixture-of-experts balance loss
                    if isinstance(aux, torch.Tensor):
                        loss = loss + aux / cfg.grad_accum
                    loss.backward()
                run.loss_sum += loss_sum.detach()
                for k, v in metrics.items():
                    metric_sums[k] = metric_sums.get(k, 0) + v.detach().float()
                run.emit("on_batch_end")
            log_metrics(run, metric_sums, strategy.step_stats)
            # Stop before the update can spread NaNs into the weights. The norm is taken after the all-reduce, so
            # it is the same on every rank (and a non-finite loss on one rank makes it non-finite everywhere).
            run.grad_norm = total_grad_norm(run.params)
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
                timed_seconds += time.perf_counter() - t0
                timed_steps, timed_tokens = timed_steps + 1, timed_tokens + run.step_tokens
            run.emit("on_optimizer_step_end")
            if strategy.sampler.epoch != run.epoch:
                run.emit("on_epoch_end")
                run.epoch = strategy.sampler.epoch
                run.emit("on_epoch_begin")
        run.emit("on_epoch_end")
        if run.stop:
            run.print0(f"stopped at step {run.step}/{max_steps}: {run.stop}", flush=True)
        run.summary = {
            "strategy": cfg.strategy,
            "final_train_loss": run.train_loss,
            "final_val_loss": run.val_loss if cfg.val_data else None,
            "steps": run.step,
            "max_steps": max_steps,
            "tokens_seen": run.step * tokens_per_step if cfg.strategy == "seq" else None,
            "tokens_per_sec": timed_tokens / timed_seconds if timed_seconds else float("nan"),
            "n_params": n_params,
            "trainable_params": trainable,
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


def log_metrics(run: Run, sums: dict[str, torch.Tensor], stats: dict[str, tuple[float, float]]) -> None:
    """The strategy's metrics for this step, averaged over all ranks: `sums` per loss unit (divided by the
    step's unit count), `stats` as (sum, count) pairs. Every rank holds the same keys, so one all-reduce does."""
    keys, stat_keys = sorted(sums), sorted(stats)
    if not keys and not stat_keys:
        return
    device = run.loss_sum.device
    values = [sums[k].reshape(()).to(device) for k in keys]
    values += [torch.tensor(float(stats[k][i]), device=device) for k in stat_keys for i in (0, 1)]
    total = run.all_reduce_sum(torch.stack(values).double()).tolist()
    for i, k in enumerate(keys):
        run.metrics[k] = total[i] / run.step_targets
    for j, k in enumerate(stat_keys):
        s, n = total[len(keys) + 2 * j], total[len(keys) + 2 * j + 1]
        run.metrics[k] = s / n if n else float("nan")


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
