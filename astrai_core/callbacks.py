"""The training loop's callbacks: what happens around the steps, kept out of the loop's arithmetic.

The loop (astrai_core/train.py) calls every callback's hook in list order at each point of its lifecycle:

    on_train_begin
      on_epoch_begin                    an epoch = one pass of the sampler over the training windows
        on_batch_begin / on_batch_end   one micro-batch (forward + backward), grad_accum of them per step
        on_optimizer_step_begin         gradients are final (all-reduced) and finite; before optimizer.step()
        on_optimizer_step_end           after the update; run.step counts it
      on_epoch_end
    on_train_end                        run.summary is set
    on_error(exc)                       anything raised in between (then the exception propagates)

Every rank runs every callback, so a callback may use collectives (validation, the train-loss all-reduce,
gathering RNG states); rank-0-only effects (files, MLflow, the progress bar) go through run.log / run.print0,
which do nothing on the other ranks. A callback with state implements state_dict/load_state_dict; the checkpoint
stores it under the callback's class name.
"""

from __future__ import annotations

import math
import sys
import time
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

if TYPE_CHECKING:
    from astrai_core.train import Run


class Callback:
    """No-op hooks; override the ones you need."""

    def on_train_begin(self, run: "Run") -> None: ...
    def on_train_end(self, run: "Run") -> None: ...
    def on_epoch_begin(self, run: "Run") -> None: ...
    def on_epoch_end(self, run: "Run") -> None: ...
    def on_batch_begin(self, run: "Run") -> None: ...
    def on_batch_end(self, run: "Run") -> None: ...
    def on_optimizer_step_begin(self, run: "Run") -> None: ...
    def on_optimizer_step_end(self, run: "Run") -> None: ...
    def on_error(self, run: "Run", exc: BaseException) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class GradientClipping(Callback):
    """Scale the gradients so their global norm (run.grad_norm, computed by the loop) is at most max_norm."""

    def __init__(self, max_norm: float) -> None:
        self.max_norm = max_norm

    def on_optimizer_step_begin(self, run: "Run") -> None:
        torch.nn.utils.clip_grads_with_norm_(run.params, self.max_norm, run.grad_norm)


class Validation(Callback):
    """Validation loss every `every` steps (0: only after the last step), into run.metrics["val/loss"]."""

    def __init__(self, every: int) -> None:
        self.every = every

    def on_optimizer_step_end(self, run: "Run") -> None:
        if (self.every > 0 and run.step % self.every == 0) or run.is_last_step:
            run.val_loss = run.evaluate()
            run.metrics["val/loss"] = run.val_loss


class EarlyStopping(Callback):
    """Stop when `patience` validations in a row failed to lower the best validation loss by more than
    min_delta. Must come after Validation in the list."""

    def __init__(self, patience: int, min_delta: float = 0.0) -> None:
        self.patience, self.min_delta = patience, min_delta
        self.best, self.bad = math.inf, 0

    def on_optimizer_step_end(self, run: "Run") -> None:
        if "val/loss" not in run.metrics:
            return
        if run.metrics["val/loss"] < self.best - self.min_delta:
            self.best, self.bad = run.metrics["val/loss"], 0
        else:
            self.bad += 1
        if self.bad >= self.patience and not run.finished:
            run.stop = f"early stopping: no val/loss improvement in {self.bad} validations (best {self.best:.4f})"
            run.finished = True  # a complete run: the final checkpoint goes to out_dir

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad": self.bad}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.bad = state["best"], state["bad"]


class MetricLogging(Callback):
    """Every log_every steps (and on the last step, or whenever validation ran): train loss (mean over the
    window's target tokens on all ranks), lr, gradient norm, tokens/s into metrics.jsonl and MLflow (rank 0)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.seconds, self.tokens = 0.0, 0
        self.t0 = 0.0

    def on_train_begin(self, run: "Run") -> None:
        run.log.log_params(run.cfg.model_dump())

    def on_batch_begin(self, run: "Run") -> None:
        if run.micro == 0:
            self.t0 = time.perf_counter()

    def on_optimizer_step_end(self, run: "Run") -> None:
        self.seconds += time.perf_counter() - self.t0
        self.tokens += run.step_tokens
        if run.step % self.every == 0 or run.is_last_step or run.stop:
            run.train_loss = run.all_reduce_sum(run.loss_sum.clone()).item() / run.step_targets
            run.metrics.update({"train/loss": run.train_loss, "train/lr": run.lr,
                                "train/grad_norm": float(run.grad_norm),
                                "train/tokens_per_sec": self.tokens / self.seconds})
            self.seconds, self.tokens = 0.0, 0
        if run.metrics:
            run.log.log(run.metrics, step=run.step)


class ProgressBar(Callback):
    """A tqdm bar on rank 0 when stderr is a terminal; the logged metrics as one line per log step either way."""

    def on_train_begin(self, run: "Run") -> None:
        self.bar = tqdm(total=run.max_steps, initial=run.step, dynamic_ncols=True,
                        disable=not (run.is_main and sys.stderr.isatty()))

    def on_optimizer_step_end(self, run: "Run") -> None:
        self.bar.update(1)
        if run.metrics:
            msg = " | ".join([f"step {run.step}/{run.max_steps}"] + [
                f"{k} {v:,.0f}" if k.endswith("per_sec") else f"{k} {v:.4g}" for k, v in run.metrics.items()])
            self.bar.write(msg) if not self.bar.disable else run.print0(msg, flush=True)

    def on_train_end(self, run: "Run") -> None:
        self.bar.close()

    def on_error(self, run: "Run", exc: BaseException) -> None:
        self.bar.close()


class Checkpointing(Callback):
    """A resumable checkpoint every `every` steps and when the run is asked to stop (SIGTERM, early stopping),
    and the final checkpoint in cfg.out_dir at the end. Saving is collective (RNG states are gathered); rank 0
    writes."""

    def __init__(self, every: int) -> None:
        self.every = every

    def on_optimizer_step_end(self, run: "Run") -> None:
        if run.finished:  # the final checkpoint follows in on_train_end
            return
        if (self.every > 0 and run.step % self.every == 0) or run.stop:
            path = run.save_resumable()
            run.print0(f"checkpoint {path}", flush=True)

    def on_train_end(self, run: "Run") -> None:
        if run.finished:  # else interrupted: the resumable checkpoint is what the run leaves
            run.save_final()
