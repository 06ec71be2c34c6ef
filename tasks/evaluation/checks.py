"""Did each stage do what it is for: each post-training model against its starting model (the model before it in the
chain) on the same held-out items, and the final model's forgetting and free text against the pretrained model. The evaluate stage
(tasks/stages/evaluate.py) logs them, writes checks.json and evaluation.md from them, and tags its MLflow run with the
failed ones (flag_tags)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from astrai_core.scoring.statistics import paired_difference
from tasks.evaluation.metrics import MAX_FORGETTING


@dataclass
class Check:
    """One model against its starting model on one metric. rule: "raise" (the paired 95% interval of the difference
    lies above 0), "keep" (it does not lie below 0), "forget" (difference: the relative change of test bits/char,
    at most MAX_FORGETTING) or "free" (the final model against the pretrained one: keep its share of free
    continuations without a loop, tasks/evaluation/free_text.py)."""

    stage: str
    start: str
    metric: str
    rule: str
    difference: float
    low: float | None
    high: float | None
    passed: bool
    why: str = ""  # for a failed check, what the stage had to learn from (grpo_why)

    def describe(self) -> str:
        return self._verdict() + (f". Why: {self.why}" if self.why else "")

    def _verdict(self) -> str:
        if self.rule == "forget":
            verdict = "within" if self.passed else "forgets: beyond"
            return (f"{self.stage} (final model) {verdict} {MAX_FORGETTING:.0%} of {self.start}'s test bits/char: "
                    f"{self.difference:+.1%}")
        interval = f"{self.difference:+.4f} (95% interval {self.low:+.4f} to {self.high:+.4f})"
        if self.rule == "free":
            verdict = "kept" if self.passed else "lost beyond the interval"
            return (f"{self.stage} (final model) {verdict} {self.start}'s share of free text without a loop "
                    f"(\"no no no no\"): {interval}")
        if self.rule == "raise":
            verdict = "beat" if self.passed else "did not beat"
            return f"{self.stage} {verdict} its starting model {self.start} on {self.metric}: {interval}"
        verdict = "kept" if self.passed else "lowered beyond the interval"
        return f"{self.stage} {verdict} {self.metric} against its starting model {self.start}: {interval}"


def stage_checks(models: list[str], items: dict[str, dict[str, list[int]]], metrics: dict,
                 training: Mapping[str, Any], curves: dict[str, list[dict]] | None = None,
                 kept: tuple[str, ...] = ()) -> list[Check]:
    """Each post-training model against the model before it in the chain (its entry in `training`, the stage table's
    TRAINING: its target, keep and strategy; every stage must also keep the metrics in `kept`: the lm-eval tasks'
    accuracies), and the final model's forgetting against the pretrained model. A failed GRPO check says why, from
    its training curve (grpo_why)."""
    checks = []
    for start, stage in zip(models, models[1:]):
        target, stage_kept = training[stage].target, training[stage].keep
        for metric in (target, *stage_kept, *kept):
            if stage not in items.get(metric, {}):
                continue
            difference, low, high = paired_difference(items[metric][start], items[metric][stage])
            raise_ = metric == target
            passed = low > 0 if raise_ else high >= 0
            why = grpo_why(metrics, start, (curves or {}).get(stage, [])) \
                if training[stage].strategy == "grpo" and raise_ and not passed else ""
            checks.append(Check(stage, start, metric, "raise" if raise_ else "keep", difference, low, high, passed,
                                why))
    final = metrics["final_model"]
    if final != "pretrain" and "pretrain" in models:
        change = metrics[f"{final}/test_bits_per_char"] / metrics["pretrain/test_bits_per_char"] - 1
        checks.append(Check(final, "pretrain", "test_bits_per_char", "forget", change, None, None,
                            passed=change <= MAX_FORGETTING))
        if final in items.get("loop_free_rate", {}):  # its free text reads like the pretrained model's
            difference, low, high = paired_difference(items["loop_free_rate"]["pretrain"],
                                                      items["loop_free_rate"][final])
            checks.append(Check(final, "pretrain", "loop_free_rate", "free", difference, low, high, high >= 0))
    return checks


def grpo_why(metrics: dict, start: str, curve: list[dict]) -> str:
    """Why GRPO may not beat its starting model, from what it had to learn from: it re-weights the answers the
    starting model samples (pass@k against its greedy accuracy), and a group of replies whose rewards are all equal
    gives no gradient (the rollouts' zero_spread_fraction)."""
    parts = []
    if f"{start}/pass_at_k" in metrics and f"{start}/task_accuracy" in metrics:
        parts.append(f"GRPO re-weights the answers its starting model samples, and {start} answered "
                     f"{metrics[f'{start}/pass_at_k']:.3f} of the held-out questions right in "
                     f"{metrics['pass_samples']} samples (pass@{metrics['pass_k']}) against "
                     f"{metrics[f'{start}/task_accuracy']:.3f} greedily")
    spread = [r["grpo/zero_spread_fraction"] for r in curve if "grpo/zero_spread_fraction" in r]
    if spread:
        parts.append(f"{np.mean(spread):.0%} of its rollout groups had equal rewards, which give no gradient")
    return "; ".join(parts)


def flag_tags(checks: list[Check]) -> dict[str, str]:
    """The evaluate run's MLflow tags for the failed checks: astrai.flag.<stage> = what failed (one line)."""
    tags: dict[str, str] = {}
    for c in checks:
        if not c.passed:
            key = f"astrai.flag.{c.stage}"
            tags[key] = f"{tags[key]}; {c.describe()}" if key in tags else c.describe()
    return tags
