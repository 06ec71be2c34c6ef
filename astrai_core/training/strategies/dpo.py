"""dpo: preference pairs against cached reference log-probabilities."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from astrai_core.data.batches import Batch, Documents, IndexSampler, pair_batch
from astrai_core.model.losses import IGNORE_INDEX, dpo_loss, sequence_logps
from astrai_core.runtime.errors import AstraiError
from astrai_core.scoring.dpo_reference import load_reference_logps
from astrai_core.training.strategies.base import BaseStrategy

if TYPE_CHECKING:
    from astrai_core.training.config import TrainConfig


class DPOStrategy(BaseStrategy):
    """Direct preference optimization. The reference's summed log-probabilities of every response were computed
    once (astrai_core/scoring/dpo_reference.py) and are read from a file keyed by the data's and the weights' hashes."""

    def __init__(self, cfg: TrainConfig, rank: int, world_size: int, device: torch.device, tokenizer_sha256: str,
                 autocast: contextlib.AbstractContextManager):
        super().__init__(cfg, rank, world_size, device, tokenizer_sha256, autocast)
        self.docs = Documents(cfg.train_data, tokenizer_sha256, cfg.model.vocab_size)
        if self.docs.n_docs % 2:
            raise AstraiError(f"{cfg.train_data}: {self.docs.n_docs} documents; DPO pairs need an even number")
        self.ref_logps = load_reference_logps(cfg.dpo.reference_logps, cfg.train_data,
                                              Path(cfg.init_from) / "model.safetensors")
        self.sampler = IndexSampler(self.docs.n_docs // 2, cfg.seed)

    def micro_batches(self, step):
        pairs = self.sampler.next_indices(self.per_step)
        out = []
        for sel in self.my_slices(pairs):
            b = pair_batch(self.docs, sel, self.device)
            ref = torch.from_numpy(self.ref_logps[b["docs"].numpy()]).float().to(self.device)
            out.append(Batch(b["x"], {"y": b["y"], "ref": ref}, len(sel), b["x"].numel()))
        return out

    def loss(self, logits, batch):
        d, c = batch.data, self.cfg.dpo
        logps = sequence_logps(logits, d["y"])
        n = len(logps) // 2
        chosen_tokens = (d["y"][:n] != IGNORE_INDEX).sum(-1)
        losses, r_chosen, r_rejected = dpo_loss(logps[:n], logps[n:], d["ref"][:n], d["ref"][n:], c.beta, c.loss,
                                                c.label_smoothing, c.nll_coef, chosen_tokens)
        return losses.sum(), {"dpo/rewards_chosen": r_chosen.sum(), "dpo/rewards_rejected": r_rejected.sum(),
                              "dpo/reward_margin": (r_chosen - r_rejected).sum(),
                              "dpo/reward_accuracy": (r_chosen > r_rejected).float().sum(),
                              "dpo/logps_chosen": logps[:n].detach().sum(), "dpo/logps_rejected": logps[n:].detach().sum()}
