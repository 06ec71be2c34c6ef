"""Typed configuration of the training core: the model shape and one training run.

These pydantic models are validated once at the edge (the `astrai train` CLI, the pipeline's params.yaml) and
saved as JSON next to every checkpoint. Unknown keys are errors, so a typo never silently falls back to a default.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, PositiveFloat, PositiveInt, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(Strict):
    """A Llama-family decoder: RMSNorm, RoPE (rotate-half), SwiGLU, grouped-query attention."""

    vocab_size: PositiveInt = 2048
    dim: PositiveInt = 256
    n_layers: PositiveInt = 4
    n_heads: PositiveInt = 4
    n_kv_heads: PositiveInt = 2
    ffn_dim: PositiveInt | None = None  # None: 8/3 * dim rounded up to a multiple of 64 (the Llama rule)
    max_seq_len: PositiveInt = 256
    rope_theta: PositiveFloat = 10000.0
    norm_eps: PositiveFloat = 1e-5
    tie_embeddings: bool = True
    init_std: PositiveFloat = 0.02

    @model_validator(mode="after")
    def _check_heads(self) -> "ModelConfig":
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head dim dim/n_heads ({self.dim // self.n_heads}) must be even for RoPE")
        return self

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        return 64 * ((8 * self.dim // 3 + 63) // 64)


class OptimConfig(Strict):
    """AdamW (weight decay on matrices only), linear warmup then cosine decay to min_lr."""

    lr: PositiveFloat = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 disables clipping


class TrainConfig(Strict):
    """One run of the training core (what `astrai train --config FILE` reads)."""

    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()
    train_data: str  # HDF5 file written by the pack stage
    val_data: str | None = None
    tokenizer: str  # tokenizer.json; its sha256 must match the HDF5 files' attribute
    out_dir: str  # the final checkpoint directory (written atomically)
    seq_len: PositiveInt = 256
    batch_size: PositiveInt = 16  # sequences per rank per micro-step
    grad_accum: PositiveInt = 1
    max_steps: PositiveInt = 200  # optimizer steps
    dtype: Literal["fp32", "bf16"] = "fp32"  # bf16 = autocast; weights and optimizer stay fp32
    device: Literal["auto", "cpu", "cuda"] = "auto"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    seed: int = 1337
    log_every: PositiveInt = 10
    eval_every: int = 0  # 0: validate only at the end
    eval_batches: PositiveInt = 8
    compile: bool = False

    @model_validator(mode="after")
    def _check_lengths(self) -> "TrainConfig":
        if self.seq_len > self.model.max_seq_len:
            raise ValueError(f"seq_len ({self.seq_len}) exceeds model.max_seq_len ({self.model.max_seq_len})")
        if self.optim.min_lr > self.optim.lr:
            raise ValueError(f"optim.min_lr ({self.optim.min_lr}) exceeds optim.lr ({self.optim.lr})")
        return self
