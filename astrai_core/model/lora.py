"""LoRA adapters (Hu et al. 2021): train a low-rank update B @ A beside each frozen projection.

    y = x W^T + b + dropout(x) A^T B^T * (alpha / rank)     A (rank, in), B (out, rank); B starts at zero

Use:
    wrapped = apply_lora(model, ["q_proj", "v_proj"], rank=8, alpha=16, dropout=0.05)   # freezes the rest
    ... train; only lora_A / lora_B get gradients ...
    save_adapters(model, "out/adapter", targets=["q_proj", "v_proj"], rank=8, alpha=16, dropout=0.05)
    load_adapters(fresh_model, "out/adapter")      # applies LoRA from adapter_config.json, then loads the tensors
    merge_lora(model)                               # plain nn.Linear again: the checkpoint saver writes a plain model

LoRALinear subclasses nn.Linear so the frozen weight keeps its name (`layers.0.self_attn.q_proj.weight`): a plain
checkpoint loads into a wrapped model under the same keys, and the adapter adds only `...q_proj.lora_A/lora_B`.
All functions expect the bare Transformer (not DDP- or compile-wrapped), as model_dir.save_checkpoint does.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from astrai_core.model.transformer import Experts
from astrai_core.runtime.errors import AstraiError
from astrai_core.runtime.io import atomic_path

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
NEVER_WRAPPED = ("lm_head",)  # tied to the embedding by default; adapting the vocabulary is not what LoRA is for


class LoRALinear(nn.Linear):
    """A frozen nn.Linear plus a trainable low-rank update; built around an existing layer, sharing its tensors."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        # device="meta" allocates nothing: the base layer's weight and bias are taken over as they are.
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight, self.bias = base.weight, base.bias
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, device=w.device, dtype=w.dtype))
        self.lora_B = nn.Parameter(torch.empty(self.out_features, rank, device=w.device, dtype=w.dtype))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.reset_lora_parameters()

    def reset_lora_parameters(self) -> None:
        # A as nn.Linear initialises its weight, B zero: a fresh adapter adds exactly 0, while B's
        # gradient is not 0, so training moves away from the base model at once.
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Two thin matmuls, never the (out, in) product B @ A; plain F.linear calls so autocast casts each one.
        update = F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B)
        return F.linear(x, self.weight, self.bias) + update * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}"


def apply_lora(model: nn.Module, targets: Sequence[str] | None, rank: int, alpha: float, dropout: float) -> list[str]:
    """Wrap every nn.Linear whose attribute name is in `targets` (e.g. q_proj, v_proj; None: every one but the
    head, whatever projections the architecture has) in a LoRALinear, freeze every other parameter, and return
    the wrapped modules' names. AstraiError if a target matches nothing."""
    assert not any(isinstance(m, LoRALinear) for m in model.modules()), "LoRA is already applied to this model"
    if rank < 1:
        raise AstraiError(f"LoRA rank must be >= 1 (got {rank})")
    linears = {name: m for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] not in NEVER_WRAPPED}
    available = sorted({name.rsplit(".", 1)[-1] for name in linears})
    stacked = sorted({n for m in model.modules() if isinstance(m, Experts) for n, _ in m.named_parameters()})
    chosen = [name for name in linears if targets is None or name.rsplit(".", 1)[-1] in targets]
    for target in targets or ():
        if not any(name.rsplit(".", 1)[-1] == target for name in chosen):
            why = (f"; the MoE experts' {target} is a stacked parameter, not an nn.Linear, and cannot be wrapped"
                   if target in stacked else "")
            raise AstraiError(f"LoRA target {target!r} matches no nn.Linear in the model "
                              f"(available: {', '.join(available)}; lm_head is never wrapped{why})")
    for name in chosen:
        model.set_submodule(name, LoRALinear(linears[name], rank, alpha, dropout))
    for pname, p in model.named_parameters():
        p.requires_grad_(pname.endswith((".lora_A", ".lora_B")))
    return chosen


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter tensors: {"layers.0.self_attn.q_proj.lora_A": ..., ...}."""
    return {k: v for k, v in model.state_dict().items() if k.endswith((".lora_A", ".lora_B"))}


def save_adapters(model: nn.Module, out_dir: str | os.PathLike, *, targets: Sequence[str] | None, rank: int,
                  alpha: float, dropout: float) -> Path:
    """Write `out_dir` with adapter_model.safetensors and adapter_config.json; built beside it and renamed into
    place, so no half-written adapter ever appears. Returns the directory."""
    modules = [name for name, m in model.named_modules() if isinstance(m, LoRALinear)]
    assert modules, "no LoRA adapters in this model: call apply_lora first"
    assert all(m.rank == rank and m.alpha == alpha for m in model.modules() if isinstance(m, LoRALinear))
    state = {k: v.detach().cpu().contiguous() for k, v in lora_state_dict(model).items()}
    targets = sorted({name.rsplit(".", 1)[-1] for name in modules}) if targets is None else list(targets)
    config = {"targets": targets, "rank": rank, "alpha": alpha, "dropout": dropout, "modules": modules}
    with atomic_path(out_dir, "lora adapters") as tmp:
        tmp.mkdir()
        save_file(state, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return Path(out_dir)


def load_adapters(model: nn.Module, adapter_dir: str | os.PathLike) -> list[str]:
    """Load an adapter written by save_adapters into `model`, applying LoRA from its config first if the model
    has none yet. Returns the wrapped modules' names. AstraiError naming the file on any mismatch."""
    adapter_dir = Path(adapter_dir)
    config_path, weights_path = adapter_dir / ADAPTER_CONFIG, adapter_dir / ADAPTER_WEIGHTS
    try:
        cfg = json.loads(config_path.read_text())
        targets, rank, alpha, dropout, modules = (cfg[k] for k in ("targets", "rank", "alpha", "dropout", "modules"))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise AstraiError(f"{config_path}: unreadable adapter config ({type(e).__name__}: {e})") from None
    if not any(isinstance(m, LoRALinear) for m in model.modules()):
        apply_lora(model, targets, rank, alpha, dropout)
    wrapped = {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    if sorted(wrapped) != sorted(modules) or any(m.scaling != alpha / rank for m in wrapped.values()):
        raise AstraiError(f"{config_path}: the model's LoRA layers do not match this adapter (model: "
                          f"{len(wrapped)} modules, adapter: {len(modules)} modules with rank {rank}, alpha {alpha})")
    if not weights_path.is_file():
        raise AstraiError(f"{weights_path}: missing")
    state, expected = load_file(weights_path), lora_state_dict(model)
    missing, unexpected = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
    wrong = [k for k in expected.keys() & state.keys() if state[k].shape != expected[k].shape]
    if missing or unexpected or wrong:
        raise AstraiError(f"{weights_path}: does not match the model's adapters (missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]}, wrong shape {wrong[:3]})")
    model.load_state_dict(state, strict=False)
    return list(wrapped)


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its weight (W + alpha/rank * B @ A, in fp32) and put plain nn.Linear layers back:
    the state dict then has exactly an un-wrapped model's keys. Every parameter trains again. Returns `model`."""
    for name, m in list(model.named_modules()):
        if not isinstance(m, LoRALinear):
            continue
        w = m.weight
        w.copy_(w.float() + m.scaling * (m.lora_B.float() @ m.lora_A.float()))  # fp32 sum, one rounding to w's dtype
        plain = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
        plain.weight, plain.bias = w, m.bias  # the same Parameter objects: an optimizer holding them stays valid
        model.set_submodule(name, plain.train(m.training))
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def count_trainable(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; a tied embedding counts once."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
