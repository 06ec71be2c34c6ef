"""The speedrun architecture options of ModelConfig (astrai_core/model/transformer.py): mlp relu2, logit_softcap,
zero_init_out, value_embeds, x0_scalars. Each is off by default, trains, and the options that only add learnt
scalars start as the default model. Export, the engine, LoRA and tensor parallelism with each option are tested
with the other variants in test_hf.py, test_engine.py, test_lora.py and test_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch

from astrai_core.model.config import ModelConfig
from astrai_core.model.losses import cross_entropy_loss
from astrai_core.model.transformer import Transformer

TINY = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
OPTIONS = {
    "relu2": dict(mlp="relu2"),
    "logit_softcap": dict(logit_softcap=5.0),
    "zero_init_out": dict(zero_init_out=True),
    "value_embeds": dict(value_embeds=True),
    "x0_scalars": dict(x0_scalars=True),
    "all": dict(mlp="relu2", logit_softcap=5.0, zero_init_out=True, value_embeds=True, x0_scalars=True),
}


def tiny(**kw) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(**{**TINY, **kw}))


def ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (4, 24), generator=torch.Generator().manual_seed(seed))


def test_defaults_are_off():
    cfg = ModelConfig()
    assert (cfg.mlp, cfg.logit_softcap, cfg.zero_init_out, cfg.value_embeds, cfg.x0_scalars) == (
        "swiglu", None, False, False, False)


@pytest.mark.parametrize("name", ["value_embeds", "x0_scalars"])
def test_options_that_add_scalars_start_as_the_default_model(name):
    """The default model's parameters are drawn first and identically; the option adds parameters only, and its
    gates start where the block computes what the default one does."""
    default, model = tiny(), tiny(**OPTIONS[name])
    extra = set(model.state_dict()) - set(default.state_dict())
    assert extra and all(("value_" in k) or ("lambda" in k) for k in extra), extra
    assert all(torch.equal(model.state_dict()[k], v) for k, v in default.state_dict().items())
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(model(x), default(x), rtol=0, atol=1e-6)
        for p in model.parameters():  # moved off their start, the option changes the output
            if p.dim() == 0:
                p.add_(0.5)
        assert not torch.allclose(model(x), default(x), atol=1e-3)


def test_zero_init_out_zeroes_only_the_output_projections():
    default, model = tiny(), tiny(zero_init_out=True)
    for k, v in model.state_dict().items():
        zeroed = k.endswith(("o_proj.weight", "down_proj.weight"))
        assert torch.equal(v, torch.zeros_like(v) if zeroed else default.state_dict()[k]), k


def test_relu2_mlp_and_softcap_compute_their_formulas():
    model = tiny(mlp="relu2", logit_softcap=0.3).eval()  # below the initial logits' largest (about 0.75)
    mlp = model.layers[0].mlp
    assert mlp.gate_proj is None and "layers.0.mlp.gate_proj.weight" not in model.state_dict()
    h = torch.randn(3, TINY["dim"])
    torch.testing.assert_close(mlp(h), mlp.down_proj(torch.relu(mlp.up_proj(h)) ** 2))
    x = ids()
    with torch.no_grad():
        logits = model(x)
        model.cfg.logit_softcap = None
        raw = model(x)
    assert raw.abs().max() > 0.3 and logits.abs().max() < 0.3
    torch.testing.assert_close(logits, 0.3 * torch.tanh(raw / 0.3))


@pytest.mark.parametrize("name", OPTIONS)
def test_each_option_trains(name):
    """AdamW on a fixed batch with a repeated pattern: the loss falls by half, and every parameter the option adds
    (and the zero-initialized projections) moves off its start."""
    model = tiny(**OPTIONS[name])
    start = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = ids().repeat(1, 2)[:, :32]
    losses = []
    for _ in range(30):
        loss = cross_entropy_loss(model(x[:, :-1]), x[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    default_keys = set(tiny().state_dict())
    for k, v in model.state_dict().items():
        if k not in default_keys or k.endswith(("o_proj.weight", "down_proj.weight")):
            assert not torch.equal(v, start[k]), k


@pytest.mark.parametrize("options, message", [
    (dict(mlp="relu2", n_experts=4), "mlp 'relu2' is not supported with experts"),
    (dict(value_embeds=True, attention="mla"), "value_embeds needs attention 'gqa'"),
    (dict(logit_softcap=0.0), "logit_softcap"),
])
def test_bad_combinations_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**TINY, **options})


BEFORE_OPTIONS = "87907c8"  # the last commit whose model.py had none of these options
# Where the model file stood then (issue 52 moved it to model/transformer.py); not a path of today's tree.
MODEL_BEFORE_MOVE = "/".join(("astrai_core", "model.py"))


def test_default_model_is_bit_for_bit_the_one_before_the_options(tmp_path):
    """model.py as of BEFORE_OPTIONS (read from git; today's model/transformer.py) and today's, same seed: the same
    keys, weights and logits."""
    import importlib.util
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    shown = subprocess.run(["git", "-C", str(root), "show", f"{BEFORE_OPTIONS}:{MODEL_BEFORE_MOVE}"],
                           capture_output=True, text=True)
    if shown.returncode:
        pytest.skip(f"git history without {BEFORE_OPTIONS} (a shallow clone): {shown.stderr.strip()}")
    # its ModelConfig import as the core is laid out now (the config it reads is today's, as before the move)
    (tmp_path / "model_before.py").write_text(shown.stdout.replace("from astrai_core.config import ModelConfig",
                                                                   "from astrai_core.model.config import ModelConfig"))
    spec = importlib.util.spec_from_file_location("model_before", tmp_path / "model_before.py")
    before = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(before)
    for kw in ({}, dict(qk_norm=True, tie_embeddings=False), dict(attention="mla", mla_kv_rank=16, mla_rope_dim=8)):
        cfg = ModelConfig(**{**TINY, **kw})
        torch.manual_seed(0)
        old = before.Transformer(cfg)
        new = tiny(**kw)
        assert list(old.state_dict()) == list(new.state_dict())
        assert all(torch.equal(v, new.state_dict()[k]) for k, v in old.state_dict().items())
        x = ids()
        assert torch.equal(old(x), new(x)), kw


def test_training_loop_with_every_option_and_muon_learns_and_its_checkpoint_loads(core_tiny_data, tmp_path,
                                                                                     monkeypatch):
    """The real training core (train(), as the pretrain stage runs it) with every option on and Muon: it learns,
    the final checkpoint loads (strictly: every tensor the options add is in it) and its learnt scalars moved."""
    from astrai_core.checkpoint.model_dir import load_model
    from astrai_core.training.train import train
    from test_resume import MODEL, make_cfg

    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    options = OPTIONS["all"]
    cfg = make_cfg(core_tiny_data, tmp_path / "out", model={**MODEL, **options}, checkpoint_every=0,
                   optim=dict(name="muon", lr=3e-3, min_lr=3e-4, warmup_steps=3))
    summary = train(cfg)
    assert summary["final_val_loss"] < torch.log(torch.tensor(300.0)).item() - 0.8, summary
    model, _, model_cfg = load_model(cfg.out_dir)
    assert {k: getattr(model_cfg, k) for k in options} == options
    assert model.layers[0].x0_lambda.item() != 0.0 and model.layers[0].self_attn.value_gate.item() != 0.0
