"""Incremental generation with the KV cache agrees with full forward passes without it."""

from __future__ import annotations

import pytest
import torch

from astrai_core.config import ModelConfig
from astrai_core.generate import generate
from astrai_core.model import Transformer

VARIANTS = {
    "gqa": {},
    "mqa_qk_norm": {"n_kv_heads": 1, "qk_norm": True},
    "mla": {"attention": "mla", "mla_kv_rank": 16, "mla_rope_dim": 8},
}


def reference_greedy(model: Transformer, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by a full forward over the (cropped) context at every step: no cache at all."""
    ids = list(prompt)
    for _ in range(n):
        ctx = torch.tensor([ids[-model.cfg.max_seq_len:]])
        ids.append(int(model(ctx)[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("name", VARIANTS)
def test_cached_greedy_equals_full_forward_argmax(name):
    torch.manual_seed(0)
    shape = {"vocab_size": 97, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 24}
    cfg = ModelConfig(**{**shape, **VARIANTS[name]})
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # larger weights: sharper, less tie-prone distributions
            p.mul_(3.0)
    prompt = [5, 17, 3, 88, 41]
    # 30 new tokens from a 5-token prompt: the context passes max_seq_len (24), exercising the re-encode path.
    with torch.no_grad():
        expected = reference_greedy(model, prompt, 30)
    assert generate(model, prompt, 30) == expected
