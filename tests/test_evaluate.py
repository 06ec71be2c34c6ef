"""Held-out metrics against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import torch

from astrai_core.evaluate import sequence_nll, summarize, unigram_nll


class Uniform(torch.nn.Module):
    """Assigns equal probability to every token: NLL is exactly ln(V) per prediction."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, idx):
        return torch.zeros(*idx.shape, self.vocab)


class Oracle(torch.nn.Module):
    """Predicts token (x + 1) % V with near-certainty: NLL ~0 on the sequence 0, 1, 2, ..."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, idx):
        return torch.nn.functional.one_hot((idx + 1) % self.vocab, self.vocab).float() * 50.0


def test_sequence_nll_scores_every_token_but_the_first_once():
    tokens = np.arange(103) % 7
    for seq_len, batch in ((10, 3), (7, 1), (200, 4), (1, 5)):
        nll, n = sequence_nll(Uniform(7), tokens, seq_len, batch)
        assert n == 102
        assert math.isclose(nll, 102 * math.log(7), rel_tol=1e-6)
    nll, _ = sequence_nll(Oracle(7), tokens, 16, 2)
    assert nll < 1e-6 * 102


def test_unigram_baseline_is_the_split_entropy():
    tokens = np.array([5, 0, 0, 1, 1, 1, 1])  # targets: 0,0,1,1,1,1 -> p(0)=1/3, p(1)=2/3
    nll, n = unigram_nll(tokens, vocab_size=8)
    assert n == 6
    assert math.isclose(nll, -(2 * math.log(1 / 3) + 4 * math.log(2 / 3)))


def test_bits_per_char_and_perplexity():
    m = summarize(nll=100 * math.log(2), n_tokens=50, n_chars=200)
    assert math.isclose(m["bits_per_char"], 0.5)
    assert math.isclose(m["perplexity"], 4.0)
    assert math.isclose(m["loss"], 2 * math.log(2))
