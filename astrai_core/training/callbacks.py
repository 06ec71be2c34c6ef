"""Callbacks: observers of the training loop (astrai_core/training/train.py), the extension point for users, and
RunState, the loop's counters and decisions they observe.

The loop calls every callback's hook in list order at each point of its lifecycle, passing the RunState:

    on_train_begin
      on_epoch_begin                    an epoch = one pass of the sampler over the training data
        on_batch_begin / on_batch_end   one micro-batch (forward + backward), grad_accum of them per step
        on_optimizer_step_begin         gradients are final (all-reduced, finite, clipped); before optimizer.step()
        on_optimizer_step_end           after the update, validation, logging and any checkpoint; run.step counts it
      on_epoch_end
    on_train_end                        run.summary is set and the final checkpoint written
    on_error(exc)                       anything raised in between (then the exception propagates)

Callbacks observe: they read the RunState (step, micro, epoch, metrics of the step, stop reason) and never change
it; the core steps (clipping, validation, early stopping, logging, checkpoints) are the loop's own. Every rank
runs every callback. A callback with state implements state_dict/load_state_dict; the checkpoint stores it under
the callback's class name.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from astrai_core.runtime.progress import eta


@dataclass
class RunState:
    """The loop's counters and decisions. Callbacks receive it to observe (they read it, never change it); a
    checkpoint keeps state_dict()."""

    max_steps: int
    is_main: bool
    step: int = 0  # optimizer steps done
    micro: int = 0  # micro-step within the current step
    epoch: int = 0  # passes of the sampler over the training data
    metrics: dict[str, float] = field(default_factory=dict)  # what this step logs (empty when it logs nothing)
    train_loss: float = math.nan
    val_loss: float = math.nan
    best_val: float = math.inf  # early stopping: the best validation loss so far
    bad_validations: int = 0  # validations in a row that did not beat best_val
    stop: str | None = None  # why the run stops before max_steps
    resumed_from: int | None = None
    summary: dict[str, Any] = field(default_factory=dict)  # set at the end

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "early_stopping": {"best": self.best_val, "bad": self.bad_validations}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = self.resumed_from = int(state["step"])
        # Checkpoints written before RunState kept early stopping under the callback of that name.
        es = state.get("early_stopping") or state.get("callbacks", {}).get("EarlyStopping") or {}
        self.best_val, self.bad_validations = es.get("best", math.inf), es.get("bad", 0)



class Callback:
    """No-op hooks; override the ones you need."""

    def on_train_begin(self, run: RunState) -> None: ...
    def on_train_end(self, run: RunState) -> None: ...
    def on_epoch_begin(self, run: RunState) -> None: ...
    def on_epoch_end(self, run: RunState) -> None: ...
    def on_batch_begin(self, run: RunState) -> None: ...
    def on_batch_end(self, run: RunState) -> None: ...
    def on_optimizer_step_begin(self, run: RunState) -> None: ...
    def on_optimizer_step_end(self, run: RunState) -> None: ...
    def on_error(self, run: RunState, exc: BaseException) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ProgressBar(Callback):
    """A tqdm bar on rank 0 when stderr is a terminal; the logged metrics as one line per log step either way,
    ending with the time left at the rate measured since the run (or its resumption) began."""

    def on_train_begin(self, run: RunState) -> None:
        self.bar = tqdm(total=run.max_steps, initial=run.step, dynamic_ncols=True,
                        disable=not (run.is_main and sys.stderr.isatty()))
        self.start_step, self.start_time = run.step, time.monotonic()

    def on_optimizer_step_end(self, run: RunState) -> None:
        self.bar.update(1)
        if run.metrics and run.is_main:
            msg = " | ".join([f"step {run.step}/{run.max_steps}"] + [
                f"{k} {v:,.0f}" if k.endswith("per_sec") else f"{k} {v:.4g}" for k, v in run.metrics.items()]
                + [f"eta {eta(run.max_steps - run.step, run.step - self.start_step, time.monotonic() - self.start_time)}"])
            self.bar.write(msg) if not self.bar.disable else print(msg, flush=True)

    def on_train_end(self, run: RunState) -> None:
        self.bar.close()

    def on_error(self, run: RunState, exc: BaseException) -> None:
        self.bar.close()
