"""The contract between the training loop and a strategy, and what the four strategies share.

Each step the loop (astrai_core/training/train.py) calls, in this order:

    prepare(step, model, dp)   what the step needs from the current policy: GRPO's rollouts (sampled here, with
                               their statistics returned for the loop to log), two-stage's frozen reference
    micro_batches(step)        this rank's micro-batches of the step: batch building only
    loss(logits, batch)        one micro-batch's summed loss and metric sums: a pure function of tensors

and divides the losses by the step's unit count (Batch.count: target tokens, pairs or completion tokens) summed
over all micro-batches and ranks. Besides these: setup(model) once the starting weights are loaded,
validate(...) for held-out metrics, `epoch` for the loop's epoch callbacks, and state_dict()/load_state_dict() for
checkpoints. A strategy never sees or writes the loop's state, and its collective operations run on the data group
`dp` the loop passes. Its data order is a pure function of the step (astrai_core/data/batches.py samplers): its position
(samples drawn so far) and anything else it carries across steps are in state_dict(), so every strategy resumes
exactly.
"""

from __future__ import annotations

import contextlib
import copy
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from astrai_core.data.batches import Batch, IndexSampler
from astrai_core.model.losses import token_loss_sum
from astrai_core.model.transformer import Transformer
from astrai_core.runtime.device import DataGroup
from astrai_core.scoring.metrics import token_loss_total

if TYPE_CHECKING:
    from astrai_core.training.config import TrainConfig


class Strategy(Protocol):
    """What the training loop calls on a strategy, and nothing else."""

    def setup(self, model: Transformer) -> None:
        """Called once the starting weights are loaded (before LoRA or DDP wrap the model)."""

    def prepare(self, step: int, model: Transformer, dp: DataGroup) -> dict[str, tuple[float, float]]:
        """Before step `step` (0-based) builds its batches: whatever it needs from `model`, the bare policy as it is
        now. Returns this rank's statistics of it as (sum, count) pairs, which the loop averages over `dp`."""

    def micro_batches(self, step: int) -> list[Batch]:
        """This rank's micro-batches of optimizer step `step` (0-based)."""

    def loss(self, logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(summed loss, metric sums) of one micro-batch: both divided by the step's total count by the loop."""

    def validate(self, model: torch.nn.Module, raw_model: Transformer, dp: DataGroup) -> dict[str, float]:
        """Held-out metrics, the same on every rank. `model` is the wrapped model the loop trains, `raw_model` the
        bare one."""

    @property
    def epoch(self) -> int:
        """Passes over the training data so far."""

    def state_dict(self) -> dict[str, Any]:
        """The data position ("consumed_samples": samples drawn so far by all ranks) and anything else carried
        across steps; loads with torch.load(weights_only=True)."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def frozen_copy(model: Transformer) -> Transformer:
    """An eval-mode copy of the bare model whose weights never train (a reference)."""
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


class BaseStrategy:
    """What the four strategies share: a sampler over the training items (its position is the data position), this
    rank's share of a step, and by default the next-token loss and the held-out loss of eval_batch batches.
    `rank` and `world_size` are the data-parallel ones: under tensor parallelism a TP group's ranks are one data rank
    and build the same batches."""

    def __init__(self, cfg: TrainConfig, rank: int, world_size: int, device: torch.device, tokenizer_sha256: str,
                 autocast: contextlib.AbstractContextManager):
        self.cfg, self.rank, self.world_size, self.device, self.autocast = cfg, rank, world_size, device, autocast
        self.per_step = world_size * cfg.grad_accum * cfg.batch_size  # samples per optimizer step, all ranks
        self.sampler: IndexSampler

    def setup(self, model: Transformer) -> None:
        pass

    def my_slices(self, items: np.ndarray, b: int | None = None) -> list[np.ndarray]:
        """This rank's micro-batches out of a step's items: micro-step m of rank r takes slice m * ranks + r, of
        b items (batch_size when None)."""
        b = b or self.cfg.batch_size
        return [items[(m * self.world_size + self.rank) * b:][:b] for m in range(self.cfg.grad_accum)]

    def prepare(self, step: int, model: Transformer, dp: DataGroup) -> dict[str, tuple[float, float]]:
        return {}

    def micro_batches(self, step: int) -> list[Batch]:
        raise NotImplementedError

    def loss(self, logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return token_loss_sum(logits, batch.data["y"], self.cfg.label_smoothing), {}

    def eval_batch(self, i: int) -> Batch:
        """This rank's i-th validation batch (fixed across the run); only strategies with val_data have one."""
        raise NotImplementedError

    @torch.no_grad()
    def validate(self, model: torch.nn.Module, raw_model: Transformer, dp: DataGroup) -> dict[str, float]:
        """The loss of eval_batches validation batches."""
        batches = (self.eval_batch(i) for i in range(self.cfg.eval_batches))
        total = dp.all_reduce_sum(token_loss_total(model, batches, self.autocast))
        return {"val/loss": (total[0] / total[1]).item()}

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
