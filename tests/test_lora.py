"""LoRA adapters: a fresh adapter is a no-op, only adapters train, merging and save/load keep the numbers."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from astrai_core.model.config import ModelConfig
from astrai_core.runtime.errors import AstraiError
from astrai_core.runtime.io import OUTPUT_MARK
from astrai_core.model.lora import (LoRALinear, apply_lora, count_trainable, load_adapters, lora_state_dict,
                                    merge_lora, save_adapters)
from astrai_core.model.losses import cross_entropy_loss
from astrai_core.model.transformer import Transformer

TINY = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)
DENSE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MLA = dict(attention="mla", mla_kv_rank=16, mla_rope_dim=8)
MLA_TARGETS = ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "down_proj"]
# (model options, targets): tied and untied embeddings, qkv biases with the attention gate, latent attention
SPEEDRUN = dict(mlp="relu2", logit_softcap=5.0, value_embeds=True, x0_scalars=True)  # relu2: no gate_proj
VARIANTS = [({}, DENSE), (dict(tie_embeddings=False, qkv_bias=True, attn_gate=True), DENSE), (MLA, MLA_TARGETS),
            (SPEEDRUN, [t for t in DENSE if t != "gate_proj"])]
LORA = dict(rank=4, alpha=8.0, dropout=0.0)


def tiny(**kw) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(**{**TINY, **kw}))


def batch(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(seed))


def randomize_adapters(model: nn.Module, seed: int = 2) -> None:
    """B = 0 makes every adapter a no-op; random B (and A) make the tests below see the adapters at all."""
    torch.manual_seed(seed)
    for m in model.modules():
        if isinstance(m, LoRALinear):
            nn.init.normal_(m.lora_A, std=0.2)
            nn.init.normal_(m.lora_B, std=0.2)


@pytest.mark.parametrize("kw,targets", VARIANTS)
def test_fresh_adapter_changes_nothing_and_keeps_keys(kw, targets):
    base, model = tiny(**kw), tiny(**kw)
    wrapped = apply_lora(model, targets, **LORA)
    n_linear_per_layer = len(targets) + ("gate_proj" in targets and kw.get("attn_gate", False))
    assert len(wrapped) == TINY["n_layers"] * n_linear_per_layer
    assert not isinstance(model.lm_head, LoRALinear)
    x = batch()
    assert torch.equal(model(x), base(x))
    # A plain checkpoint loads into the wrapped model: the same keys, plus only the adapters.
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and missing and all(k.endswith(("lora_A", "lora_B")) for k in missing)
    assert sorted(missing) == sorted(lora_state_dict(model))


def test_only_adapters_require_and_get_gradients():
    model = tiny(qkv_bias=True)
    apply_lora(model, ["q_proj", "v_proj"], **LORA)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_state_dict(model)) and len(trainable) == 2 * 2 * 2  # layers x targets x (A, B)
    n_lora = 2 * (4 * 32 + 32 * 4) + 2 * (4 * 32 + 16 * 4)  # layers x (A + B): q_proj 32 -> 32, v_proj 32 -> 16
    assert count_trainable(model) == (n_lora, tiny(qkv_bias=True).num_params() + n_lora)
    cross_entropy_loss(model(batch()), batch(3)).backward()
    for name, p in model.named_parameters():
        if name.endswith("lora_B"):  # A's gradient is B^T (...), exactly 0 while B = 0
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert (p.grad is not None) == name.endswith("lora_A"), name


def test_training_lowers_loss_and_leaves_base_weights_bitwise_equal():
    model = tiny(qkv_bias=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    apply_lora(model, DENSE, **LORA)
    # Every parameter handed to AdamW with weight decay, as train.py does: frozen ones must still not move.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x, y = batch(), batch(3)
    losses = []
    for _ in range(8):
        loss = cross_entropy_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.parametrize("kw,targets", [*VARIANTS[:2], (MLA, [*MLA_TARGETS, "gate_proj", "up_proj"]), VARIANTS[3]])
def test_no_targets_wraps_every_projection_the_architecture_has(kw, targets, tmp_path):
    """lora.targets: null (the default) adapts whatever projections the blocks have: relu2's MLP has no gate_proj,
    and the same params must work with either MLP (the demo's DPO stage uses the default)."""
    named, default = tiny(**kw), tiny(**kw)
    assert apply_lora(default, None, **LORA) == apply_lora(named, targets, **LORA)
    config = json.loads((save_adapters(default, tmp_path / "a", targets=None, **LORA) / "adapter_config.json").read_text())
    assert config["targets"] == sorted(targets)


@pytest.mark.parametrize("kw,targets", VARIANTS)
def test_merge_equals_wrapped_model_and_gives_plain_keys(kw, targets):
    model = tiny(**kw)
    apply_lora(model, targets, **LORA)
    randomize_adapters(model)
    model.eval()
    x = batch()
    with torch.no_grad():
        wrapped_logits = model(x)
        assert not torch.allclose(wrapped_logits, tiny(**kw)(x), atol=1e-3)  # the adapters do something
        merged = merge_lora(model)
        torch.testing.assert_close(merged(x), wrapped_logits, atol=1e-5, rtol=0)
    assert merged is model and not any(isinstance(m, LoRALinear) for m in model.modules())
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    assert list(model.state_dict()) == list(tiny(**kw).state_dict())
    assert all(p.requires_grad for p in model.parameters())
    assert not kw.get("tie_embeddings", True) or model.lm_head.weight is model.embed_tokens.weight


@pytest.mark.parametrize("kw,targets", VARIANTS[::2])
def test_save_load_roundtrip(tmp_path, kw, targets):
    model = tiny(**kw)
    apply_lora(model, targets, **LORA)
    randomize_adapters(model)
    out = save_adapters(model, tmp_path / "adapter", targets=targets, **LORA)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # no staging directory left behind
    assert sorted(p.name for p in out.iterdir()) == [OUTPUT_MARK, "adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["targets"] == targets and config["rank"] == 4 and len(config["modules"]) == 2 * len(targets)

    fresh = tiny(**kw)  # the same base weights (same seed), no LoRA yet: load_adapters applies it
    assert load_adapters(fresh, out) == config["modules"]
    model.eval(), fresh.eval()
    assert torch.equal(fresh(batch()), model(batch()))
    assert count_trainable(fresh) == count_trainable(model)


def test_load_rejects_mismatched_adapter(tmp_path):
    from safetensors.torch import load_file, save_file

    model = tiny()
    apply_lora(model, ["q_proj"], **LORA)
    out = save_adapters(model, tmp_path / "adapter", targets=["q_proj"], **LORA)
    other = tiny()
    apply_lora(other, ["v_proj"], **LORA)
    with pytest.raises(AstraiError, match="adapter_config.json"):
        load_adapters(other, out)
    state = load_file(out / "adapter_model.safetensors")
    key = next(iter(state))
    state[key] = torch.zeros(8, 32)  # rank 8 instead of 4
    save_file(state, out / "adapter_model.safetensors")
    with pytest.raises(AstraiError, match=r"adapter_model\.safetensors.*wrong shape"):
        load_adapters(tiny(), out)


def test_dropout_only_in_train_mode_and_only_on_the_adapter_path():
    base, model = tiny(), tiny()
    apply_lora(model, DENSE, rank=4, alpha=8.0, dropout=0.5)
    x = batch()
    model.train()
    assert torch.equal(model(x), base(x))  # B = 0: dropout must not touch the frozen path
    randomize_adapters(model)
    assert not torch.equal(model(x), model(x))
    model.eval()
    assert torch.equal(model(x), model(x))


def test_unknown_target_is_a_clear_error():
    with pytest.raises(AstraiError, match=r"'qproj'.*available: down_proj, gate_proj, k_proj, o_proj, q_proj"):
        apply_lora(tiny(), ["q_proj", "qproj"], **LORA)
    with pytest.raises(AstraiError, match="'lm_head'.*never wrapped"):
        apply_lora(tiny(), ["lm_head"], **LORA)
    with pytest.raises(AstraiError, match="'gate_up_proj'.*stacked parameter"):
        apply_lora(tiny(n_experts=4), ["gate_up_proj"], **LORA)
    model = tiny()
    with pytest.raises(AstraiError):
        apply_lora(model, ["embed_tokens"], **LORA)
    assert all(p.requires_grad for p in model.parameters())  # a rejected call changes nothing


def test_bf16_autocast_forward_backward():
    base, model = tiny(), tiny()
    apply_lora(model, DENSE, **LORA)
    x = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(model(x), base(x))
        randomize_adapters(model)
        logits = model(x)
    assert logits.dtype == torch.bfloat16
    cross_entropy_loss(logits, batch(3)).backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
