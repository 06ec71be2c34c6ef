"""evaluation.md: the evaluate stage's report, from its metrics and checks (tasks/evaluation/checks.py): the flags
first, then every model's held-out metrics with their 95% intervals, task accuracy per task family, each stage's
checks against its starting model, and the two pictures (tasks/evaluation/plots.py)."""

from __future__ import annotations

from tasks.evaluation.checks import Check
from tasks.evaluation.metrics import MAX_FORGETTING, METRICS


def _cell(metrics: dict, key: str) -> str:
    if key not in metrics:
        return "-"
    if f"{key}_low" not in metrics:
        return f"{metrics[key]:.4f}"
    return f"{metrics[key]:.3f} [{metrics[key + '_low']:.3f}, {metrics[key + '_high']:.3f}]"


def _label(metric: str, metrics: dict) -> str:
    label = METRICS[metric][0].replace("pass@k", f"pass@{metrics.get('pass_k', 'k')}")
    n = metrics.get(f"n/{metric}")
    return f"{label} ({METRICS[metric][1]} is better{f', n={n}' if n else ''})"


def evaluation_markdown(metrics: dict, models: list[str], checks: list[Check]) -> str:
    flags = [c for c in checks if not c.passed]
    lines = ["# Evaluation on held-out data", ""]
    if flags:
        lines += [f"**⚠ {len(flags)} flag{'s' if len(flags) > 1 else ''}:**", ""]
        lines += [f"* ⚠ **FLAG** {c.describe()}" for c in flags] + [""]
    elif checks:
        lines += ["Every stage beat its starting model on its target metric; no flags.", ""]
    shown = [k for k in METRICS if any(f"{s}/{k}" in metrics for s in models)]
    lines += ["Each cell: value [95% interval] (Wilson's; for pass@k, of its mean over the questions).", "",
              "| model | " + " | ".join(_label(k, metrics) for k in shown) + " |", "|---" * (len(shown) + 1) + "|"]
    lines += [f"| {s} | " + " | ".join(_cell(metrics, f"{s}/{k}") for k in shown) + " |" for s in models]
    lines += ["", f"Unigram baseline: {metrics['unigram_bits_per_char']:.4f} bits/char. "
              f"Final model: {metrics['final_model']}."]
    if "pass_k" in metrics:
        lines += ["", f"pass@1 and pass@{metrics['pass_k']}: {metrics['pass_samples']} replies sampled per held-out "
                  f"question at temperature {metrics['pass_temperature']}, scored with the unbiased estimator "
                  "1 - C(n-c, k) / C(n, k) and averaged over questions."]
    families = sorted(k.removeprefix("n/task_accuracy.") for k in metrics if k.startswith("n/task_accuracy."))
    if families:
        lines += ["", "## Task accuracy per task family (greedy, 95% Wilson interval)", "",
                  "| model | " + " | ".join(f"{f} (n={metrics['n/task_accuracy.' + f]})" for f in families) + " |",
                  "|---" * (len(families) + 1) + "|"]
        lines += [f"| {s} | " + " | ".join(_cell(metrics, f"{s}/task_accuracy.{f}") for f in families) + " |"
                  for s in models]
    if checks:
        lines += ["", "## Did each stage beat its starting model?", "",
                  "Rule: each post-training stage is compared with its starting model (the previous enabled stage's) "
                  "on the same held-out items. It beat it when the 95% interval of the paired difference of per-item "
                  "correctness (Newcombe's hybrid score interval for paired proportions) lies entirely above 0; a "
                  "metric it must keep is lowered when that interval lies entirely below 0. The final model's test "
                  f"bits/char must stay within {MAX_FORGETTING:.0%} of the pretrained model's, and its share of free "
                  "continuations of test text without a loop (a unit of 1-4 tokens repeated 4 times in a row) must not "
                  "fall below the pretrained model's beyond the interval.", "",
                  "| stage | starting model | metric | must | difference | 95% interval | passed |",
                  "|---|---|---|---|---|---|---|"]
        must = {"raise": "rise beyond the interval", "keep": "not fall beyond the interval",
                "forget": f"stay within +{MAX_FORGETTING:.0%}", "free": "not fall beyond the interval"}
        for c in checks:
            diff = f"{c.difference:+.1%}" if c.rule == "forget" else f"{c.difference:+.4f}"
            interval = "-" if c.low is None else f"[{c.low:+.4f}, {c.high:+.4f}]"
            lines.append(f"| {c.stage} | {c.start} | {METRICS[c.metric][0]} | {must[c.rule]} | {diff} | {interval} | "
                         + ("yes |" if c.passed else "**no ⚠ FLAG** |"))
    lines += ["", "![Each metric across the chain, with its 95% interval](chain.png)", "",
              "![Training curves of each stage](curves.png)", ""]
    return "\n".join(lines)
