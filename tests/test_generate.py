"""Incremental generation with the KV cache agrees with full forward passes without it, one prompt (generate) or
a batch (generate_batch, run by the serving engine); the sampling filters (top-k, top-p) keep what they should."""

from __future__ import annotations

import math

import pytest
import torch

from astrai_core.inference.generate import generate, generate_batch
from astrai_core.inference.sampling import sample_next, sample_rows
from astrai_core.model.transformer import Transformer
from conftest import sharp_random_model

VARIANTS = {
    "gqa": {},
    "mqa_qk_norm": {"n_kv_heads": 1, "qk_norm": True},
    "mla": {"attention": "mla", "mla_kv_rank": 16, "mla_rope_dim": 8},
}
SHAPE = {"vocab_size": 97, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 24}
PROMPTS = [[7], [5, 17, 3, 88, 41], [9, 2, 60, 33, 71, 14, 50, 8, 95]]  # lengths 1, 5, 9
N_NEW = 15  # 9 + 15 = max_seq_len: the longest row fills the context exactly


def model_for(name: str = "gqa") -> Transformer:
    return sharp_random_model(**{**SHAPE, **VARIANTS[name]})


def reference_greedy(model: Transformer, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by a full forward over the (cropped) context at every step: no cache at all."""
    ids = list(prompt)
    for _ in range(n):
        ctx = torch.tensor([ids[-model.cfg.max_seq_len:]])
        ids.append(int(model(ctx)[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("name", VARIANTS)
def test_cached_greedy_equals_full_forward_argmax(name):
    model = model_for(name)
    prompt = [5, 17, 3, 88, 41]
    # 30 new tokens from a 5-token prompt: the context passes max_seq_len (24), exercising the re-encode path.
    with torch.no_grad():
        expected = reference_greedy(model, prompt, 30)
    assert generate(model, prompt, 30) == expected


@pytest.mark.parametrize("name", VARIANTS)
def test_batched_greedy_equals_full_forward_argmax_per_row(name):
    model = model_for(name).train()
    with torch.no_grad():
        expected = [reference_greedy(model.eval(), p, N_NEW) for p in PROMPTS]
    model.train()
    assert generate_batch(model, PROMPTS, N_NEW) == expected
    assert model.training  # restored


def test_a_row_stops_at_its_stop_id_while_the_others_continue():
    model = model_for()
    full = generate_batch(model, PROMPTS, 10)
    stop = next(t for t in full[0][1:] if t not in full[0][:1] and t not in full[2])  # row 2 never emits it
    out = generate_batch(model, PROMPTS, 10, stop_ids=[stop])
    assert out == [row[: row.index(stop) + 1] if stop in row else row for row in full]
    assert len(out[0]) < 10 and out[0][-1] == stop and len(out[2]) == 10
    assert generate_batch(model, PROMPTS, 10, stop_ids=iter([stop])) == out  # any iterable, read once for all rows


def test_tiny_top_p_and_top_k_1_equal_greedy():
    model = model_for()
    greedy = generate_batch(model, PROMPTS, N_NEW)
    g = torch.Generator().manual_seed(0)
    assert generate_batch(model, PROMPTS, N_NEW, temperature=1.0, top_p=1e-6, generator=g) == greedy
    assert generate_batch(model, PROMPTS, N_NEW, temperature=1.0, top_k=1, generator=g) == greedy
    assert generate(model, PROMPTS[1], N_NEW, temperature=1.0, top_p=1e-6, generator=g) == greedy[1]
    # Without a filter, temperature 1 does sample: otherwise the lines above would prove nothing.
    assert generate_batch(model, PROMPTS, N_NEW, temperature=1.0, generator=g) != greedy


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    # Unsorted on purpose: by probability the tokens rank 1 (0.5), 3 (0.3), 0 (0.15), 2 (0.05).
    logits = torch.tensor([0.15, 0.5, 0.05, 0.3]).log().expand(4000, 4)  # one distribution, 4000 draws
    g = torch.Generator().manual_seed(0)
    for top_p, kept in [(0.0, [1]), (0.4, [1]), (0.75, [1, 3]), (0.9, [0, 1, 3]), (1.0, [0, 1, 2, 3])]:
        assert sorted(sample_next(logits, 1.0, None, top_p, g).unique().tolist()) == kept, top_p
    # Renormalized within the nucleus: 0.5 / 0.8 of the draws are token 1 at top_p 0.75.
    share = (sample_next(logits, 1.0, None, 0.75, g) == 1).float().mean().item()
    assert math.isclose(share, 0.625, abs_tol=0.03)
    # top-k first, then top-p over what is left: top_k=3 renormalizes to 0.526, 0.316, 0.158; top_p 0.8 keeps 2.
    assert sorted(sample_next(logits, 1.0, 3, 0.8, g).unique().tolist()) == [1, 3]


def test_each_row_samples_with_its_own_settings_in_one_call():
    """sample_rows: one call, each row its own temperature, top-k and top-p; every row's draws follow its own
    distribution (4000 draws per setting)."""
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    settings = [(0.0, None, None), (1.0, 1, None), (1.0, None, 0.75), (1.0, 3, 0.8), (1.0, None, None), (2.0, None, None)]
    n = 4000
    rows = [s for s in settings for _ in range(n)]
    out = sample_rows(probs.log().expand(len(rows), 4), [t for t, _, _ in rows], [k for _, k, _ in rows],
                      [p for _, _, p in rows], torch.Generator().manual_seed(0)).view(len(settings), n)
    share = [torch.bincount(o, minlength=4).float() / n for o in out]
    assert share[0].tolist() == [0, 1, 0, 0] and share[1].tolist() == [0, 1, 0, 0]  # greedy; top_k 1
    assert torch.allclose(share[2], torch.tensor([0, 0.625, 0, 0.375]), atol=0.03)  # the nucleus {1, 3}
    assert torch.allclose(share[3], torch.tensor([0, 0.625, 0, 0.375]), atol=0.03)  # top-3, then top-p keeps 2
    assert torch.allclose(share[4], probs, atol=0.03)  # no filter
    hot = probs.sqrt() / probs.sqrt().sum()  # temperature 2
    assert torch.allclose(share[5], hot, atol=0.03)


def test_top_k_and_top_p_decided_among_candidates_equal_a_full_sort(monkeypatch):
    """sample_rows finds what top-k / top-p keep among the CANDIDATES most likely tokens (a row whose nucleus
    reaches past them is sorted whole): the same tokens as with every token a candidate, flat rows and peaked."""
    import astrai_core.inference.sampling as gen

    logits = torch.randn(12, 5000, generator=torch.Generator().manual_seed(0))
    logits[::2] *= 8  # peaked rows: their nucleus is a few tokens; the others' reaches past 256
    top_k = [None, 5, None, 300, None, None, 1, None, 40, None, None, 2]
    top_p = [0.9, None, 0.5, 0.95, None, 0.99, None, 1.0, 0.8, 0.3, 0.999, 0.5]
    def draw():
        return sample_rows(logits, [1.0] * 12, top_k, top_p, [torch.Generator().manual_seed(i) for i in range(12)])
    assert gen.CANDIDATES < 5000
    fast = [draw() for _ in range(3)]
    monkeypatch.setattr(gen, "CANDIDATES", 5000)
    assert all(torch.equal(f, draw()) for f in fast)
    assert fast[0][6] == logits[6].argmax()  # top_k 1


def test_sampling_is_reproducible_with_a_seeded_generator():
    model = model_for()
    def run(seed):
        return generate_batch(model, PROMPTS, 10, temperature=1.0, top_k=20, top_p=0.9,
                              generator=torch.Generator().manual_seed(seed))
    assert run(1) == run(1)
    assert run(1) != run(2)


@pytest.mark.parametrize("name", VARIANTS)
def test_samples_sharing_a_prompt_prefill_equal_the_prompt_repeated(name):
    """samples_per_prompt computes each prompt's full KV blocks once (the engine's prefix cache): the same tokens,
    greedy or sampled with the same seed, as the prompts repeated row by row."""
    model = model_for(name)
    repeated = [p for p in PROMPTS for _ in range(3)]
    assert generate_batch(model, PROMPTS, N_NEW, samples_per_prompt=3) == generate_batch(model, repeated, N_NEW)
    def sampled(prompts, n):
        return generate_batch(model, prompts, N_NEW, temperature=1.0, samples_per_prompt=n,
                              generator=torch.Generator().manual_seed(3))
    shared = sampled(PROMPTS, 3)
    assert shared == sampled(repeated, 1)
    assert len({tuple(row) for row in shared}) > len(PROMPTS)  # the samples of a prompt differ


def test_samples_of_a_prompt_compute_its_full_blocks_once():
    """The samples of one prompt after the first find its full KV blocks in the engine's prefix cache: fewer
    positions go through the model than for the prompt repeated, with the same tokens."""
    model = model_for()
    prompt = list(range(3, 23))  # 20 tokens: one full block of 16, and 4 more
    embedded = []
    hook = model.embed_tokens.register_forward_hook(lambda m, args, out: embedded.append(args[0].numel()))
    shared = generate_batch(model, [prompt], 4, samples_per_prompt=4)
    shared_positions, embedded[:] = sum(embedded), []
    repeated = generate_batch(model, [prompt] * 4, 4)
    hook.remove()
    assert shared == repeated
    assert shared_positions < sum(embedded), (shared_positions, sum(embedded))


def test_batch_under_bf16_autocast_gives_generate_s_tokens():
    """GRPO samples under bf16 autocast: the engine's pool keeps the weights' dtype and takes the bf16 entries."""
    model = model_for()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = generate_batch(model, PROMPTS, 8)
        assert out == [generate(model, p, 8) for p in PROMPTS]


def test_bad_requests_raise():
    model = model_for()
    with pytest.raises(ValueError, match="max_seq_len"):
        generate_batch(model, PROMPTS, N_NEW + 1)
    with pytest.raises(ValueError, match="at least one token"):
        generate_batch(model, [[1, 2], []], 3)
