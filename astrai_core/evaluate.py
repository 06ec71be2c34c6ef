"""Held-out language-modeling metrics: loss, perplexity and bits per character, with a unigram baseline.

Bits per character (total negative log-likelihood in bits / number of characters) compares models with
different tokenizers; per-token loss does not.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F


@torch.no_grad()
def sequence_nll(model: torch.nn.Module, tokens: np.ndarray, seq_len: int, batch_size: int,
                 device: str | torch.device = "cpu") -> tuple[float, int]:
    """Sum of next-token NLL (nats) over `tokens`, scored in non-overlapping windows of `seq_len` targets.

    Every token but the first is predicted exactly once. Returns (nll_sum, n_predicted).
    """
    model.eval()
    n = len(tokens) - 1
    starts = list(range(0, n, seq_len))
    total, count = 0.0, 0
    for i in range(0, len(starts), batch_size):
        chunk = starts[i:i + batch_size]
        length = min(seq_len, n - chunk[0])  # windows in a batch share a length; the last one may be short
        rows = [s for s in chunk if s + length <= n]
        x = torch.stack([torch.from_numpy(tokens[s:s + length].astype(np.int64)) for s in rows]).to(device)
        y = torch.stack([torch.from_numpy(tokens[s + 1:s + 1 + length].astype(np.int64)) for s in rows]).to(device)
        logits = model(x).float()
        total += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        count += y.numel()
        for s in chunk[len(rows):]:  # the final short window, scored alone
            x = torch.from_numpy(tokens[s:n].astype(np.int64))[None].to(device)
            y = torch.from_numpy(tokens[s + 1:n + 1].astype(np.int64))[None].to(device)
            total += F.cross_entropy(model(x).float()[0], y[0], reduction="sum").item()
            count += y.numel()
    assert count == n, (count, n)
    return total, count


def unigram_nll(tokens: np.ndarray, vocab_size: int) -> tuple[float, int]:
    """NLL (nats) of tokens[1:] under their own unigram distribution: the best any unigram model can do."""
    targets = tokens[1:]
    counts = np.bincount(targets, minlength=vocab_size).astype(np.float64)
    probs = counts / counts.sum()
    nz = counts > 0
    return float(-(counts[nz] * np.log(probs[nz])).sum()), int(len(targets))


def summarize(nll: float, n_tokens: int, n_chars: int) -> dict[str, float]:
    loss = nll / n_tokens
    return {"loss": loss, "perplexity": math.exp(loss), "bits_per_char": nll / math.log(2) / n_chars}
