"""Held-out greedy task accuracy, preference accuracy, bits/char and free text without a loop of checkpoints, each
paired against the first: what the evaluate stage measures for those four metrics (the same questions, pairs,
replies, scoring, test tokens and continuations), without scoring every model of the chain. For comparing one
stage's settings quickly, e.g. GRPO variants from the same DPO model:

    python bench/task_accuracy.py --root RUN --params RUN/params.yaml RUN/data/dpo OUT/grpo_a OUT/grpo_b \
        [--out bench/REPORT.json]
    python bench/task_accuracy.py --root RUN --params RUN/params.yaml --profile finetune RUN/data/grpo --dtypes fp32 bf16

--dtypes: each checkpoint is scored with its weights in each dtype in turn (as `astrai serve --dtype` loads them;
evaluate computes in fp32); the first checkpoint in the first dtype is the baseline.

RUN: a checkout whose data/ holds the run (data/chat/grpo_test.jsonl, the held-out DPO pairs evaluate scores,
data/packed/test.h5); the first
evaluate.task_examples questions, evaluate.max_tokens test tokens in windows of evaluate.seq_len.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from astrai_core.checkpoint.model_dir import load_model  # noqa: E402
from astrai_core.runtime.device import INFERENCE_DTYPES  # noqa: E402
from astrai_core.runtime.errors import AstraiError  # noqa: E402
from astrai_core.runtime.io import sha256_file  # noqa: E402
from astrai_core.scoring.metrics import answer_questions, preference_margins, sequence_nll  # noqa: E402
from astrai_core.scoring.statistics import paired_difference, summarize  # noqa: E402
from astrai_core.tokenizer.chat import load_chat  # noqa: E402
from astrai_core.training.rewards import exact_answer  # noqa: E402
from bench.serving import machine  # noqa: E402
from tasks.evaluation.free_text import free_prompts, loop_free  # noqa: E402
from tasks.evaluation.held_out import read_jsonl, read_test_tokens  # noqa: E402
from tasks.run.configs import dpo_pairs  # noqa: E402
from tasks.run.params import load_params, load_profile, parse_params, run_params_text  # noqa: E402
from tasks.run.table import CHAT, PACKED  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoints", type=Path, nargs="+", help="the first is the baseline")
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--params", type=Path, required=True)
    ap.add_argument("--profile", help="the run's profile: profiles/NAME.yaml merged into --params, as `astrai "
                    "pipeline --profile NAME` ran it (params.yaml is the user's again once a run ends)")
    ap.add_argument("--dtypes", nargs="+", default=["fp32"], choices=list(INFERENCE_DTYPES))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    try:
        if args.profile:  # pretrain.init_from as the run had it (a profile without pretraining needs one): its copy
            start = {"pretrain.init_from": str(args.root / "data" / "pretrain")}
            params = parse_params(yaml.safe_load(run_params_text(args.params, start, load_profile(ROOT, args.profile))),
                                  str(args.params))
        else:
            params = load_params(args.params)
    except AstraiError as e:
        sys.exit(f"bench/task_accuracy.py: error: {e}")
    for need in (args.root / CHAT / "grpo_test.jsonl", args.root / PACKED / "test.h5",
                 *(ckpt / "tokenizer.json" for ckpt in args.checkpoints)):
        if not need.is_file():
            sys.exit(f"bench/task_accuracy.py: error: {need}: no such file (--root: a run's checkout; each "
                     "checkpoint: a model directory)")
    p = params.evaluate
    questions = read_jsonl(args.root / CHAT / "grpo_test.jsonl")[: p.task_examples]
    tokens, n_chars, _ = read_test_tokens(args.root / PACKED / "test.h5", args.checkpoints[0], p.max_tokens)
    prompts = free_prompts(tokens, p.free_samples)
    pairs = dpo_pairs(params, args.root, "test")
    rows, right, free, preferred = [], {}, {}, {}
    runs = [(ckpt, dtype) for ckpt in args.checkpoints for dtype in args.dtypes]
    for run in runs:
        ckpt, dtype = run
        model, _, cfg = load_model(ckpt, dtype=INFERENCE_DTYPES[dtype])
        nll, n = sequence_nll(model, tokens, min(p.seq_len or cfg.max_seq_len, cfg.max_seq_len), p.batch_size)
        replies = [r[0] for r in answer_questions(model, load_chat(ckpt / "tokenizer.json"), questions,
                                                  params.grpo.objective.max_new_tokens)]
        right[run] = [bool(exact_answer(c, q)) for c, q in zip(replies, questions)]
        families: dict[str, list[bool]] = {}
        for ok, q in zip(right[run], questions):
            families.setdefault(q.get("task"), []).append(ok)
        preferred[run] = [bool(m > 0) for m in preference_margins(
            model, str(pairs), sha256_file(ckpt / "tokenizer.json"))] if pairs.is_file() else []
        free[run] = loop_free(model, prompts, p.max_new_tokens, p.temperature, p.top_k, p.seed) if prompts else []
        row = {"checkpoint": str(ckpt), "dtype": dtype,
               "test_bits_per_char": round(summarize(nll, n, n_chars)["bits_per_char"], 4),
               "task_accuracy": round(sum(right[run]) / len(questions), 4),
               "families": {k: round(sum(v) / len(v), 3) for k, v in families.items()},
               "preference_accuracy": round(sum(preferred[run]) / max(1, len(preferred[run])), 4),
               "loop_free_rate": round(sum(free[run]) / max(1, len(prompts)), 4)}
        if run != runs[0]:
            for name, per_item in (("task_accuracy", right), ("preference_accuracy", preferred),
                                   ("loop_free_rate", free)):
                diff = paired_difference(per_item[runs[0]], per_item[run]) if per_item[run] else ()
                row[f"{name}_difference"] = [round(x, 4) for x in diff]
        print(json.dumps(row), flush=True)
        rows.append(row)
        del model
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if args.out:
        report = {"machine": machine(), "questions": len(questions), "pairs": len(preferred[runs[0]]),
                  "test_tokens": len(tokens),
                  "free_samples": len(prompts), "rows": rows}
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
