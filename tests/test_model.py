"""The model, its loss, checkpoints and generation: numbers checked against hand-computed values and invariants."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from astrai_core.checkpoint.model_dir import load_model, save_checkpoint
from astrai_core.inference.generate import generate, generate_text
from astrai_core.model.config import ModelConfig
from astrai_core.model.losses import cross_entropy_loss
from astrai_core.model.transformer import RMSNorm, Transformer, apply_rope, causal_attention, rope_tables
from astrai_core.runtime.errors import AstraiError

TINY = dict(vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)


def tiny(**kw) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(**{**TINY, **kw}))


def test_causal_masking():
    model = tiny()
    x = torch.randint(0, 300, (2, 16))
    t = 7
    x2 = x.clone()
    x2[:, t + 1 :] = torch.randint(0, 300, (2, 16 - t - 1))
    a, b = model(x), model(x2)
    assert a.shape == (2, 16, 300)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1])
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])


@pytest.mark.parametrize("tie", [True, False])
def test_initial_loss_is_uniform(tie):
    # Small init: every token about equally likely, so the loss on random targets is about ln(vocab).
    model = tiny(tie_embeddings=tie)
    torch.manual_seed(1)
    x, y = torch.randint(0, 300, (8, 32)), torch.randint(0, 300, (8, 32))
    loss = cross_entropy_loss(model(x), y).item()
    assert abs(loss - math.log(300)) < 0.15, loss


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_gqa_forward_backward(n_kv_heads):
    model = tiny(n_kv_heads=n_kv_heads)
    assert model.layers[0].self_attn.k_proj.weight.shape == (n_kv_heads * 8, 32)
    x = torch.randint(0, 300, (2, 32))
    cross_entropy_loss(model(x), x).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_gqa_equals_attention_with_repeated_kv_heads():
    # A 2-kv-head model equals a 4-head model whose kv heads are copies (HF repeat_kv: head h reads kv h // 2).
    gqa, mha = tiny(n_kv_heads=2), tiny(n_kv_heads=4)
    state = gqa.state_dict()
    for key, w in list(state.items()):
        if key.endswith(("k_proj.weight", "v_proj.weight")):
            state[key] = w.view(2, 8, 32).repeat_interleave(2, dim=0).reshape(32, 32)
    mha.load_state_dict(state)
    x = torch.randint(0, 300, (2, 20))
    torch.testing.assert_close(gqa(x), mha(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_attention_reads_each_query_heads_own_kv_head(dtype):
    # One new token per row (a decode step) over cached keys, 6 query heads on 2 KV heads (head h reads KV head
    # h // 3), rows of different lengths (padding keys masked out): causal_attention, which folds a KV head's query
    # heads into its queries in bf16, equals attention computed by hand in fp32 with repeated KV heads.
    torch.manual_seed(0)
    B, H, KV, S, D = 3, 6, 2, 40, 16
    q, k, v = torch.randn(B, H, 1, D), torch.randn(B, KV, S, D), torch.randn(B, KV, S, D)
    mask = (torch.arange(S)[None, :] < torch.tensor([40, 25, 7])[:, None]).view(B, 1, 1, S)
    kr, vr = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
    scores = (q @ kr.transpose(-1, -2) / math.sqrt(D)).masked_fill(~mask, float("-inf"))
    want = scores.softmax(-1) @ vr
    got = causal_attention(q.to(dtype), k.to(dtype), v.to(dtype), enable_gqa=True, mask=mask)
    assert got.shape == (B, H, 1, D) and got.dtype == dtype
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    # and the generate() form: no mask, a cache of S - 1 positions before the new token
    got = causal_attention(q.to(dtype), k.to(dtype), v.to(dtype), enable_gqa=True)
    want = (q @ kr.transpose(-1, -2) / math.sqrt(D)).softmax(-1) @ vr
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_tied_embeddings_share_storage():
    model = tiny(tie_embeddings=True)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    untied = tiny(tie_embeddings=False)
    assert model.num_params() == untied.num_params() - 300 * 32


def test_residual_projections_are_scaled():
    model = tiny(n_layers=8, dim=64, n_heads=4, n_kv_heads=4, init_std=0.02)
    std = lambda p: p.detach().std().item()  # noqa: E731
    assert std(model.layers[0].self_attn.q_proj.weight) == pytest.approx(0.02, rel=0.1)
    assert std(model.layers[0].self_attn.o_proj.weight) == pytest.approx(0.02 / 4, rel=0.1)
    assert std(model.layers[0].mlp.down_proj.weight) == pytest.approx(0.02 / 4, rel=0.1)
    assert all(not n.endswith("bias") for n, _ in model.named_parameters())


def test_rope_matches_hf_convention_and_is_relative():
    cos, sin = rope_tables(head_dim=8, max_seq_len=16, theta=10000.0)
    # HF: inv_freq_i = theta^(-2i/d), and dimension i is paired with i + d/2 (rotate-half).
    assert cos[3, 1].item() == pytest.approx(math.cos(3 * 10000 ** (-2 / 8)), abs=1e-6)
    assert cos[3, 5].item() == pytest.approx(math.cos(3 * 10000 ** (-2 / 8)), abs=1e-6)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    rot = lambda v, pos: apply_rope(v, cos[pos : pos + 1], sin[pos : pos + 1])  # noqa: E731
    # A rotation: the norm is kept, and q.k depends only on the distance between positions.
    torch.testing.assert_close(rot(q, 5).norm(), q.norm())
    torch.testing.assert_close((rot(q, 7) * rot(k, 4)).sum(), (rot(q, 10) * rot(k, 7)).sum(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rot(q, 0), q)


def test_rmsnorm_inference_path_equals_training_path():
    """Without grad RMSNorm skips its autograd.Function: the same bits, and rms_norm's values."""
    torch.manual_seed(0)
    norm = RMSNorm(16, eps=1e-6)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 16, requires_grad=True)
    trained = norm(x)
    assert trained.grad_fn is not None
    with torch.no_grad():
        inferred = norm(x)
    assert torch.equal(trained.detach(), inferred)
    torch.testing.assert_close(inferred, F.rms_norm(x.detach(), (16,), norm.weight.detach(), eps=1e-6))


def test_cross_entropy_loss_hand_computed():
    logits = torch.tensor([[[0.0, math.log(3.0)], [2.0, 2.0]]])  # p = (1/4, 3/4), (1/2, 1/2)
    targets = torch.tensor([[1, 0]])
    expected = (-math.log(0.75) - math.log(0.5)) / 2
    assert cross_entropy_loss(logits, targets).item() == pytest.approx(expected, abs=1e-6)
    # ignored targets are left out of the mean
    assert cross_entropy_loss(logits, torch.tensor([[1, -100]])).item() == pytest.approx(-math.log(0.75), abs=1e-6)
    assert cross_entropy_loss(logits.bfloat16(), targets).dtype == torch.float32


def test_bf16_autocast_forward():
    model = tiny()
    x = torch.randint(0, 300, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), model(x), atol=0.05, rtol=0.05)


# ---- checkpoints ----

def _save(tmp_path, core_tiny_data, model, **kw):
    return save_checkpoint(tmp_path / "ckpt", model, model.cfg, core_tiny_data["tokenizer"], **kw)


@pytest.mark.parametrize("tie", [True, False])
def test_checkpoint_round_trip(tmp_path, core_tiny_data, tie):
    model = tiny(tie_embeddings=tie)
    ckpt = _save(tmp_path, core_tiny_data, model, extra={"final_train_loss": 1.5})
    names = {p.name for p in ckpt.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "manifest.json", "summary.json"} <= names
    assert not any(n.startswith(".") for n in (p.name for p in tmp_path.iterdir()))  # no staging leftovers
    loaded, tok, cfg = load_model(ckpt)
    assert cfg == model.cfg and tok.get_vocab_size() == core_tiny_data["tokenizer_obj"].get_vocab_size()
    assert (loaded.lm_head.weight is loaded.embed_tokens.weight) == tie
    x = torch.randint(0, 300, (2, 32))
    torch.testing.assert_close(loaded(x), model(x), atol=0, rtol=0)
    assert json.loads((ckpt / "summary.json").read_text())["final_train_loss"] == 1.5


def test_checkpoint_tampered_or_missing_file_is_refused(tmp_path, core_tiny_data):
    ckpt = _save(tmp_path, core_tiny_data, tiny())
    weights = ckpt / "model.safetensors"
    original = weights.read_bytes()
    data = bytearray(original)
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(AstraiError, match="model.safetensors"):
        load_model(ckpt)
    weights.write_bytes(original)
    load_model(ckpt)
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(AstraiError, match="tokenizer.json"):
        load_model(ckpt)
    with pytest.raises(AstraiError, match="manifest.json"):
        load_model(tmp_path)


def test_checkpoint_replaces_previous(tmp_path, core_tiny_data):
    _save(tmp_path, core_tiny_data, tiny(), extra={"run": 1})
    ckpt = _save(tmp_path, core_tiny_data, tiny(), train_state={"step": 3, "optimizer": {"lr": torch.ones(2)}})
    assert not (ckpt / "summary.json").exists()
    state = torch.load(ckpt / "train_state.pt", weights_only=True)
    assert state["step"] == 3
    load_model(ckpt)


# ---- generation ----

def test_generate_greedy_and_sampling():
    model = tiny()
    out = generate(model, [1, 2, 3], 10)
    assert len(out) == 10 and out == generate(model, [1, 2, 3], 10)  # greedy is deterministic
    # greedy = argmax of the full forward pass at each step
    logits = model(torch.tensor([[1, 2, 3] + out[:4]]))[0, -1]
    assert out[4] == int(logits.argmax())
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    a = generate(model, [1, 2, 3], 10, temperature=1.0, top_k=5, generator=g())
    assert a == generate(model, [1, 2, 3], 10, temperature=1.0, top_k=5, generator=g())
    # top_k=1 sampling is greedy
    assert generate(model, [1, 2, 3], 10, temperature=1.0, top_k=1, generator=g()) == out
    # stop ids end generation and are included
    assert generate(model, [1, 2, 3], 10, stop_ids=[out[2]]) == out[: out.index(out[2]) + 1]
    # contexts longer than max_seq_len are cropped, not refused
    assert len(generate(model, list(range(40)), 3)) == 3


def test_generate_text(core_tiny_data):
    """The continuation alone (never the prompt), decoded from exactly the greedy ids; a final stop token is not
    part of the text."""
    tok = core_tiny_data["tokenizer_obj"]
    model = tiny()
    prompt = tok.encode("the king", add_special_tokens=False).ids
    ids = generate(model, prompt, 5)
    assert len(ids) == 5 and generate_text(model, tok, "the king", max_new_tokens=5) == tok.decode(ids)
    stop = ids[2]
    first = ids.index(stop)  # generation ends at the first stop token, which the text then drops
    assert generate_text(model, tok, "the king", max_new_tokens=5, stop_ids=[stop]) == tok.decode(ids[:first])
    assert tok.decode(ids[:first]) != tok.decode(ids[:first + 1])  # (the stop token would show if it were kept)
