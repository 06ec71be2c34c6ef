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

This module reads the inputs, scores each model and writes the outputs; what it scores and writes with is
tasks/evaluation/'s: the held-out tokens and questions (held_out.py), the intervals (intervals.py), the checks
(checks.py), evaluation.md (report.py), samples.md (samples.py) and the plots (plots.py).

Alone: `astrai stage evaluate` (what dvc.yaml runs).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from functools import partial
from pathlib import Path

import numpy as np
import torch

from astrai_core.checkpoint.model_dir import load_model
from astrai_core.runtime.device import resolve_device
from astrai_core.runtime.errors import AstraiError
from astrai_core.runtime.io import atomic_path, sha256_file, write_json
from astrai_core.runtime.progress import Progress, advance, expect
from astrai_core.scoring.metrics import answer_questions, masked_token_loss, preference_margins, sequence_nll
from astrai_core.scoring.statistics import summarize, unigram_nll
from astrai_core.tokenizer.chat import load_chat
from astrai_core.training.rewards import exact_answer, valid_option
from tasks.evaluation.checks import Check, stage_checks
from tasks.evaluation.free_text import free_prompts, loop_free
from tasks.evaluation.held_out import item_sets, read_jsonl, read_test_tokens
from tasks.evaluation.intervals import accuracy, family_accuracies, item_counts, pass_metrics
from tasks.evaluation.report import evaluation_markdown
from tasks.evaluation.samples import answers_markdown, sample_prompts, samples_markdown
from tasks.run.configs import dpo_pairs
from tasks.run.schema import Params
from tasks.run.table import CHAT, CORPUS, MODEL_STAGES, PACKED, TRAINING, final_model, model_dir

MIN_ITEMS = 500  # fewer held-out items than this per metric is reported as a warning: intervals get wide


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
    questions = read_jsonl(chat_dir / "grpo_test.jsonl")[: p.task_examples]
    # Not held out: as many GRPO training prompts, to tell "learned nothing" from "did not transfer".
    train_questions = read_jsonl(chat_dir / "grpo_train.jsonl")[: p.task_examples]
    tokens, n_chars, vocab_size = read_test_tokens(root / PACKED / "test.h5", model_dir(root, models[0]), p.max_tokens)

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
    checks = stage_checks(models, items, metrics, TRAINING, curves, kept=tuple(lm_eval_sets))
    metrics["flags"] = sum(not c.passed for c in checks)
    for check in checks:
        print(("evaluate: " if check.passed else "WARNING: evaluate: ") + check.describe(), flush=True)

    from tasks.evaluation.plots import plot_chain, plot_curves, write_plot_data

    with atomic_path(out_dir, "stage evaluate") as tmp:
        tmp.mkdir()
        write_json(tmp / "metrics.json", metrics)
        write_json(tmp / "headline.json", headline(metrics))
        sets = item_sets(questions, train_questions, dpo_pairs(params, root, "test")) | lm_eval_sets
        write_json(tmp / "items.json", items | {"task_family": [q.get("task") for q in questions], "item_sets": sets})
        write_json(tmp / "checks.json", [asdict(c) for c in checks])
        (tmp / "evaluation.md").write_text(evaluation_markdown(metrics, models, checks))
        (tmp / "samples.md").write_text(samples + answers_markdown(questions, answers))
        write_plot_data(models, metrics, curves, tmp)
        plot_chain(models, metrics, tmp / "chain.png")
        plot_curves(curves, tmp / "curves.png")
    return metrics, checks


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
    # Free text: does it still continue text, or loop on post-training's answers? (none: a test split too short)
    if prompts := free_prompts(tokens, p.free_samples):
        print(f"evaluate: {stage}: {len(prompts)} free continuations of test text", flush=True)
        items["loop_free_rate"] = loop_free(model, prompts, p.max_new_tokens, p.temperature, p.top_k, p.seed)
        m |= accuracy("loop_free_rate", items["loop_free_rate"])
    print(f"evaluate: {stage}: done", flush=True)
    samples = samples_markdown(model, tok, sample_prompts(p.prompts, params.corpus.source, root / CORPUS),
                               temperature=p.temperature, max_new_tokens=p.max_new_tokens, top_k=p.top_k,
                               seed=p.seed) if stage == final else None
    return m, items, replies, samples


# ---- training curves --------------------------------------------------------------------------------------------

def training_curves(root: Path, models: list[str]) -> dict[str, list[dict]]:
    """Each model's training log (metrics.jsonl rows: step and the logged values)."""
    curves = {}
    for stage in models:
        log = model_dir(root, stage) / "metrics.jsonl"
        curves[stage] = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] \
            if log.is_file() else []
    return curves

