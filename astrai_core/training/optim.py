"""The optimizer and its learning-rate schedule: build_optimizer, and the schedules: lr of optimizer step `step`
(0-based) for a run of `max_steps` steps.

Each schedule is a plain function (step, optim, max_steps) -> lr; SCHEDULES maps `optim.schedule` to it. All share the
same linear warmup from optim.lr / (warmup_steps + 1) to optim.lr at step warmup_steps, and after it never go
below optim.min_lr. The loop drives them through torch's LambdaLR, whose state is just the step count.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from astrai_core.training.config import OptimConfig


def _warmup(step: int, optim: OptimConfig) -> float:
    return optim.lr * (step + 1) / (optim.warmup_steps + 1)


def _cosine(progress: float, optim: OptimConfig) -> float:
    """optim.lr at progress 0 down to optim.min_lr at progress 1."""
    return optim.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (optim.lr - optim.min_lr)


def warmup_cosine(step: int, optim: OptimConfig, max_steps: int) -> float:
    """Warmup, then one cosine decay to min_lr at max_steps (nanoGPT's schedule)."""
    if step < optim.warmup_steps:
        return _warmup(step, optim)
    if step >= max_steps:
        return optim.min_lr
    return _cosine((step - optim.warmup_steps) / (max_steps - optim.warmup_steps), optim)


def sgdr(step: int, optim: OptimConfig, max_steps: int) -> float:
    """Warmup, then cosine cycles that restart at optim.lr (SGDR, Loshchilov & Hutter 2017): the first cycle lasts
    restart_period steps, each next one restart_mult times longer. max_steps does not shape it."""
    if step < optim.warmup_steps:
        return _warmup(step, optim)
    t, period = step - optim.warmup_steps, float(optim.restart_period)
    while t >= period:  # a few iterations: cycles grow geometrically (or stay fixed when restart_mult == 1)
        t -= period
        period *= optim.restart_mult
    return _cosine(t / period, optim)


def warmup_stable_decay(step: int, optim: OptimConfig, max_steps: int) -> float:
    """Warmup, constant optim.lr, then a linear decay to min_lr over the last decay_fraction of max_steps (WSD,
    as in MiniCPM): the stable phase can be extended without knowing the final length in advance."""
    if step < optim.warmup_steps:
        return _warmup(step, optim)
    decay_steps = max(1, round(optim.decay_fraction * max_steps))
    decay_start = max(optim.warmup_steps, max_steps - decay_steps)
    if step < decay_start:
        return optim.lr
    progress = min(1.0, (step - decay_start) / max(1, max_steps - decay_start))
    return optim.lr + progress * (optim.min_lr - optim.lr)


SCHEDULES: dict[str, Callable[[int, OptimConfig, int], float]] = {
    "cosine": warmup_cosine,
    "sgdr": sgdr,
    "wsd": warmup_stable_decay,
}


def lr_at(step: int, optim: OptimConfig, max_steps: int) -> float:
    """The configured schedule's learning rate at optimizer step `step`."""
    return SCHEDULES[optim.schedule](step, optim, max_steps)


def build_optimizer(model: torch.nn.Module, optim: OptimConfig, device: torch.device, max_steps: int):
    """(optimizer, scheduler) over the trainable weights (LoRA's frozen base is left out). LambdaLR scales each
    group's peak lr by the schedule's factor; it counts optimizer steps from 0, as the schedules do.

    adamw: AdamW with weight decay on matrices (and the embedding) only, not on norm gains. The fused kernel
    exists on CUDA and CPU (one pass over each parameter instead of several).
    muon: torch.optim.Muon on the 2-D weights of the decoder blocks, AdamW as above on the rest (the embedding and
    the head are not hidden matrices: Muon's update treats every output direction alike, which suits neither);
    both step together as one Chain."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    fused = optim.fused == "on" or (optim.fused == "auto" and device.type in ("cuda", "cpu"))
    hidden = [p for n, p in named if p.dim() == 2 and n.startswith("layers.")] if optim.name == "muon" else []
    rest = [p for _, p in named if not any(p is h for h in hidden)]
    groups = [
        {"params": [p for p in rest if p.dim() >= 2], "weight_decay": optim.weight_decay},
        {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
    ]
    adamw = torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), fused=fused)
    factor = lambda step: lr_at(step, optim, max_steps) / optim.lr  # noqa: E731 - the schedule's share of the peak
    if not hidden:
        return adamw, torch.optim.lr_scheduler.LambdaLR(adamw, factor)
    muon = torch.optim.Muon(hidden, lr=optim.muon_lr or optim.lr, momentum=optim.muon_momentum,
                            weight_decay=optim.weight_decay if optim.muon_weight_decay is None else optim.muon_weight_decay,
                            adjust_lr_fn="match_rms_adamw")
    return (Chain(muon=muon, adamw=adamw),
            Chain(muon=torch.optim.lr_scheduler.LambdaLR(muon, factor), adamw=torch.optim.lr_scheduler.LambdaLR(adamw, factor)))


class Chain:
    """Several optimizers (or their schedules) used as one: each call goes to every part; the state is theirs,
    keyed by part name. get_last_lr is the first part's."""

    def __init__(self, **parts) -> None:
        self.parts = parts

    def step(self) -> None:
        for part in self.parts.values():
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts.values():
            part.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict]:
        return [g for part in self.parts.values() for g in part.param_groups]

    def get_last_lr(self) -> list[float]:
        return next(iter(self.parts.values())).get_last_lr()

    def state_dict(self) -> dict:
        return {name: part.state_dict() for name, part in self.parts.items()}

    def load_state_dict(self, state: dict) -> None:
        for name, part in self.parts.items():
            part.load_state_dict(state[name])
