"""Each held-out accuracy with its 95% interval, pass@1 and pass@k with theirs, and how many items each counts: what
the evaluate stage (tasks/stages/evaluate.py) writes to metrics.json per model (astrai_core/scoring/statistics.py: the
intervals)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from astrai_core.scoring.statistics import pass_at_k, wilson_interval


def accuracy(name: str, right: Sequence[bool]) -> dict[str, float]:
    """{name, name_low, name_high}: the share of items right and its 95% Wilson interval."""
    k, n = int(sum(bool(r) for r in right)), len(right)
    low, high = wilson_interval(k, n)
    return {name: k / n, f"{name}_low": low, f"{name}_high": high}


def pass_metrics(correct: Sequence[int], samples: int, k: int) -> dict[str, float]:
    """pass@1 and pass@k: the unbiased estimate per question from its `samples` replies of which `correct` were
    right, averaged over questions, each with the 95% Wilson interval of that mean (conservative, see
    wilson_interval)."""
    out = {}
    for name, kk in (("pass_at_1", 1), ("pass_at_k", k)):
        per_question = [pass_at_k(samples, c, kk) for c in correct]
        low, high = wilson_interval(sum(per_question), len(per_question))
        out |= {name: float(np.mean(per_question)), f"{name}_low": low, f"{name}_high": high}
    return out


def family_accuracies(right: Sequence[bool], families: Sequence[str | None]) -> dict[str, float]:
    """task_accuracy.<family> (with its interval) for each task family the records name ("task")."""
    out = {}
    for family in sorted({f for f in families if f}):
        out |= accuracy(f"task_accuracy.{family}", [r for r, f in zip(right, families) if f == family])
    return out


def item_counts(questions: list[dict], items: dict) -> dict[str, int]:
    """n/<metric>: how many items each accuracy counts (the same for every model)."""
    counts = {f"n/{name}": len(next(iter(per_model.values()))) for name, per_model in items.items()
              if name != "pass_correct"}
    families = [q.get("task") for q in questions]
    counts |= {f"n/task_accuracy.{f}": families.count(f) for f in sorted({f for f in families if f})}
    if "pass_correct" in items:
        counts |= {"n/pass_at_1": len(questions), "n/pass_at_k": len(questions)}
    return counts
