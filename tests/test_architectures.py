"""Architecture options of ModelConfig: each one runs forward and backward, stays causal, and learns; the MoE
router and its load-balancing loss against hand-computed values; MoE under 2-rank DDP with an idle expert."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from astrai_core.model.config import ModelConfig
from astrai_core.model.losses import cross_entropy_loss
from astrai_core.model.transformer import MLP, Transformer, rope_tables

TINY = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
MLA = dict(attention="mla", mla_kv_rank=16, mla_rope_dim=8)
OPTIONS = {
    "llama": {},
    "mqa": dict(n_kv_heads=1),
    "mha": dict(n_kv_heads=4),
    "untied": dict(tie_embeddings=False),
    "head_dim_16": dict(attn_head_dim=16),
    "qkv_bias": dict(qkv_bias=True),
    "qk_norm": dict(qk_norm=True),
    "attn_gate": dict(attn_gate=True),
    "rope_linear": dict(rope_scaling="linear", rope_factor=4.0),
    "rope_ntk": dict(rope_scaling="ntk", rope_factor=4.0),
    "mla": MLA,
    "moe": dict(n_experts=4, moe_top_k=2, moe_ffn_dim=32),
    "moe_shared": dict(n_experts=4, n_shared_experts=1, moe_top_k=2, moe_ffn_dim=32),
    "mla_moe_shared": dict(**MLA, n_experts=4, n_shared_experts=1, moe_top_k=2, moe_ffn_dim=32),
}


def tiny(**kw) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(**{**TINY, **kw}))


@pytest.mark.parametrize("name", OPTIONS)
def test_forward_backward(name):
    model = tiny(**OPTIONS[name])
    x = torch.randint(0, 64, (2, 32))
    logits = model(x)
    assert logits.shape == (2, 32, 64)
    (cross_entropy_loss(logits, x) + model.aux_loss).backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
        assert p.grad.abs().sum() > 0, n  # every parameter takes part (an idle expert only zeroes its slice)


@pytest.mark.parametrize("name", OPTIONS)
def test_causal_masking(name):
    model = tiny(**OPTIONS[name])
    x = torch.randint(0, 64, (2, 16))
    x2 = x.clone()
    x2[:, 8:] = torch.randint(0, 64, (2, 8))
    a, b = model(x), model(x2)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


@pytest.mark.parametrize("name", OPTIONS)
def test_loss_falls(name):
    # A repeating pattern with a random phase per row: learnable only by attending to earlier tokens.
    model = tiny(**OPTIONS[name])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    pattern = torch.randint(0, 64, (8,), generator=g)
    losses = []
    for _ in range(25):
        phase = torch.randint(0, 8, (8, 1), generator=g)
        seq = pattern[(torch.arange(25) + phase) % 8]
        loss = cross_entropy_loss(model(seq[:, :-1]), seq[:, 1:])
        (loss + model.aux_loss).backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[0] > math.log(64) - 0.5 and losses[-1] < 0.5 * losses[0], losses


def test_parameter_counts_by_hand():
    d, h, v, L = 32, 128, 64, 2  # hidden 128: the 8/3 * 32 rule rounded up to 64
    norms = 2 * d * L + d
    base = v * d + norms + L * (3 * d * h)
    attn = lambda q, kv: d * q * 8 + 2 * d * kv * 8 + q * 8 * d  # noqa: E731  q/k/v/o with head_dim 8
    assert tiny().num_params() == base + L * attn(4, 2)
    assert tiny(n_kv_heads=1).num_params() == base + L * attn(4, 1)
    assert tiny(qk_norm=True).num_params() == tiny().num_params() + L * 2 * 8
    assert tiny(qkv_bias=True).num_params() == tiny().num_params() + L * (32 + 2 * 16)
    assert tiny(attn_gate=True).num_params() == tiny().num_params() + L * d * d
    # MoE: router (E x d) + E experts of 3 * d * ffn + shared experts as one SwiGLU of n_shared * ffn
    moe = tiny(n_experts=4, n_shared_experts=2, moe_ffn_dim=16)
    assert moe.num_params() == tiny().num_params() + L * (4 * d + 4 * 3 * d * 16 + 3 * d * 32 - 3 * d * h)
    # MLA: q (d -> 4 * (8 + 8)), kv_a (d -> 16 + 8), its norm (16), kv_b (16 -> 4 * (8 + 8)), o (32 -> d)
    mla_attn = d * 64 + d * 24 + 16 + 16 * 64 + 32 * d
    assert tiny(**MLA).num_params() == base + L * mla_attn


def test_rope_scaling_tables():
    cos, sin = rope_tables(8, 16, 10000.0)
    lin_cos, _ = rope_tables(8, 16, 10000.0, "linear", 4.0)
    torch.testing.assert_close(lin_cos[4], cos[1])  # linear: position p looks like p / factor
    ntk_cos, _ = rope_tables(8, 16, 10000.0, "ntk", 4.0)
    # NTK-aware: the highest frequency (dim 0) is unchanged, the lowest (dim 3) is divided by the factor.
    torch.testing.assert_close(ntk_cos[:, 0], cos[:, 0])
    low = 10000.0 ** (-6 / 8) / 4.0
    torch.testing.assert_close(ntk_cos[5, 3], torch.tensor(math.cos(5 * low)), atol=1e-6, rtol=1e-6)


def test_attn_gate_scales_the_attention_output():
    attn = tiny(attn_gate=True).layers[0].self_attn
    x = torch.ones(1, 4, 32)  # a constant input, so the gate's pre-activation has one known sign
    cos, sin = rope_tables(8, 4, 10000.0)
    with torch.no_grad():
        attn.gate_proj.weight.zero_()
        half = attn(x, cos, sin)  # sigmoid(0) = 1/2
        attn.gate_proj.weight.fill_(-1.0)
        closed = attn(x, cos, sin)  # sigmoid(-32) ~ 1e-14: the head outputs nothing
        attn.gate_proj = None
        ungated = attn(x, cos, sin)
    torch.testing.assert_close(half, 0.5 * ungated)
    torch.testing.assert_close(closed, torch.zeros_like(closed), atol=1e-10, rtol=0)


def test_qk_norm_makes_queries_and_keys_unit_rms():
    model = tiny(qk_norm=True)
    attn = model.layers[0].self_attn
    q = attn.q_norm(attn.q_proj(torch.randn(2, 5, 32) * 7).view(2, 5, 4, 8))
    torch.testing.assert_close(q.pow(2).mean(-1), torch.ones(2, 5, 4), atol=1e-3, rtol=1e-3)


# ---- mixture of experts ----

def test_moe_output_by_hand():
    torch.manual_seed(0)
    moe = tiny(n_experts=4, n_shared_experts=1, moe_top_k=2, moe_ffn_dim=8).layers[0].mlp
    x = torch.randn(1, 3, 32)
    out = moe(x)
    gu, down = moe.experts.gate_up_proj, moe.experts.down_proj
    for t in range(3):
        scores = F.softmax(moe.gate.weight @ x[0, t], dim=-1)
        w, idx = scores.topk(2)
        expect = moe.shared_experts(x[0, t])
        for wk, e in zip(w, idx):  # the softmax score itself weighs the expert (DeepSeekMoE: no renormalizing)
            g, u = (gu[e] @ x[0, t]).chunk(2)
            expect = expect + wk * (down[e] @ (F.silu(g) * u))
        torch.testing.assert_close(out[0, t], expect, atol=1e-5, rtol=1e-5)


def test_moe_aux_loss_by_hand():
    model = tiny(n_experts=4, moe_top_k=2, moe_aux_loss_coef=0.1)
    dense = tiny()
    logits = dense(torch.zeros(1, 4, dtype=torch.long))
    assert logits.shape == (1, 4, dense.cfg.vocab_size) and dense.aux_loss.item() == 0.0  # no experts: no aux loss
    # A zero router scores every expert 1/E: sum_i f_i P_i = (1/E) * sum_i f_i = 1, whatever top-k picks.
    for layer in model.layers:
        layer.mlp.gate.weight.data.zero_()
    model(torch.randint(0, 64, (2, 16)))
    assert model.aux_loss.item() == pytest.approx(0.1 * 2, abs=1e-6)
    # General case, recomputed: coef * E / (k N) * sum_i count_i * mean score_i
    moe = tiny(n_experts=4, moe_top_k=2, moe_aux_loss_coef=0.1).layers[0].mlp
    x = torch.randn(1, 10, 32)
    moe(x)
    scores = F.softmax(x[0] @ moe.gate.weight.T, dim=-1)
    counts = torch.bincount(scores.topk(2).indices.flatten(), minlength=4).float()
    expect = 0.1 * 4 / (2 * 10) * (counts * scores.mean(0)).sum()
    torch.testing.assert_close(moe.aux_loss, expect)
    assert torch.equal(moe.tokens_per_expert, counts.long())
    # the loss reaches the router: it is what pushes the load towards balance
    moe.aux_loss.backward()
    assert moe.gate.weight.grad.abs().sum() > 0


def test_router_metrics():
    model = tiny(n_experts=4, moe_top_k=1)
    assert tiny().router_metrics() == {} and tiny().expert_token_counts() is None
    m = model.router_metrics(torch.tensor([[4, 4, 0, 0], [2, 2, 2, 2]]))
    assert m == {"moe/load_imbalance": pytest.approx((2.0 + 1.0) / 2), "moe/dead_expert_fraction": 0.25}
    model(torch.randint(0, 64, (2, 16)))
    counts = model.expert_token_counts()
    assert counts.shape == (2, 4) and counts.sum(1).tolist() == [32, 32]  # top-1: every token once per layer
    assert set(model.router_metrics()) == {"moe/load_imbalance", "moe/dead_expert_fraction"}


def _ddp_worker(rank: int, init_file: str, result: dict) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    model = tiny(n_experts=4, moe_top_k=1)
    with torch.no_grad():  # logits of expert 1 = -(expert 0), expert 3 = 0: top-1 never picks expert 3
        for layer in model.layers:
            w = layer.mlp.gate.weight
            w[1], w[3] = -w[0], 0.0
    ddp = DDP(model)  # find_unused_parameters=False: an idle expert must not break the gradient all-reduce
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    torch.manual_seed(rank)
    for _ in range(3):
        x = torch.randint(0, 64, (2, 16))
        loss = cross_entropy_loss(ddp(x), x) + model.aux_loss
        loss.backward()
        idle_grad = model.layers[0].mlp.experts.gate_up_proj.grad[3].abs().sum().item()
        opt.step()
        opt.zero_grad()
    gathered = [torch.zeros_like(model.embed_tokens.weight) for _ in range(2)]
    dist.all_gather(gathered, model.embed_tokens.weight.detach())
    result[rank] = {"idle_grad": idle_grad, "dead": model.router_metrics()["moe/dead_expert_fraction"],
                    "same": torch.equal(gathered[0], gathered[1])}
    dist.destroy_process_group()


def test_moe_under_ddp_with_an_expert_that_gets_no_tokens(tmp_path):
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        result = manager.dict()
        mp.spawn(_ddp_worker, args=(str(tmp_path / "init"), result), nprocs=2)
        result = dict(result)
    for rank in (0, 1):
        assert result[rank]["idle_grad"] == 0.0 and result[rank]["dead"] >= 0.25 and result[rank]["same"]


# ---- config validation ----

@pytest.mark.parametrize("kw, field", [
    (dict(n_kv_heads=3), "n_kv_heads"),
    (dict(dim=30), "n_heads"),
    (dict(attn_head_dim=7), "attn_head_dim"),
    (dict(rope_factor=2.0), "rope_scaling"),
    (dict(rope_scaling="linear"), "rope_factor"),
    (dict(**MLA, qk_norm=True), "qk_norm"),
    (dict(attention="mla", mla_rope_dim=5), "mla_rope_dim"),
    (dict(n_experts=2, moe_top_k=3), "moe_top_k"),
    (dict(n_shared_experts=1), "n_shared_experts"),
    (dict(n_experts=-1), "n_experts"),
    (dict(attention="sparse"), "attention"),
])
def test_bad_combinations_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig(**{**TINY, **kw})


def test_defaults_are_plain_llama():
    cfg = ModelConfig()
    assert (cfg.attention, cfg.qk_norm, cfg.qkv_bias, cfg.attn_gate, cfg.n_experts, cfg.rope_scaling) == (
        "gqa", False, False, False, 0, "none")
    assert all(type(layer.mlp) is MLP for layer in tiny().layers)  # the dense SwiGLU MLP, no experts


# ---- incremental decoding with a cache ----

@pytest.mark.parametrize("name", OPTIONS)
def test_cached_decoding_equals_full_forward(name):
    from astrai_core.model.transformer import KVCache

    model = tiny(**OPTIONS[name]).eval()
    x = torch.randint(0, 64, (2, 12))
    full = model(x)
    cache = KVCache()
    steps = [model(x[:, :5], cache), model(x[:, 5:8], cache)] + [model(x[:, t : t + 1], cache) for t in range(8, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert cache.length == 12


def test_mla_cache_holds_the_compressed_latent():
    from astrai_core.model.transformer import KVCache

    sizes = {}
    for name, kw in {"mha": dict(n_kv_heads=4), "gqa": {}, "mla": MLA}.items():
        cache = KVCache()
        tiny(**kw).eval()(torch.randint(0, 64, (1, 6)), cache)
        sizes[name] = cache.numbers_per_token()
    # per layer: MHA 2 * 4 heads * 8, GQA 2 * 2 * 8, MLA latent 16 + one shared RoPE key 8
    assert sizes == {"mha": 2 * 64, "gqa": 2 * 32, "mla": 2 * 24}


def test_moe_aux_loss_survives_activation_checkpointing():
    # The training loop may recompute each block in backward (non-reentrant checkpoint); the balance loss is a
    # side output of the block and must still give the router the same gradient.
    import functools

    from torch.utils.checkpoint import checkpoint

    x = torch.randint(0, 64, (2, 16))
    grads = []
    for recompute in (False, True):
        model = tiny(n_experts=4, n_shared_experts=1, moe_top_k=2, moe_ffn_dim=16)
        if recompute:
            for block in model.layers:
                block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
        (cross_entropy_loss(model(x), x) + 10 * model.aux_loss).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
