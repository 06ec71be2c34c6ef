"""Stage `evaluate`: every trained model of the chain (pretrain, sft, dpo, grpo) side by side on held-out data.

Per model: test-split bits per character (language modeling, next to a unigram baseline), SFT loss on held-out
conversations (assistant tokens), task accuracy on held-out GRPO-style questions (greedy reply exactly right) and
preference accuracy on held-out DPO pairs (chosen more likely than rejected). Held-out records come from the
corpus's test plays, whose characters no training record names; the task accuracy on (not held-out) training
prompts is reported beside it to show what the stages learned in-distribution. metrics.json holds them as
`<stage>/<metric>` plus the final model's language-modeling metrics under their plain names (what register
compares); evaluation.md is the table; samples.md has the final model's text and each model's answers.
For `dvc plots show` / `dvc plots diff` (dvc.yaml's `plots:`): chain.json has one row per model, and
curves/<stage>.json each training stage's loss curve (DVC plots read JSON, not the stages' metrics.jsonl).

Alone: `astrai stage evaluate` (what dvc.yaml runs).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from astrai_core.chat import load_chat
from astrai_core.checkpoint import load_model
from astrai_core.data import PackedTokens
from astrai_core.errors import AstraiError
from astrai_core.evaluate import (masked_token_loss, preference_accuracy, sequence_nll, summarize, task_accuracy,
                                  unigram_nll)
from astrai_core.generate import generate_text
from astrai_core.io import atomic_path, sha256_file, write_json
from tasks.params import Params
from tasks.training import MODEL_STAGES, final_model, model_dir

TABLE = [("test_bits_per_char", "test bits/char", "lower"), ("sft_test_loss", "SFT test loss", "lower"),
         ("task_accuracy", "task accuracy", "higher"), ("valid_answer_rate", "valid answer", "higher"),
         ("preference_accuracy", "preference accuracy", "higher"),
         ("train_task_accuracy", "task accuracy on training prompts", "higher")]


def evaluate(params: Params, root: Path, out_dir: Path) -> dict:
    """Writes out_dir/{metrics.json, evaluation.md, samples.md}; returns the metrics."""
    p = params.evaluate
    chat_dir = root / "data" / "chat"
    models = [s for s in MODEL_STAGES if (model_dir(root, s) / "model.safetensors").is_file()]
    if not models:
        raise AstraiError(f"{model_dir(root, 'pretrain')}: no trained model; run the pretrain stage first")
    final = final_model(root).name
    tokens, n_chars, tok = None, None, None
    grpo_test = _read_jsonl(chat_dir / "grpo_test.jsonl")[: p.task_examples]
    # Not held out: the same number of GRPO training prompts, to tell "learned nothing" from "did not transfer
    # to the unseen plays' characters".
    grpo_train = _read_jsonl(chat_dir / "grpo_train.jsonl")[: p.task_examples]
    metrics: dict = {"final_model": final}
    answers: dict[str, list[str]] = {}
    for i, stage in enumerate(models, 1):
        print(f"evaluate: model {i}/{len(models)}: {stage}", flush=True)  # minutes of work: say where it is
        ckpt = model_dir(root, stage)
        model, tok, cfg = load_model(ckpt)
        tok_sha = sha256_file(ckpt / "tokenizer.json")
        torch.manual_seed(p.seed)
        if tokens is None:
            with PackedTokens(root / "data" / "packed" / "test.h5", expected_tokenizer_sha256=tok_sha) as test:
                tokens = np.asarray(test.tokens[: p.max_tokens] if p.max_tokens else test.tokens[:])
            if len(tokens) < 2:
                raise AstraiError(f"{root / 'data/packed/test.h5'}: the test split has fewer than 2 tokens")
            n_chars = len(tok.decode(tokens[1:].tolist(), skip_special_tokens=True))  # characters predicted
        print(f"evaluate: {stage}: bits/char on {len(tokens):,} test tokens", flush=True)
        nll, n = sequence_nll(model, tokens, cfg.max_seq_len, p.batch_size)
        m = {f"test_{k}": v for k, v in summarize(nll, n, n_chars).items()}
        if chat_dir.is_dir():
            print(f"evaluate: {stage}: held-out SFT loss, preference pairs, {len(grpo_test)} + {len(grpo_train)} "
                  "questions", flush=True)
            m["sft_test_loss"] = masked_token_loss(model, str(chat_dir / "sft_test.h5"), tok_sha,
                                                   params.pretrain.seq_len, p.batch_size)
            m |= preference_accuracy(model, str(chat_dir / "dpo_test.h5"), tok_sha)
            chat = load_chat(ckpt / "tokenizer.json")
            task, answers[stage] = task_accuracy(model, chat, grpo_test, params.grpo.max_new_tokens)
            m |= task
            m["train_task_accuracy"] = task_accuracy(model, chat, grpo_train, params.grpo.max_new_tokens)[0]["task_accuracy"]
        metrics |= {f"{stage}/{k}": v for k, v in m.items()}
        if stage == final:
            metrics |= {k: v for k, v in m.items() if k.startswith("test_")}
            samples = _samples(params, model, tok)
    base = summarize(unigram_nll(tokens, cfg.vocab_size)[0], n, n_chars)
    metrics |= {f"unigram_{k}": v for k, v in base.items()} | {"test_tokens": n, "test_chars": n_chars}

    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        write_json(tmp / "metrics.json", metrics)
        (tmp / "evaluation.md").write_text(evaluation_table(metrics, models))
        (tmp / "samples.md").write_text(samples + _answers(grpo_test, answers))
        write_plot_data(root, models, metrics, tmp)
    return metrics


def write_plot_data(root: Path, models: list[str], metrics: dict, out_dir: Path) -> None:
    """chain.json: each model's held-out metrics, in chain order; curves/<stage>.json: its training loss by step."""
    chain = [{"model": stage} | {k: metrics[f"{stage}/{k}"] for k, _, _ in TABLE if f"{stage}/{k}" in metrics}
             for stage in models]
    write_json(out_dir / "chain.json", chain)
    (out_dir / "curves").mkdir()
    for stage in models:
        log = model_dir(root, stage) / "metrics.jsonl"
        rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.is_file() else []
        write_json(out_dir / "curves" / f"{stage}.json",
                   [{"step": r["step"], "train/loss": r["train/loss"]} for r in rows if "train/loss" in r])


def evaluation_table(metrics: dict, models: list[str]) -> str:
    head = "| model | " + " | ".join(f"{label} ({better} is better)" for _, label, better in TABLE) + " |"
    lines = ["# Evaluation on held-out data", "", head, "|---" * (len(TABLE) + 1) + "|"]
    for stage in models:
        cells = [f"{metrics[f'{stage}/{k}']:.4f}" if f"{stage}/{k}" in metrics else "-" for k, _, _ in TABLE]
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    lines += ["", f"Unigram baseline: {metrics['unigram_bits_per_char']:.4f} bits/char. "
              f"Final model: {metrics['final_model']}.", ""]
    return "\n".join(lines)


def _samples(params: Params, model, tok) -> str:
    p = params.evaluate
    lines = ["# Samples of the final model", ""]
    for prompt in p.prompts:
        for mode, temperature in (("greedy", 0.0), ("sampled", p.temperature)):
            gen = torch.Generator().manual_seed(p.seed)
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
