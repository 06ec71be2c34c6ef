"""The statistics of evaluation, free of torch: a unigram baseline, bits per character, and the 95% intervals
(Wilson's for an accuracy or a mean per-item score, Newcombe's paired interval for the difference of two models'
accuracies on the same items, pass@k), the one place they are computed."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


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


# ---- 95% intervals ----------------------------------------------------------------------------------------------

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile: two-sided 95% intervals


def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion successes / n (Wilson 1927). Unlike the Wald interval p +- z*se, it
    stays inside [0, 1] and keeps its coverage near 0 and 1: with 0 of n right it is [0, z^2 / (n + z^2)].

    `successes` may be a sum of per-item scores in [0, 1] (pass@k per question): the interval of their mean is
    then conservative, since a score in [0, 1] with mean p varies at most as much as a right/wrong answer, p(1-p);
    and unlike a normal interval it does not shrink to a point when every score is 0."""
    assert 0 <= successes <= n and n > 0, (successes, n)
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half))  # contains p despite rounding (k = n)


def paired_difference(before: Sequence[bool], after: Sequence[bool], z: float = Z95) -> tuple[float, float, float]:
    """(difference, lower, upper): the accuracy of `after` minus that of `before` on the same items (per-item
    correctness), with its 95% interval.

    The interval is Newcombe's square-and-add (hybrid score) interval for paired proportions (Newcombe 1998,
    Statistics in Medicine 17:2635, method 10), which Fagerland, Lydersen & Laake (2014, BMC Med Res Methodol
    14:30) recommend: each model's Wilson interval, combined with the correlation of the two models' per-item
    results. Pairing matters: two models that are right on mostly the same items differ by much less noise than
    two independent samples would; and unlike the paired Wald interval it keeps its coverage when few items
    change sides."""
    before, after = np.asarray(before, dtype=bool), np.asarray(after, dtype=bool)
    assert before.shape == after.shape and before.size > 0, (before.shape, after.shape)
    n = before.size
    both, neither = int((after & before).sum()), int((~after & ~before).sum())
    only_after, only_before = int((after & ~before).sum()), int((~after & before).sum())
    p_after, p_before = (both + only_after) / n, (both + only_before) / n
    lo_after, hi_after = wilson_interval(both + only_after, n, z)
    lo_before, hi_before = wilson_interval(both + only_before, n, z)
    # Correlation of the two results (phi of the 2x2 table), shrunk toward 0 by n/2 as Newcombe's method 10 does;
    # 0 when a margin is empty (a model right on every item or on none).
    margins = (both + only_after) * (only_before + neither) * (both + only_before) * (only_after + neither)
    cross = both * neither - only_after * only_before
    phi = 0.0
    if margins > 0:
        phi = (cross - n / 2 if cross > n / 2 else min(cross, 0)) / math.sqrt(margins)
    difference = p_after - p_before
    down_after, up_before = p_after - lo_after, hi_before - p_before
    up_after, down_before = hi_after - p_after, p_before - lo_before
    lower = difference - math.sqrt(max(0.0, down_after ** 2 + up_before ** 2 - 2 * phi * down_after * up_before))
    upper = difference + math.sqrt(max(0.0, up_after ** 2 + down_before ** 2 - 2 * phi * up_after * down_before))
    return difference, lower, upper


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Unbiased estimate of pass@k, the chance that at least one of k samples is right, from n >= k samples of
    which `correct` were right: 1 - C(n - correct, k) / C(n, k) (Chen et al. 2021, "Evaluating Large Language
    Models Trained on Code", eq. 1). Averaged over items it is the benchmark's pass@k; k = 1 gives correct / n."""
    assert 0 <= correct <= n and 1 <= k <= n, (n, correct, k)
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)
