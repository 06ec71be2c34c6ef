"""samples.md: the final model's text from a few prompts (greedy and sampled), and each model's greedy answers to
the first held-out questions; and the prompts themselves, which the register stage's logged model takes its input
example from (sample_prompts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

from astrai_core.inference.generate import generate_text
from astrai_core.runtime.device import model_device

DEMO_PROMPTS = ["ROMEO.\n", "To be, or not to be", "KING.\nMy lords,"]  # on Shakespeare's plays
SAMPLE_PROMPTS = 3  # of the held-out documents of any other corpus
PROMPT_CHARS = 40  # of a document's opening, at most, cut at a space


def sample_prompts(evaluate_prompts: list[str] | None, source: str, corpus_dir: Path) -> list[str]:
    """What the final model's samples start from: evaluate.prompts, else the demo's on the plays (`source`:
    corpus.source), else the opening of each of the first SAMPLE_PROMPTS held-out documents (the test split, then
    validation; train only when nothing is held out) of the corpus in `corpus_dir`: the user's own text, never
    Shakespeare's on a corpus of something else."""
    if evaluate_prompts is not None:
        return evaluate_prompts
    if source == "shakespeare":
        return DEMO_PROMPTS
    splits = [corpus_dir / f"{split}.jsonl" for split in ("test", "validation")]
    if all(next(_documents(path), None) is None for path in splits):  # nothing held out
        splits = [corpus_dir / "train.jsonl"]
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


def samples_markdown(model, tok, prompts: list[str], *, temperature: float, max_new_tokens: int, top_k: int | None,
                     seed: int) -> str:
    """samples.md's first part: the text `model` writes after each prompt, greedy and sampled at `temperature`."""
    lines = ["# Samples of the final model", ""]
    for i, prompt in enumerate(prompts):
        for mode, temp in (("greedy", 0.0), ("sampled", temperature)):
            # a seed per prompt: with one for all, the same draws led different prompts to the same words
            gen = torch.Generator(model_device(model)).manual_seed(seed + i)  # on a GPU: its generator
            text = generate_text(model, tok, prompt, max_new_tokens=max_new_tokens, temperature=temp,
                                 top_k=top_k, generator=gen)
            lines += [f"## {mode} (temperature {temp}): {prompt!r}", "", "```", prompt + text, "```", ""]
    return "\n".join(lines)


def answers_markdown(records: list[dict], answers: dict[str, list[str]]) -> str:
    """samples.md's second part: each model's greedy answer (answers: model -> replies) to the first held-out
    questions (records), below the question and its reference answer; nothing when no model answered."""
    if not answers:
        return ""
    lines = ["# Held-out questions: each model's greedy answer", ""]
    for i, r in enumerate(records[:5]):
        lines += ["```", r["prompt"], "```", f"reference: {r['answer']}", ""]
        lines += [f"* {stage}: {replies[i]!r}" for stage, replies in answers.items()] + [""]
    return "\n".join(lines)
