"""The evaluate stage's two pictures (matplotlib, PNG): each held-out metric across the chain with its 95% interval,
and each stage's training curves. The evaluate stage writes them beside evaluation.md, logs them to its MLflow run,
and the flow shows them in its Prefect artifact."""

from __future__ import annotations

import math
from pathlib import Path

from tasks.metrics import METRICS

# Training-log keys drawn per stage: its losses, and what it was optimizing or how it did on held-out prompts.
LOSS_CURVES = {"train/loss": "train loss", "val/loss": "validation loss"}
SCORE_CURVES = {"grpo/reward_mean": "GRPO train reward", "val/reward": "held-out reward",
                "val/task_accuracy": "held-out task accuracy", "dpo/reward_accuracy": "DPO reward accuracy"}
DPI = 80  # small files: both are embedded in the Prefect artifact as data URIs


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    return plt


def plot_chain(models: list[str], metrics: dict, path: Path) -> None:
    """One panel per metric: its value for each model in chain order, error bars from `<stage>/<metric>_low/_high`."""
    plt = _pyplot()
    shown = [k for k in METRICS if any(f"{s}/{k}" in metrics for s in models)]
    cols = min(4, len(shown))
    rows = math.ceil(len(shown) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.9 * rows), squeeze=False)
    for ax, metric in zip(axes.flat, shown):
        have = [s for s in models if f"{s}/{metric}" in metrics]
        values = [metrics[f"{s}/{metric}"] for s in have]
        if all(f"{s}/{metric}_low" in metrics for s in have):
            errors = [[v - metrics[f"{s}/{metric}_low"] for s, v in zip(have, values)],
                      [metrics[f"{s}/{metric}_high"] - v for s, v in zip(have, values)]]
        else:
            errors = None
        ax.errorbar(have, values, yerr=errors, fmt="o-", capsize=4)
        label, better = METRICS[metric]
        ax.set_title(f"{label.replace('pass@k', 'pass@' + str(metrics.get('pass_k', 'k')))}\n({better} is better)",
                     fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    fig.suptitle("Held-out metrics across the chain (95% intervals)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def plot_curves(curves: dict[str, list[dict]], path: Path) -> None:
    """One row per stage: its losses by step, and beside them its rewards / held-out accuracy when it logged any."""
    plt = _pyplot()
    stages = [s for s, rows in curves.items() if rows]
    with_scores = any(k in r for s in stages for r in curves[s] for k in SCORE_CURVES)
    cols = 2 if with_scores else 1
    fig, axes = plt.subplots(max(1, len(stages)), cols, figsize=(5.5 * cols, 2.6 * max(1, len(stages))),
                             squeeze=False)
    for row, stage in zip(axes, stages):
        for ax, names in zip(row, (LOSS_CURVES, SCORE_CURVES)):
            for key, label in names.items():
                points = [(r["step"], r[key]) for r in curves[stage] if key in r and r[key] is not None]
                if points:
                    ax.plot(*zip(*points), marker="." if len(points) < 30 else None, label=label)
            if ax.has_data():
                ax.set_title(stage, fontsize=9)
                ax.set_xlabel("step", fontsize=8)
                ax.tick_params(labelsize=8)
                ax.legend(fontsize=7)
                ax.grid(alpha=0.3)
            else:
                ax.axis("off")
    if not stages:
        axes[0][0].text(0.5, 0.5, "no training logs", ha="center", va="center")
        axes[0][0].axis("off")
    fig.suptitle("Training curves", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
