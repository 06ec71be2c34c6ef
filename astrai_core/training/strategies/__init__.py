"""What the training loop trains on and which loss it takes: per strategy, a batch builder and a loss function.

    seq   next-token prediction on packed text windows (optionally two-stage KL-regularized)    seq.py
    sft   packed conversations: loss on assistant tokens only, attention blocked across them     sft.py
    dpo   preference pairs against cached reference log-probabilities                            dpo.py
    grpo  completions sampled from the policy, scored by reward functions                        grpo.py

The loop calls only the Strategy contract (base.py); STRATEGIES maps TrainConfig.strategy to a constructor.
"""

from astrai_core.training.strategies.base import BaseStrategy, Strategy, frozen_copy
from astrai_core.training.strategies.dpo import DPOStrategy
from astrai_core.training.strategies.grpo import GRPOStrategy, Group, keep_groups
from astrai_core.training.strategies.seq import SeqStrategy
from astrai_core.training.strategies.sft import SFTStrategy

STRATEGIES: dict[str, type[BaseStrategy]] = {"seq": SeqStrategy, "sft": SFTStrategy, "dpo": DPOStrategy,
                                             "grpo": GRPOStrategy}

__all__ = ["STRATEGIES", "BaseStrategy", "DPOStrategy", "GRPOStrategy", "Group", "SFTStrategy", "SeqStrategy",
           "Strategy", "frozen_copy", "keep_groups"]
