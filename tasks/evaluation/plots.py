"""The evaluate stage's two pictures (matplotlib, PNG): each held-out metric across the chain with its 95% interval,
and each stage's training curves. The evaluate stage writes them beside evaluation.md, logs them to its MLflow run,
and the flow shows them in its Prefect artifact. And their data for `dvc plots show` (write_plot_data: DVC plots read
JSON)."""

from __future__ import annotations

import math
from pathlib import Path

from astrai_core.runtime.io import write_json
from tasks.evaluation.metrics import MAX_FORGETTING, METRICS

# Training-log keys drawn per stage: its losses, and what it was optimizing or how it did on held-out prompts.
LOSS_CURVES = {"train/loss": "train loss", "val/loss": "validation loss"}
SCORE_CURVES = {"grpo/reward_mean": "GRPO train reward", "val/reward": "held-out reward",
                "val/task_accuracy": "held-out task accuracy", "dpo/reward_accuracy": "DPO reward accuracy"}
Y_LABELS = {"loss": "loss (nats per loss unit)", "score": "score (0 to 1)"}  # units: tokens, DPO pairs, ...
DPI = 80  # small files: both are embedded in the Prefect artifact as data URIs


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    return plt


STYLES = ["-", "--", ":", "-."]  # one per line of a panel, so lines that overlap stay told apart
MARKERS = ["o", "s", "^", "D"]


def plot_chain(models: list[str], metrics: dict, path: Path) -> None:
    _save(chain_figure(models, metrics), path)


def plot_curves(curves: dict[str, list[dict]], path: Path) -> None:
    _save(curves_figure(curves), path)


def write_plot_data(models: list[str], metrics: dict, curves: dict[str, list[dict]], out_dir: Path) -> None:
    """chain.json: each model's held-out metrics, in chain order; curves/<stage>.json: its training loss by step."""
    chain = [{"model": stage} | {k: metrics[f"{stage}/{k}"] for k in METRICS if f"{stage}/{k}" in metrics}
             for stage in models]
    write_json(out_dir / "chain.json", chain)
    (out_dir / "curves").mkdir()
    for stage in models:
        write_json(out_dir / "curves" / f"{stage}.json",
                   [{"step": r["step"], "train/loss": r["train/loss"]} for r in curves[stage] if "train/loss" in r])


def _save(fig, path: Path) -> None:
    fig.savefig(path, dpi=DPI)
    _pyplot().close(fig)


def chain_figure(models: list[str], metrics: dict):
    """One panel per metric: its value for each model in chain order, error bars from `<stage>/<metric>_low/_high`;
    bits/char against the unigram baseline and the forgetting limit (pretrain's + MAX_FORGETTING)."""
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
        ax.errorbar(have, values, yerr=errors, fmt="o-", capsize=4, label="model")
        label, better = METRICS[metric]
        label = label.replace("pass@k", "pass@" + str(metrics.get("pass_k", "k")))
        if metric == "test_bits_per_char":
            if "unigram_bits_per_char" in metrics:
                ax.axhline(metrics["unigram_bits_per_char"], ls="--", color="gray", label="unigram baseline")
            if "pretrain/test_bits_per_char" in metrics:
                ax.axhline(metrics["pretrain/test_bits_per_char"] * (1 + MAX_FORGETTING), ls=":", color="red",
                           label=f"forgetting limit (+{MAX_FORGETTING:.0%})")
            ax.legend(fontsize=7)
        ax.set_title(f"{label}\n({better} is better)", fontsize=9)
        ax.set_ylabel(label, fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(shown):]:
        ax.remove()
    fig.suptitle("Held-out metrics across the chain (95% intervals)", fontsize=11)
    fig.tight_layout()
    return fig


def curves_figure(curves: dict[str, list[dict]]):
    """A panel for each stage's losses and one for its scores (rewards, held-out accuracy) where it logged any, two
    to a row; each line its own style."""
    plt = _pyplot()
    panels = []  # (stage, what, {key: label}) with data
    for stage, rows in curves.items():
        for what, names in (("loss", LOSS_CURVES), ("score", SCORE_CURVES)):
            series = {k: v for k, v in names.items() if any(r.get(k) is not None for r in rows)}
            if series:
                panels.append((stage, what, series))
    cols = 2 if len(panels) > 1 else 1
    rows = max(1, math.ceil(len(panels) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 2.6 * rows), squeeze=False)
    for ax, (stage, what, series) in zip(axes.flat, panels):
        for i, (key, label) in enumerate(series.items()):
            points = [(r["step"], r[key]) for r in curves[stage] if r.get(key) is not None]
            ax.plot(*zip(*points), ls=STYLES[i % 4], marker=MARKERS[i % 4] if len(points) < 30 else None,
                    markersize=4, label=label)
        ax.set_title(f"{stage}: {what}", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel(Y_LABELS[what], fontsize=8)
        ax.tick_params(labelsize=8)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.remove()
    if not panels:
        fig.text(0.5, 0.5, "no training logs", ha="center", va="center")
    fig.suptitle("Training curves", fontsize=11)
    fig.tight_layout()
    return fig
