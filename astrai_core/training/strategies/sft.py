"""sft: packed conversations, the loss on assistant tokens only, attention blocked across conversations."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import numpy as np
import torch

from astrai_core.data.batches import Documents, IndexSampler, PackedRows
from astrai_core.training.strategies.base import BaseStrategy

if TYPE_CHECKING:
    from astrai_core.training.config import TrainConfig


class SFTStrategy(BaseStrategy):
    """Supervised fine-tuning on packed conversations: several per row, each attending only to itself, the
    loss on assistant tokens only (the chat_data stage wrote the loss mask)."""

    def __init__(self, cfg: TrainConfig, rank: int, world_size: int, device: torch.device, tokenizer_sha256: str,
                 autocast: contextlib.AbstractContextManager):
        super().__init__(cfg, rank, world_size, device, tokenizer_sha256, autocast)
        rows = lambda p: PackedRows(Documents(p, tokenizer_sha256, cfg.model.vocab_size), cfg.seq_len)
        self.rows = rows(cfg.train_data)
        self.sampler = IndexSampler(len(self.rows.rows), cfg.seed)
        self.val_rows = rows(cfg.val_data) if cfg.val_data else None

    def micro_batches(self, step):
        items = self.sampler.next_indices(self.per_step)
        return [self.rows.batch(sel, self.device) for sel in self.my_slices(items)]

    def eval_batch(self, i):
        n, b = len(self.val_rows.rows), self.cfg.batch_size
        first = (i * self.world_size + self.rank) * b
        return self.val_rows.batch(np.arange(first, first + b) % n, self.device)
