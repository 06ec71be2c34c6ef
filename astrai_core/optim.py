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

from astrai_core.config import OptimConfig


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
    """(optimizer, scheduler): AdamW with weight decay on matrices (and the embedding) only, not on norm gains;
    frozen weights (LoRA's base) are left out. The fused kernel exists on CUDA and CPU (one pass over each
    parameter instead of several). LambdaLR scales optim.lr by the schedule's factor; it counts optimizer steps
    from 0, as the schedules do."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": optim.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = optim.fused == "on" or (optim.fused == "auto" and device.type in ("cuda", "cpu"))
    optimizer = torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), fused=fused)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, optim, max_steps) / optim.lr)
    return optimizer, scheduler
