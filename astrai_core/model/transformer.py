"""A Llama-family decoder-only Transformer, readable in one sitting.

    token ids -> embed_tokens -> n_layers x Block -> norm -> lm_head -> logits
    Block:  x = x + self_attn(input_layernorm(x))          grouped-query attention with RoPE (or latent attention)
            x = x + mlp(post_attention_layernorm(x))       SwiGLU (or a mixture of SwiGLU experts)

The defaults are plain Llama. ModelConfig options add, each a few lines below:
    qkv_bias      biases on q/k/v (Qwen2)                  qk_norm    RMSNorm per head on q and k before RoPE (Qwen3)
    attn_gate     sigmoid gate on the attention output     rope_scaling linear or NTK-aware (rope_tables)
    attention=mla DeepSeek-V2 multi-head latent attention (LatentAttention)
    n_experts     DeepSeekMoE: shared + top-k routed experts with a load-balancing loss (MoE)
and the speedrun options of modded-nanogpt / nanochat (hf.py refuses to export all but zero_init_out):
    mlp=relu2     down(relu(up(x))^2), no gate             logit_softcap  cap * tanh(logits / cap)
    zero_init_out o_proj and down_proj start at zero       value_embeds   a second embedding added to the values
    x0_scalars    block input lambda_r * x + lambda_0 * x0 (x0 = the token embedding), learnt per block

Parameter names follow Hugging Face's LlamaForCausalLM / Qwen3 / DeepSeek-V2 (`model.` prefix dropped), and RoPE
uses the same rotate-half convention, so astrai_core/convert/hf.py maps a state dict onto an HF checkpoint by renaming.
No dropout: small models trained for one epoch do not need it.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from astrai_core.model.config import ModelConfig


def rope_tables(head_dim: int, max_seq_len: int, theta: float, scaling: str = "none",
                factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (max_seq_len, head_dim), computed in fp32 exactly as HF's rotary embeddings do.

    linear: positions divided by `factor` (HF rope_type "linear"). ntk: NTK-aware scaling, the base raised to
    theta * factor ** (d / (d - 2)) so the lowest frequency stretches by `factor` while the highest stays put; HF
    has no static NTK type, so hf.py exports it as a plain rope_theta of that value (the same numbers)."""
    if scaling == "ntk":
        theta = theta * factor ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling == "linear":
        inv_freq = inv_freq / factor
    freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)  # (T, head_dim / 2)
    emb = torch.cat((freqs, freqs), dim=-1)  # rotate-half: dimension i pairs with i + head_dim / 2
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, n_heads, T, head_dim); cos, sin: (T, head_dim). Tables cast to x's dtype so bf16 stays bf16."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (w * x / rms(x) in `dtype`, 1 / rms(x)), computed in fp32."""
    xf = x.float()
    r = (torch.linalg.vecdot(xf, xf, dim=-1).unsqueeze(-1) / x.shape[-1] + eps).rsqrt_()
    return (xf * r).mul_(weight).to(dtype), r


class _RMSNormFn(torch.autograd.Function):
    """y = w * x / rms(x), computed in fp32, returned in `dtype`. On CPU, autograd differentiates F.rms_norm's
    composite form (pow, mean, rsqrt and two muls, each with its backward); this closed form,
    dx = r (g w - x^ mean(g w x^)), dw = sum(g x^) with r = 1 / rms(x), x^ = x r, takes about half the passes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
        y, r = _rms_norm(x, weight, eps, dtype)
        ctx.save_for_backward(x, weight, r)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, r = ctx.saved_tensors
        xhat, g = x.float() * r, grad.float()
        gw = g * weight.float()
        mean = torch.linalg.vecdot(gw, xhat, dim=-1).unsqueeze(-1) / x.shape[-1]
        dx = torch.addcmul(gw, xhat, mean, value=-1).mul_(r)
        dw = (g * xhat).flatten(0, -2).sum(0)
        return dx.to(x.dtype), dw.to(weight.dtype), None, None


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (the same `weight`) through _RMSNormFn. Under autocast the output is already the autocast
    dtype: cast once here instead of once by each linear that reads it (q, k, v; gate, up), in both passes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        if not torch.is_grad_enabled():  # inference: the same numbers without autograd.Function's per-call cost
            return _rms_norm(x, self.weight, eps, dtype)[0]
        return _RMSNormFn.apply(x, self.weight, eps, dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool = False,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """Queries (B, h, T, d) are the last T of the S = k.shape[-2] positions (S > T when a cache holds the rest).
    `mask` (B, 1, T, S), True = may attend, replaces the causal rule (see document_mask; the engine's runner builds its own)."""
    T, S = q.shape[-2], k.shape[-2]
    if mask is None and T == S:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
    if mask is None:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)  # query t sees keys <= S - T + t
    if enable_gqa and T == 1 and q.dtype != torch.float32:
        # A decode step in bf16: the query heads that share a KV head are that head's queries, (B, kv heads, group,
        # S) in one call, the mask broadcast over them. SDPA's bf16 CPU kernel with enable_gqa and one query per head
        # took 1.7-7.5x as long (SmolLM2-135M's 9 / 3 heads, 1 thread: 50 against 11.5 ms for 16 rows of 128 keys
        # in 30 layers; bench/decode_attention_report.json). In fp32 the two are level (0.79-1.25x): unchanged.
        B, H, _, D = q.shape
        y = F.scaled_dot_product_attention(q.reshape(B, k.shape[1], H // k.shape[1], D), k, v, attn_mask=mask)
        return y.reshape(B, H, 1, D)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document index per position -> (B, 1, T, T) attention mask: causal and within the same document,
    so several sequences packed into one row never see each other."""
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    return (causal & (doc_ids[:, :, None] == doc_ids[:, None, :])).unsqueeze(1)


class KVCache:
    """What incremental decoding keeps per layer, time on dim -2: (k, v) after RoPE for grouped-query attention,
    2 * n_kv_heads * head_dim numbers per token; (normed latent, RoPE key) for MLA, mla_kv_rank + mla_rope_dim.
    Use: cache = KVCache(); logits = model(prompt, cache); then model(next_ids, cache) per step."""

    def __init__(self) -> None:
        self.layers: dict[int, tuple[torch.Tensor, ...]] = {}
        self.length = 0  # positions cached (the next token's position)

    def extend(self, layer: int, *new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        old = self.layers.get(layer)
        self.layers[layer] = new if old is None else tuple(torch.cat([o, n], dim=-2) for o, n in zip(old, new))
        return self.layers[layer]

    def numbers_per_token(self) -> int:
        """Cached numbers per token and batch row, summed over layers."""
        return sum(t.numel() // (t.shape[0] * t.shape[-2]) for ts in self.layers.values() for t in ts)


class Attention(nn.Module):
    """Causal grouped-query attention: n_kv_heads key/value heads, each shared by n_heads / n_kv_heads queries."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        # QK-norm (Qwen3): bounds the attention logits, which keeps training stable at higher learning rates.
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        # Gated attention (Qiu et al. 2025): y * sigmoid(W x) per channel lets a head output nothing, which removes
        # the attention sink and the loss spikes that come with it.
        self.gate_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False) if cfg.attn_gate else None
        # Value embeddings (modded-nanogpt): v += value_gate * value_embed(token). Starts at 0, so the model
        # starts as without them; the gate learns how much of the token's own vector to pass to every head.
        self.value_gate = nn.Parameter(torch.zeros(())) if cfg.value_embeds else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None,
                layer: int = 0, mask: torch.Tensor | None = None, ve: torch.Tensor | None = None) -> torch.Tensor:
        """ve: (B, T, n_kv_heads * head_dim) value embeddings of the tokens, with value_embeds."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x)
        if ve is not None:  # before the cache: cached values include it, so decoding needs no token ids
            v = v + self.value_gate * ve
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (B, nh, T, hd)
        k = apply_rope(k.transpose(1, 2), cos, sin)  # (B, nkv, T, hd)
        if cache is not None:
            k, v = cache.extend(layer, k, v)  # (B, nkv, S, hd): every position so far
        # enable_gqa: query head h reads kv head h // (n_heads / n_kv_heads), the same grouping as HF's repeat_kv.
        y = causal_attention(q, k, v, enable_gqa=self.n_kv_heads != self.n_heads, mask=mask)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        if self.gate_proj is not None:
            y = y * torch.sigmoid(self.gate_proj(x))
        return self.o_proj(y)


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2, q_lora_rank = None as in V2-Lite).

    Keys and values of all heads are expanded from one compressed latent c (B, T, mla_kv_rank) per token, plus one
    decoupled RoPE key (B, T, mla_rope_dim) shared by the heads: a generator's cache holds only these two, not
    full keys and values. Each head's query/key is [no-RoPE part (head_dim) | RoPE part (mla_rope_dim)]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.nope_dim, self.rope_dim, self.v_dim = cfg.n_heads, cfg.head_dim, cfg.mla_rope_dim, cfg.head_dim
        self.kv_rank = cfg.mla_kv_rank
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * (self.nope_dim + self.rope_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.dim, self.kv_rank + self.rope_dim, bias=False)  # latent | RoPE key
        self.kv_a_layernorm = nn.RMSNorm(self.kv_rank, eps=1e-6)  # HF DeepSeek-V2 fixes this eps
        self.kv_b_proj = nn.Linear(self.kv_rank, cfg.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * self.v_dim, cfg.dim, bias=False)
        self.gate_proj = nn.Linear(cfg.dim, cfg.n_heads * self.v_dim, bias=False) if cfg.attn_gate else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None,
                layer: int = 0, mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.nope_dim + self.rope_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_layernorm(latent), apply_rope(k_rope.unsqueeze(1), cos, sin)  # (B, 1, T, rope)
        if cache is not None:  # the cache holds only these: kv_rank + rope_dim numbers per token and layer
            latent, k_rope = cache.extend(layer, latent, k_rope)
        S = latent.shape[1]
        # Expanded from the latent at every step (no weight absorption: simple, and fine for small models).
        kv = self.kv_b_proj(latent).view(B, S, self.n_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope_dim, self.v_dim], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(B, self.n_heads, S, self.rope_dim)], dim=-1)
        y = causal_attention(q, k, v, mask=mask)  # scale 1/sqrt(nope + rope), as HF
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.v_dim)
        if self.gate_proj is not None:
            y = y * torch.sigmoid(self.gate_proj(x))
        return self.o_proj(y)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); relu2: down(relu(up(x))^2), no gate (modded-nanogpt, Primer)."""

    def __init__(self, dim: int, hidden_dim: int, relu2: bool = False) -> None:
        super().__init__()
        self.gate_proj = None if relu2 else nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is None:
            return self.down_proj(F.relu(self.up_proj(x)).square())
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """n_experts SwiGLU experts as two stacked weights (HF transformers 5 layout): gate_up_proj (E, 2 * h, dim)
    and down_proj (E, dim, h). One parameter for all experts also keeps DDP happy: it always gets a gradient,
    zero in the slices of experts that received no tokens."""

    def __init__(self, n_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * hidden_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))

    def forward(self, x: torch.Tensor, expert_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (N, dim); expert_idx, weights (N, k) -> sum over the k chosen experts of weight * expert(x)."""
        out = torch.zeros_like(x)
        for e in range(self.gate_up_proj.shape[0]):
            token, slot = torch.where(expert_idx == e)  # may be empty: the matmuls then run on 0 rows
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


class MoE(nn.Module):
    """DeepSeekMoE (Dai et al. 2024): shared experts every token uses + routed experts, each token sent to the
    top-k by softmax router score and weighted by that score (not renormalized). Load-balancing loss
    (their eq. 12-14): coef * sum_i f_i * P_i with f_i = E / (k N) * tokens routed to i, P_i = mean score of i;
    it is 1 * coef when the load is uniform."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.coef = cfg.moe_top_k, cfg.moe_aux_loss_coef
        self.gate = nn.Linear(cfg.dim, cfg.n_experts, bias=False)  # the router
        self.experts = Experts(cfg.n_experts, cfg.dim, cfg.expert_hidden_dim)
        # n shared experts of width h act as one SwiGLU of width n * h (the sum of their outputs is that MLP).
        self.shared_experts = (MLP(cfg.dim, cfg.n_shared_experts * cfg.expert_hidden_dim)
                               if cfg.n_shared_experts else None)
        # Set by each forward. Plain attributes, not buffers: DDP would broadcast buffers from rank 0 every step.
        self.aux_loss = torch.zeros(())
        self.tokens_per_expert = torch.zeros(cfg.n_experts, dtype=torch.long)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        flat = x.reshape(-1, D)
        scores = F.softmax(self.gate(flat).float(), dim=-1)  # (N, E), fp32 as HF
        weights, expert_idx = scores.topk(self.top_k, dim=-1)  # (N, k)
        out = self.experts(flat, expert_idx, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        n_experts = scores.shape[-1]
        counts = torch.bincount(expert_idx.flatten(), minlength=n_experts)
        self.tokens_per_expert = counts.detach()
        load = counts.float() * n_experts / (self.top_k * flat.shape[0])  # f_i
        self.aux_loss = self.coef * (load * scores.mean(0)).sum()
        return out.view(B, T, D)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.self_attn = LatentAttention(cfg) if cfg.attention == "mla" else Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = MoE(cfg) if cfg.n_experts else MLP(cfg.dim, cfg.hidden_dim, relu2=cfg.mlp == "relu2")
        # x0 scalars (modded-nanogpt): the block reads lambda_r * x + lambda_0 * x0, so every layer can reach the
        # token embedding directly. Starting at (1, 0), the model starts as without them.
        self.resid_lambda = nn.Parameter(torch.ones(())) if cfg.x0_scalars else None
        self.x0_lambda = nn.Parameter(torch.zeros(())) if cfg.x0_scalars else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None,
                layer: int = 0, mask: torch.Tensor | None = None, *, x0: torch.Tensor | None = None,
                ve: torch.Tensor | None = None) -> torch.Tensor:
        """x0: the token embeddings (x0_scalars); ve: the value embeddings (value_embeds)."""
        if self.resid_lambda is not None:
            x = self.resid_lambda * x + self.x0_lambda * x0
        value = {} if ve is None else {"ve": ve}  # only Attention takes it (ModelConfig refuses it with mla)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, mask, **value)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # one tensor: (vocab, dim) serves both ends
        self.value_embed: nn.Embedding | None = None  # value_embeds: made last, below
        # Non-persistent: derived from the config, so they stay out of the state dict and the checkpoint.
        cos, sin = rope_tables(cfg.rope_head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling, cfg.rope_factor)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # The MoE load-balancing loss of the last forward (0 without experts); the training loop adds it to the loss.
        self.aux_loss = torch.zeros(())

        self.apply(self._init_weights)
        # nanoGPT/GPT-2: each block adds two outputs to the residual stream, so scale the projections that write
        # into it by 1/sqrt(2 * n_layers) to keep the stream's variance independent of depth.
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                nn.init.normal_(p, mean=0.0, std=cfg.init_std / math.sqrt(2 * cfg.n_layers))
                if cfg.zero_init_out:  # after the draw above, so the other weights get today's random numbers
                    nn.init.zeros_(p)
        if cfg.value_embeds:  # drawn after every other weight, so those get the default model's random numbers
            self.value_embed = nn.Embedding(cfg.vocab_size, cfg.n_kv_heads * cfg.head_dim)
            nn.init.normal_(self.value_embed.weight, mean=0.0, std=cfg.init_std)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.cfg.init_std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, Experts):
            nn.init.normal_(module.gate_up_proj, mean=0.0, std=self.cfg.init_std)

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None, *, positions: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """idx: (B, T) token ids -> logits (B, T, vocab_size). Sets self.aux_loss. With a cache, idx continues
        the cached positions (and the cache grows by T); cached + new positions must fit in max_seq_len.

        Packed rows and the engine's batches pass `positions` (B, T), the RoPE position of each token (restarting
        per packed document, or each row's own position in its sequence), and `mask` (B, 1, T, S) of allowed
        (query, key) pairs (document_mask; the engine's runner). Without them: positions 0.. and the causal mask."""
        T = idx.shape[1]
        start = cache.length if cache is not None else 0
        assert start + T <= self.cfg.max_seq_len, f"sequence length {start + T} exceeds max_seq_len {self.cfg.max_seq_len}"
        if positions is None:
            cos, sin = self.rope_cos[start : start + T], self.rope_sin[start : start + T]
        else:  # one table row per token, broadcast over heads: (B, 1, T, rope dim)
            cos, sin = self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)
        x = self.embed_tokens(idx)  # (B, T, dim); the residual stream stays fp32 under autocast
        x0 = x if self.cfg.x0_scalars else None
        ve = self.value_embed(idx) if self.value_embed is not None else None
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i, mask, x0=x0, ve=ve)
        if cache is not None:
            cache.length += T
        moe = [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoE)]
        self.aux_loss = sum(m.aux_loss for m in moe) if moe else torch.zeros((), device=x.device)
        logits = self.lm_head(self.norm(x))
        if self.cfg.logit_softcap is not None:  # Gemma 2 / modded-nanogpt: bounds logits smoothly to (-cap, cap)
            logits = self.cfg.logit_softcap * torch.tanh(logits / self.cfg.logit_softcap)
        return logits

    def expert_token_counts(self) -> torch.Tensor | None:
        """(n_layers, n_experts) tokens routed to each expert in the last forward, or None without experts.
        Local to this rank: all-reduce it (SUM) before router_metrics to get the global picture."""
        if not self.cfg.n_experts:
            return None
        return torch.stack([layer.mlp.tokens_per_expert for layer in self.layers])

    def router_metrics(self, counts: torch.Tensor | None = None) -> dict[str, float]:
        """moe/load_imbalance: max over mean tokens per expert (1 = perfectly balanced), averaged over layers;
        moe/dead_expert_fraction: share of (layer, expert) pairs that got no token. {} without experts."""
        counts = self.expert_token_counts() if counts is None else counts
        if counts is None:
            return {}
        counts = counts.float()
        imbalance = counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-9)
        return {"moe/load_imbalance": imbalance.mean().item(), "moe/dead_expert_fraction": (counts == 0).float().mean().item()}

    def num_params(self) -> int:
        """Distinct parameters (a tied embedding counts once)."""
        return sum(p.numel() for p in self.parameters())


def estimated_params(cfg: ModelConfig) -> int:
    """Parameters of Transformer(cfg), from the config alone: its matrices and embeddings, exactly (norm gains,
    biases and scalars, a few per layer, are left out). What a loader checks against the machine's memory before
    it allocates anything (model_dir.check_fits_in_memory)."""
    D, H, hd = cfg.dim, cfg.n_heads, cfg.head_dim
    if cfg.attention == "mla":
        r, rank = cfg.mla_rope_dim, cfg.mla_kv_rank
        attn = D * H * (hd + r) + D * (rank + r) + rank * H * 2 * hd + H * hd * D
    else:
        attn = 2 * D * H * hd + 2 * D * cfg.n_kv_heads * hd
    attn += D * H * hd if cfg.attn_gate else 0
    if cfg.n_experts:
        mlp = D * cfg.n_experts + 3 * D * cfg.expert_hidden_dim * (cfg.n_experts + cfg.n_shared_experts)
    else:
        mlp = (2 if cfg.mlp == "relu2" else 3) * D * cfg.hidden_dim
    embed = cfg.vocab_size * D * (1 if cfg.tie_embeddings else 2)
    embed += cfg.vocab_size * cfg.n_kv_heads * hd if cfg.value_embeds else 0
    return embed + cfg.n_layers * (attn + mlp)
