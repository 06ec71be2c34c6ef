"""The model's shape: ModelConfig (a Llama-family decoder and its options), validated once where it is read and
saved as config.json in every model folder, and what a shape needs to be split by tensor parallelism."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, PositiveFloat, PositiveInt, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(Strict):
    """A Llama-family decoder: RMSNorm, RoPE (rotate-half), SwiGLU, grouped-query attention. The defaults are plain
    Llama; the options add the Qwen2/Qwen3/DeepSeek variants described in astrai_core/model/transformer.py."""

    vocab_size: PositiveInt = 2048
    dim: PositiveInt = 256
    n_layers: PositiveInt = 4
    n_heads: PositiveInt = 4
    n_kv_heads: PositiveInt = 2  # any divisor of n_heads: 1 = multi-query, n_heads = full multi-head (unused by mla)
    attn_head_dim: PositiveInt | None = None  # width of one head; None: dim / n_heads (Qwen3 sets its own)
    ffn_dim: PositiveInt | None = None  # None: 8/3 * dim rounded up to a multiple of 64 (the Llama rule)
    max_seq_len: PositiveInt = 256
    rope_theta: PositiveFloat = 10000.0
    rope_scaling: Literal["none", "linear", "ntk"] = "none"  # linear: positions / rope_factor; ntk: NTK-aware base
    rope_factor: PositiveFloat = 1.0  # context extension factor of rope_scaling
    norm_eps: PositiveFloat = 1e-5
    tie_embeddings: bool = True
    init_std: PositiveFloat = 0.02
    # Attention variants
    attention: Literal["gqa", "mla"] = "gqa"  # mla: DeepSeek-V2 multi-head latent attention
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm per head on queries and keys before RoPE (Qwen3)
    attn_gate: bool = False  # sigmoid gate on the attention output, per channel, computed from the block input
    mla_kv_rank: PositiveInt = 64  # mla: width of the compressed key/value latent
    mla_rope_dim: PositiveInt = 16  # mla: width of the decoupled RoPE part of queries and keys (one key for all heads)
    # Mixture of experts (DeepSeekMoE): n_experts = 0 keeps the dense SwiGLU MLP
    n_experts: int = 0  # routed experts per layer
    n_shared_experts: int = 0  # experts every token goes through
    moe_top_k: PositiveInt = 2  # routed experts per token
    moe_ffn_dim: PositiveInt | None = None  # hidden width of one expert; None: the dense hidden width
    moe_aux_loss_coef: float = 0.01  # weight of the load-balancing loss (Transformer.aux_loss)
    # Speedrun options (modded-nanogpt / nanochat), each off by default: the default model is unchanged
    mlp: Literal["swiglu", "relu2"] = "swiglu"  # relu2: down(relu(up(x))^2), no gate
    logit_softcap: PositiveFloat | None = None  # logits -> cap * tanh(logits / cap)
    zero_init_out: bool = False  # o_proj and down_proj start at zero: each block starts as the identity
    value_embeds: bool = False  # a second token embedding added to every layer's values, gated per layer
    x0_scalars: bool = False  # each block's input is lambda_r * x + lambda_0 * x0 (x0: the embedding), learnt

    @model_validator(mode="after")
    def _check_heads(self) -> "ModelConfig":
        if self.attn_head_dim is None and self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads}), or set attn_head_dim")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head dim ({self.head_dim}: attn_head_dim or dim/n_heads) must be even for RoPE")
        if (self.rope_scaling == "none") != (self.rope_factor == 1.0):
            raise ValueError(f"rope_factor ({self.rope_factor}) and rope_scaling ({self.rope_scaling!r}) go together: "
                             "rope_scaling linear or ntk with rope_factor > 1, or none with rope_factor 1")
        if self.rope_scaling == "ntk" and self.rope_head_dim <= 2:
            raise ValueError("rope_scaling 'ntk' needs a RoPE width above 2 (attn_head_dim, or mla_rope_dim with mla)")
        if self.attention == "mla":
            if self.qk_norm or self.qkv_bias:
                raise ValueError("attention 'mla' does not support qk_norm or qkv_bias: set them to false")
            if self.mla_rope_dim % 2:
                raise ValueError(f"mla_rope_dim ({self.mla_rope_dim}) must be even for RoPE")
        for name in ("n_experts", "n_shared_experts", "moe_aux_loss_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 0")
        if self.n_experts and self.moe_top_k > self.n_experts:
            raise ValueError(f"moe_top_k ({self.moe_top_k}) exceeds n_experts ({self.n_experts})")
        if self.n_shared_experts and not self.n_experts:
            raise ValueError("n_shared_experts needs routed experts: set n_experts > 0 (or n_shared_experts to 0)")
        if self.mlp == "relu2" and self.n_experts:
            raise ValueError("mlp 'relu2' is not supported with experts (they are SwiGLU): set n_experts to 0")
        if self.value_embeds and self.attention == "mla":
            raise ValueError("value_embeds needs attention 'gqa' (mla has no per-head values to add to)")
        return self

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.dim // self.n_heads

    @property
    def rope_head_dim(self) -> int:
        """The width RoPE rotates: the whole head, or only the decoupled part with mla."""
        return self.mla_rope_dim if self.attention == "mla" else self.head_dim

    @property
    def expert_hidden_dim(self) -> int:
        return self.moe_ffn_dim or self.hidden_dim

    @property
    def hidden_dim(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        return 64 * ((8 * self.dim // 3 + 63) // 64)

    def resolved(self) -> dict:
        """The shape with its derived widths written out (ffn_dim None -> 8/3 * dim rounded, ...): two configs
        describe the same model exactly when these are equal (a checkpoint stores `ffn_dim: null`, an import 384)."""
        return {**self.model_dump(mode="json"), "ffn_dim": self.hidden_dim, "attn_head_dim": self.head_dim,
                "moe_ffn_dim": self.expert_hidden_dim}

    def differences(self, other: "ModelConfig") -> list[str]:
        """The fields whose resolved values differ from `other`'s."""
        mine, theirs = self.resolved(), other.resolved()
        return sorted(k for k in mine if mine[k] != theirs[k])


def check_tensor_parallel(cfg: ModelConfig, tp_size: int, lora: bool = False) -> None:
    """Raise ValueError naming the option if a model of this config (with LoRA adapters: `lora`) cannot be split
    tp_size ways. Needs no process group, so a config can be checked before any rank starts."""
    if cfg.attention == "mla":
        raise ValueError("model.attention 'mla' is not supported with tensor parallelism (its shared key/value "
                         "latent is not split by heads): use attention 'gqa', or parallel ddp/fsdp")
    if cfg.n_experts:
        raise ValueError(f"model.n_experts ({cfg.n_experts}) is not supported with tensor parallelism (experts need "
                         "expert parallelism): set n_experts to 0, or use parallel ddp/fsdp")
    if cfg.value_embeds:  # its table would have to be split by kv heads like v_proj
        raise ValueError("model.value_embeds is not supported with tensor parallelism: set it to false, or use "
                         "parallel ddp/fsdp")
    if lora:
        raise ValueError("lora is not supported with tensor parallelism (adapters are small: use parallel ddp)")
    for field in ("n_heads", "n_kv_heads"):
        if getattr(cfg, field) % tp_size:
            raise ValueError(f"model.{field} ({getattr(cfg, field)}) is not divisible by tp_size ({tp_size})")
