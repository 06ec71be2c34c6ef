"""seq: next-token prediction on packed text windows, optionally two-stage KL-regularized."""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from astrai_core.data.batches import Batch, WindowSampler, open_tokens, read_windows, to_device
from astrai_core.model.losses import IGNORE_INDEX, full_kl_sum, token_loss_sum
from astrai_core.model.transformer import Transformer
from astrai_core.runtime.errors import AstraiError
from astrai_core.training.strategies.base import BaseStrategy, frozen_copy

if TYPE_CHECKING:
    from astrai_core.training.config import TrainConfig

VAL_SEED_OFFSET = 10**9  # the validation sampler's seed: never equal to the training sampler's


def window_batch(x: torch.Tensor, y: torch.Tensor, device: torch.device) -> Batch:
    """Windows read into host memory, as a batch on `device`: the targets are counted in host memory, before the
    copy (reading the count back from a GPU would wait for it)."""
    count = int(np.count_nonzero(y.numpy() != IGNORE_INDEX))
    return Batch(to_device(x, device), {"y": to_device(y, device)}, count, x.numel())


class SeqStrategy(BaseStrategy):
    """Next-token prediction on (seq_len + 1)-token windows of the packed stream. With two_stage: after
    stage1_tokens a frozen snapshot becomes the reference and the loss gains beta * KL(policy || reference)
    over the full next-token distributions, on stage 2's own data mixture."""

    def __init__(self, cfg: TrainConfig, rank: int, world_size: int, device: torch.device, tokenizer_sha256: str,
                 autocast: contextlib.AbstractContextManager):
        super().__init__(cfg, rank, world_size, device, tokenizer_sha256, autocast)
        open_ = lambda p: open_tokens(p, tokenizer_sha256, cfg.model.vocab_size, cfg.seq_len)
        self.tokens = open_(cfg.train_data)
        self.sampler = WindowSampler(len(self.tokens), cfg.seq_len, cfg.seed)
        self.val_tokens = open_(cfg.val_data) if cfg.val_data else None
        self.val_sampler = (WindowSampler(len(self.val_tokens), cfg.seq_len, cfg.seed + VAL_SEED_OFFSET)
                            if cfg.val_data else None)
        self.reference: Transformer | None = None
        self.switch_step: int | None = None
        if cfg.two_stage is not None:
            self.switch_step = math.ceil(cfg.two_stage.stage1_tokens / (self.per_step * cfg.seq_len))
            mix = cfg.two_stage.stage2_data or {cfg.train_data: 1.0}
            if any(w <= 0 for w in mix.values()):
                raise AstraiError(f"two_stage.stage2_data: weights must be > 0, got {mix}")
            # Source j: its tokens and its own sampler (the main one when it is train_data itself).
            self.mix_paths = list(mix)
            self.mix_weights = np.array([mix[p] for p in self.mix_paths], dtype=np.float64)
            self.mix_weights /= self.mix_weights.sum()
            self.mix_tokens = [self.tokens if p == cfg.train_data else open_(p) for p in self.mix_paths]
            self.mix_samplers = [self.sampler if p == cfg.train_data else
                                 WindowSampler(len(t), cfg.seq_len, cfg.seed + 1 + j)
                                 for j, (p, t) in enumerate(zip(self.mix_paths, self.mix_tokens))]

    def in_stage2(self, step: int) -> bool:
        return self.switch_step is not None and step >= self.switch_step

    def _stage2_starts(self, step: int) -> tuple[list[Any], np.ndarray]:
        """Stage 2: which source each of the step's samples comes from (seeded by the step), and its start."""
        choice = np.random.default_rng([self.cfg.seed, step]).choice(len(self.mix_paths), self.per_step,
                                                                     p=self.mix_weights)
        starts = np.empty(self.per_step, dtype=np.int64)
        for j, sampler in enumerate(self.mix_samplers):
            sel = choice == j
            starts[sel] = sampler.next_starts(int(sel.sum()))
        return [self.mix_tokens[j] for j in choice], starts

    def prepare(self, step, model, dp):
        if self.in_stage2(step) and self.reference is None:  # the switch: freeze a snapshot of the model as it is now
            self.reference = frozen_copy(model)
            if self.rank == 0:
                print(f"two-stage: step {step}, the reference is frozen; KL beta {self.cfg.two_stage.beta}", flush=True)
        return {}

    def micro_batches(self, step):
        cfg = self.cfg
        if self.in_stage2(step):
            sources, starts = self._stage2_starts(step)
        else:
            sources, starts = None, self.sampler.next_starts(self.per_step)
        batches = []
        for sel in self.my_slices(np.arange(self.per_step)):
            if sources is None:
                batches.append(window_batch(*read_windows(self.tokens, starts[sel], cfg.seq_len), self.device))
                continue
            # A mixture: each window from its own source; the frozen reference's logits for the KL term.
            xs, ys = zip(*(read_windows(sources[i], starts[i : i + 1], cfg.seq_len) for i in sel))
            batch = window_batch(torch.cat(xs), torch.cat(ys), self.device)
            with torch.no_grad(), self.autocast:
                batch.data["ref_logits"] = self.reference(batch.x)
            batches.append(batch)
        return batches

    def loss(self, logits, batch):
        y = batch.data["y"]
        ce = token_loss_sum(logits, y, self.cfg.label_smoothing)
        if "ref_logits" not in batch.data:
            return ce, {}
        kl = full_kl_sum(logits, batch.data["ref_logits"], y)
        return ce + self.cfg.two_stage.beta * kl, {"train/ce": ce.detach(), "train/kl": kl.detach()}

    def eval_batch(self, i):
        b = self.cfg.batch_size
        starts = self.val_sampler.starts(i * self.world_size * b, self.world_size * b)
        return window_batch(*read_windows(self.val_tokens, starts[self.rank * b : (self.rank + 1) * b],
                                          self.cfg.seq_len), self.device)

    def state_dict(self):
        state = super().state_dict()
        if self.switch_step is not None:
            state["mix_consumed"] = [s.consumed for s in self.mix_samplers]
            if self.reference is not None:  # resuming after the switch needs the same reference
                state["reference"] = {k: v.detach().cpu().clone() for k, v in self.reference.state_dict().items()}
        return state

    def load_state_dict(self, state):
        super().load_state_dict(state)
        if self.switch_step is None:
            return
        for s, n in zip(self.mix_samplers, state.get("mix_consumed", [])):
            s.consumed = int(n)
        if "reference" in state:
            self.reference = Transformer(self.cfg.model).to(self.device)
            self.reference.load_state_dict(state["reference"])
            self.reference = frozen_copy(self.reference)

