"""Stage `evaluate`: every trained model of the chain (pretrain, sft, dpo, grpo) side by side on held-out data, each
number with its uncertainty, and a check of whether each stage did what it is for.

Per model: test-split bits per character (language modeling, next to a unigram baseline), SFT loss on held-out
conversations (assistant tokens), task accuracy on held-out GRPO-style questions (greedy reply exactly right;
overall and per task family when the records name one), pass@1 and pass@k of sampled replies to them, preference
accuracy on held-out DPO pairs (chosen more likely than rejected), and the task accuracy on as many training
prompts (not held out) to tell "learned nothing" from "did not transfer". Every accuracy has its 95% Wilson
interval and its item count, pass@k the Wilson interval of its mean over the questions
(astrai_core/scoring/statistics.py).

Checks: each post-training stage against its starting model, the model before it in the chain (a disabled stage
passes its model on, so it is skipped here too), on the same items. A stage must raise its target metric (its
`target` in the stage table, tasks/run/table.py) beyond the interval: the 95% interval of the paired difference of
per-item correctness (Newcombe's, see astrai_core.scoring.statistics.paired_difference) lies above 0; and must not lower
a metric it should keep beyond it (the interval lies below 0). The final model's test bits/char must be within 5% of
the pretrained model's (no forgetting). A failed check is a flag, never hidden: a WARNING line in this stage's log
(the flow's task log), a tag `astrai.flag.<stage>` on the evaluate stage's MLflow run (tasks/stages/runner.py), and a
mark in evaluation.md.

Outputs in data/evaluate: metrics.json (`<stage>/<metric>`, `<stage>/<metric>_low` and `_high` for the interval,
`n/<metric>` items counted, and the final model's language-modeling metrics under their plain names), items.json
(each model's per-item results, what the paired comparisons read), checks.json, evaluation.md, samples.md (the final
model's text and each model's answers), chain.png (each metric across the chain with its intervals), curves.png
(each stage's training curves); and for `dvc plots show` (dvc.yaml's `plots:`; DVC plots read JSON, not the
stages' metrics.jsonl): chain.json, one row per model, and curves/<stage>.json, each stage's loss curve.

Alone: `astrai stage evaluate` (what dvc.yaml runs).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
from tokenizers import Tokenizer

from astrai_core.checkpoint.model_dir import load_model
from astrai_core.data.packed import PackedTokens
from astrai_core.generate import generate_text
from astrai_core.model.config import ModelConfig
from astrai_core.runtime.device import model_device, resolve_device
from astrai_core.runtime.errors import AstraiError
from astrai_core.runtime.io import atomic_path, sha256_file, write_json
from astrai_core.runtime.progress import Progress, advance, expect
from astrai_core.scoring.metrics import answer_questions, masked_token_loss, preference_margins, sequence_nll
from astrai_core.scoring.statistics import paired_difference, pass_at_k, summarize, unigram_nll, wilson_interval
from astrai_core.tokenizer.chat import load_chat
from astrai_core.training.rewards import exact_answer, valid_option
from tasks.evaluation.metrics import MAX_FORGETTING, METRICS
from tasks.run.configs import dpo_pairs
from tasks.run.schema import Params
from tasks.run.table import CHAT, CORPUS, MODEL_STAGES, PACKED, TRAINING, final_model, model_dir

MIN_ITEMS = 500  # fewer held-out items than this per metric is reported as a warning: intervals get wide


@dataclass
class Check:
    """One model against its starting model on one metric. rule: "raise" (the paired 95% interval of the difference
    lies above 0), "keep" (it does not lie below 0) or "forget" (difference: the relative change of test bits/char,
    at most MAX_FORGETTING)."""

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
        if self.rule == "raise":
            verdict = "beat" if self.passed else "did not beat"
            return f"{self.stage} {verdict} its starting model {self.start} on {self.metric}: {interval}"
        verdict = "kept" if self.passed else "lowered beyond the interval"
        return f"{self.stage} {verdict} {self.metric} against its starting model {self.start}: {interval}"


# The numbers `dvc metrics show`, `dvc metrics diff` and `dvc exp show` print (dvc.yaml's `metrics:`): each stage's
# target and the final model's bits/char against the unigram baseline; metrics.json beside it has everything.
HEADLINE = ("pretrain/test_bits_per_char",
            *(f"{name}/{stage.target}" for name, stage in TRAINING.items() if stage.target),
            "test_bits_per_char", "unigram_bits_per_char", "flags")


def headline(metrics: dict) -> dict:
    return {k: metrics[k] for k in HEADLINE if k in metrics}


def evaluate(params: Params, root: Path, out_dir: Path) -> tuple[dict, list[Check]]:
    """Writes out_dir (see the module's docstring); returns (metrics, checks)."""
    p = params.evaluate
    chat_dir = root / CHAT
    models = [s for s in MODEL_STAGES if (model_dir(root, s) / "model.safetensors").is_file()]
    if not models:
        raise AstraiError(f"{model_dir(root, 'pretrain')}: no trained model; run the pretrain stage first")
    final = final_model(root).name
    questions = _read_jsonl(chat_dir / "grpo_test.jsonl")[: p.task_examples]
    # Not held out: as many GRPO training prompts, to tell "learned nothing" from "did not transfer".
    train_questions = _read_jsonl(chat_dir / "grpo_train.jsonl")[: p.task_examples]
    tokens, n_chars, vocab_size = _test_tokens(params, root, model_dir(root, models[0]))

    # The models side by side, one process each (on 2 cores: the demo's four in 125 s instead of 146 s).
    workers = min(len(models), os.cpu_count() or 1)
    print(f"evaluate: {len(models)} models, {workers} at a time: {', '.join(models)}", flush=True)  # minutes of work
    with tempfile.TemporaryDirectory(prefix="astrai-lm-eval-") as tmp_name:
        lm_eval_data = None
        if p.lm_eval_tasks:  # their items from the held-out plays (tasks/evaluation/lm_eval_adapter.py), or none with a WARNING
            from tasks.evaluation.lm_eval_adapter import item_sets as lm_eval_item_sets, write_items

            lm_eval_data = write_items(root / CORPUS, Path(tmp_name), p.lm_eval_tasks, p.task_examples, p.seed)
        score = partial(_score_model, params, root, tokens, n_chars, questions, train_questions, final, lm_eval_data)
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=torch.set_num_threads,
                                 initargs=(max(1, (os.cpu_count() or 1) // workers),)) as pool:
            expect(len(models), "models scored")
            scored = []
            for result in pool.map(score, models):  # in order, each as it is done
                scored.append(result)
                advance()
        lm_eval_sets = lm_eval_item_sets(p.lm_eval_tasks, lm_eval_data, [m for _, it, _, _ in scored for m in it]) \
            if lm_eval_data else {}

    metrics: dict = {"final_model": final}
    items: dict[str, dict[str, list[int]]] = {}  # metric -> model -> per-item result (1 right, 0 wrong; pass: count)
    answers: dict[str, list[str]] = {}
    for stage, (m, stage_items, replies, stage_samples) in zip(models, scored):
        metrics |= {f"{stage}/{k}": v for k, v in m.items()}
        for name, results in stage_items.items():
            items.setdefault(name, {})[stage] = results
        if replies is not None:
            answers[stage] = replies
        if stage == final:
            metrics |= {k: v for k, v in m.items() if k.startswith("test_")}
            samples = stage_samples
    n = len(tokens) - 1
    base = summarize(unigram_nll(tokens, vocab_size)[0], n, n_chars)
    metrics |= {f"unigram_{k}": v for k, v in base.items()} | {"test_tokens": n, "test_chars": n_chars}
    metrics |= item_counts(questions, items)
    if questions:
        metrics |= {"pass_samples": p.pass_samples, "pass_k": p.pass_k, "pass_temperature": p.pass_temperature}
    for name, count in metrics.items():
        if name.startswith("n/") and "." not in name and count < MIN_ITEMS:
            print(f"WARNING: evaluate: {name[2:]} counts only {count} items (fewer than {MIN_ITEMS}): its interval "
                  "is wide", flush=True)

    curves = training_curves(root, models)
    checks = stage_checks(models, items, metrics, curves, kept=tuple(lm_eval_sets))
    metrics["flags"] = sum(not c.passed for c in checks)
    for check in checks:
        print(("evaluate: " if check.passed else "WARNING: evaluate: ") + check.describe(), flush=True)

    from tasks.evaluation.plots import plot_chain, plot_curves

    with atomic_path(out_dir, "stage evaluate") as tmp:
        tmp.mkdir()
        write_json(tmp / "metrics.json", metrics)
        write_json(tmp / "headline.json", headline(metrics))
        write_json(tmp / "items.json", items | {"task_family": [q.get("task") for q in questions],
                                                "item_sets": item_sets(params, root, questions, train_questions)
                                                | lm_eval_sets})
        write_json(tmp / "checks.json", [asdict(c) for c in checks])
        (tmp / "evaluation.md").write_text(evaluation_markdown(metrics, models, checks))
        (tmp / "samples.md").write_text(samples + _answers(questions, answers))
        write_plot_data(models, metrics, curves, tmp)
        plot_chain(models, metrics, tmp / "chain.png")
        plot_curves(curves, tmp / "curves.png")
    return metrics, checks


def _test_tokens(params: Params, root: Path, ckpt: Path) -> tuple[np.ndarray, int, int]:
    """The test split's tokens (checked against the model's tokenizer), the characters they predict, the vocab size."""
    p = params.evaluate
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    with PackedTokens(root / PACKED / "test.h5", expected_tokenizer_sha256=sha256_file(ckpt / "tokenizer.json")) as test:
        tokens = np.asarray(test.tokens[: p.max_tokens] if p.max_tokens else test.tokens[:])
    if len(tokens) < 2:
        raise AstraiError(f"{root / PACKED / 'test.h5'}: the test split has fewer than 2 tokens")
    n_chars = len(tok.decode(tokens[1:].tolist(), skip_special_tokens=True))  # characters predicted
    vocab_size = ModelConfig.model_validate_json((ckpt / "config.json").read_text()).vocab_size
    return tokens, n_chars, vocab_size


def _score_model(params: Params, root: Path, tokens: np.ndarray, n_chars: int, questions: list[dict],
                 train_questions: list[dict], final: str, lm_eval_data: Path | None, stage: str):
    """One model's metrics -> (metrics, per-item results by metric, its greedy replies to the held-out questions,
    the text samples if it is the final model). Runs in a worker process of evaluate()."""
    with Progress(f"evaluate: {stage}"):  # this worker's own lines: what it scores, how far, its eta
        return _score(params, root, tokens, n_chars, questions, train_questions, final, lm_eval_data, stage)


def _score(params: Params, root: Path, tokens: np.ndarray, n_chars: int, questions: list[dict],
           train_questions: list[dict], final: str, lm_eval_data: Path | None, stage: str):
    p = params.evaluate
    chat_dir = root / CHAT
    ckpt = model_dir(root, stage)
    device = resolve_device(p.device)
    model, tok, cfg = load_model(ckpt, device=device)
    tok_sha = sha256_file(ckpt / "tokenizer.json")
    torch.manual_seed(p.seed)
    print(f"evaluate: {stage} on {device}: bits/char on {len(tokens):,} test tokens", flush=True)
    nll, n = sequence_nll(model, tokens, min(p.seq_len or cfg.max_seq_len, cfg.max_seq_len), p.batch_size)
    m = {f"test_{k}": v for k, v in summarize(nll, n, n_chars).items()}
    items: dict[str, list[int]] = {}
    replies = None
    if chat_dir.is_dir():
        print(f"evaluate: {stage}: held-out SFT loss, preference pairs, {len(questions)} + "
              f"{len(train_questions)} questions, {p.pass_samples} samples of each held-out one", flush=True)
        # A disabled stage with no demo data to derive (a corpus without plays) left its kind's files empty.
        packed = json.loads((chat_dir / "pack_stats.json").read_text()) if (chat_dir / "pack_stats.json").is_file() \
            else {}
        if packed.get("sft_test", 1):
            m["sft_test_loss"] = masked_token_loss(model, str(chat_dir / "sft_test.h5"), tok_sha,
                                                   params.pretrain.seq_len, p.batch_size)
        right = {}  # metric -> per-item correctness
        margins = preference_margins(model, str(dpo_pairs(params, root, "test")), tok_sha) \
            if packed.get("dpo_test", 1) else []
        if len(margins):
            right["preference_accuracy"] = margins > 0
            m["preference_margin"] = float(margins.mean())
        chat = load_chat(ckpt / "tokenizer.json")
        max_new = params.grpo.objective.max_new_tokens
        if questions:
            replies = [r[0] for r in answer_questions(model, chat, questions, max_new)]
            right["task_accuracy"] = [exact_answer(c, q) for c, q in zip(replies, questions)]
            if any(q.get("options") for q in questions):  # multiple choice: is the reply one of the options?
                right["valid_answer_rate"] = [valid_option(c, q) for c, q in zip(replies, questions)]
            sampled = answer_questions(model, chat, questions, max_new, samples=p.pass_samples,
                                       temperature=p.pass_temperature, seed=p.seed)
            items["pass_correct"] = [sum(int(exact_answer(c, q)) for c in replies_to_q)
                                     for replies_to_q, q in zip(sampled, questions)]
            m |= pass_metrics(items["pass_correct"], p.pass_samples, p.pass_k)
            m |= family_accuracies(right["task_accuracy"], [q.get("task") for q in questions])
        if train_questions:
            train_replies = [r[0] for r in answer_questions(model, chat, train_questions, max_new)]
            right["train_task_accuracy"] = [exact_answer(c, q) for c, q in zip(train_replies, train_questions)]
        for name, results in right.items():
            m |= accuracy(name, results)
            items[name] = [int(bool(r)) for r in results]
    if lm_eval_data:  # the lm-eval tasks' items (evaluate.lm_eval_tasks), written by evaluate()
        from tasks.evaluation.lm_eval_adapter import run_tasks, scores

        print(f"evaluate: {stage}: lm-eval tasks {', '.join(p.lm_eval_tasks)}", flush=True)
        chat = load_chat(ckpt / "tokenizer.json")
        lm_metrics, lm_items = scores(run_tasks(model, chat, p.lm_eval_tasks, lm_eval_data, p.batch_size))
        m |= lm_metrics
        items |= lm_items
    print(f"evaluate: {stage}: done", flush=True)
    return m, items, replies, _samples(params, root, model, tok) if stage == final else None


# ---- metrics with their intervals ---------------------------------------------------------------------------------

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


def item_sets(params: Params, root: Path, questions: list[dict], train_questions: list[dict]) -> dict[str, str]:
    """metric -> sha256 of the items it was scored on: two evaluations of the same items can be compared item by
    item (the register stage's champion gate pairs a new version with the champion only then)."""
    def digest(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()

    held_out, train = (digest(json.dumps(q, sort_keys=True).encode()) for q in (questions, train_questions))
    sets = {m: held_out for m in ("task_accuracy", "valid_answer_rate", "pass_at_1", "pass_at_k")}
    sets["train_task_accuracy"] = train
    pairs = dpo_pairs(params, root, "test")
    if pairs.is_file():
        sets["preference_accuracy"] = sha256_file(pairs)
    return sets


def stage_checks(models: list[str], items: dict[str, dict[str, list[int]]], metrics: dict,
                 curves: dict[str, list[dict]] | None = None, kept: tuple[str, ...] = ()) -> list[Check]:
    """Each post-training model against the model before it in the chain (the stage table's target and keep; every
    stage must also keep the metrics in `kept`: the lm-eval tasks' accuracies), and the final model's forgetting
    against the pretrained model. A failed GRPO check says why, from its training curve (grpo_why)."""
    checks = []
    for start, stage in zip(models, models[1:]):
        target, stage_kept = TRAINING[stage].target, TRAINING[stage].keep
        for metric in (target, *stage_kept, *kept):
            if stage not in items.get(metric, {}):
                continue
            difference, low, high = paired_difference(items[metric][start], items[metric][stage])
            raise_ = metric == target
            passed = low > 0 if raise_ else high >= 0
            why = grpo_why(metrics, start, (curves or {}).get(stage, [])) \
                if TRAINING[stage].strategy == "grpo" and raise_ and not passed else ""
            checks.append(Check(stage, start, metric, "raise" if raise_ else "keep", difference, low, high, passed,
                                why))
    final = metrics["final_model"]
    if final != "pretrain" and "pretrain" in models:
        change = metrics[f"{final}/test_bits_per_char"] / metrics["pretrain/test_bits_per_char"] - 1
        checks.append(Check(final, "pretrain", "test_bits_per_char", "forget", change, None, None,
                            passed=change <= MAX_FORGETTING))
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


# ---- reports --------------------------------------------------------------------------------------------------

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
                  f"bits/char must stay within {MAX_FORGETTING:.0%} of the pretrained model's.", "",
                  "| stage | starting model | metric | must | difference | 95% interval | passed |",
                  "|---|---|---|---|---|---|---|"]
        must = {"raise": "rise beyond the interval", "keep": "not fall beyond the interval",
                "forget": f"stay within +{MAX_FORGETTING:.0%}"}
        for c in checks:
            diff = f"{c.difference:+.1%}" if c.rule == "forget" else f"{c.difference:+.4f}"
            interval = "-" if c.low is None else f"[{c.low:+.4f}, {c.high:+.4f}]"
            lines.append(f"| {c.stage} | {c.start} | {METRICS[c.metric][0]} | {must[c.rule]} | {diff} | {interval} | "
                         + ("yes |" if c.passed else "**no ⚠ FLAG** |"))
    lines += ["", "![Each metric across the chain, with its 95% interval](chain.png)", "",
              "![Training curves of each stage](curves.png)", ""]
    return "\n".join(lines)


# ---- training curves and plot data ----------------------------------------------------------------------------------

def training_curves(root: Path, models: list[str]) -> dict[str, list[dict]]:
    """Each model's training log (metrics.jsonl rows: step and the logged values)."""
    curves = {}
    for stage in models:
        log = model_dir(root, stage) / "metrics.jsonl"
        curves[stage] = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] \
            if log.is_file() else []
    return curves


def write_plot_data(models: list[str], metrics: dict, curves: dict[str, list[dict]], out_dir: Path) -> None:
    """chain.json: each model's held-out metrics, in chain order; curves/<stage>.json: its training loss by step."""
    chain = [{"model": stage} | {k: metrics[f"{stage}/{k}"] for k in METRICS if f"{stage}/{k}" in metrics}
             for stage in models]
    write_json(out_dir / "chain.json", chain)
    (out_dir / "curves").mkdir()
    for stage in models:
        write_json(out_dir / "curves" / f"{stage}.json",
                   [{"step": r["step"], "train/loss": r["train/loss"]} for r in curves[stage] if "train/loss" in r])


DEMO_PROMPTS = ["ROMEO.\n", "To be, or not to be", "KING.\nMy lords,"]  # on Shakespeare's plays
SAMPLE_PROMPTS = 3  # of the held-out documents of any other corpus
PROMPT_CHARS = 40  # of a document's opening, at most, cut at a space


def sample_prompts(params: Params, root: Path) -> list[str]:
    """What the final model's samples start from: evaluate.prompts, else the demo's on the plays, else the opening
    of each of the first SAMPLE_PROMPTS held-out documents (the test split, then validation; train only when
    nothing is held out) of the corpus: the user's own text, never Shakespeare's on a corpus of something else."""
    if params.evaluate.prompts is not None:
        return params.evaluate.prompts
    if params.corpus.source == "shakespeare":
        return DEMO_PROMPTS
    splits = [root / CORPUS / f"{split}.jsonl" for split in ("test", "validation")]
    if all(next(_documents(path), None) is None for path in splits):  # nothing held out
        splits = [root / CORPUS / "train.jsonl"]
    prompts: list[str] = []
    for path in splits:
        for text in _documents(path):
            line = next((s.strip() for s in text.splitlines() if s.strip()), "")
            if len(line) > PROMPT_CHARS:  # cut at a space
                line = line[:PROMPT_CHARS].rsplit(" ", 1)[0] if " " in line[:PROMPT_CHARS] else line[:PROMPT_CHARS]
            if line and line not in prompts:
                prompts.append(line)
            if len(prompts) == SAMPLE_PROMPTS:
                return prompts
    return prompts


def _documents(path: Path) -> Iterator[str]:
    """The texts of a corpus split, one at a time (a held-out split of a large corpus is large)."""
    if path.is_file():
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)["text"]


def _samples(params: Params, root: Path, model, tok) -> str:
    p = params.evaluate
    lines = ["# Samples of the final model", ""]
    for i, prompt in enumerate(sample_prompts(params, root)):
        for mode, temperature in (("greedy", 0.0), ("sampled", p.temperature)):
            # a seed per prompt: with one for all, the same draws led different prompts to the same words
            gen = torch.Generator(model_device(model)).manual_seed(p.seed + i)  # on a GPU: its generator
            text = generate_text(model, tok, prompt, max_new_tokens=p.max_new_tokens, temperature=temperature,
                                 top_k=p.top_k, generator=gen)
            lines += [f"## {mode} (temperature {temperature}): {prompt!r}", "", "```", prompt + text, "```", ""]
    return "\n".join(lines)


def _answers(records: list[dict], answers: dict[str, list[str]]) -> str:
    if not answers:
        return ""
    lines = ["# Held-out questions: each model's greedy answer", ""]
    for i, r in enumerate(records[:5]):
        lines += ["```", r["prompt"], "```", f"reference: {r['answer']}", ""]
        lines += [f"* {stage}: {replies[i]!r}" for stage, replies in answers.items()] + [""]
    return "\n".join(lines)


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
