"""lm-evaluation-harness tasks over the held-out plays: the JSONL that the task definitions in evals/lm_eval_tasks/
read, written from the corpus stage's test split at run time (the plays' text is never committed).

    astrai lm-eval-data                       # data/corpus/test.jsonl -> evals/lm_eval_tasks/data/*.jsonl
    lm_eval --model local-completions ... --include_path evals/lm_eval_tasks --tasks astrai_next_speaker,astrai_speech_ppl

    task                 lm-eval output_type      one item
    astrai_next_speaker  multiple_choice          2 speeches of a scene, then which of 4 of the play's speakers
                                                  speaks next ("ROMEO." ...), scored by the name's loglikelihood
    astrai_speech_ppl    loglikelihood_rolling    one speech ("NAME.\\nits lines"): word/byte perplexity, bits per byte
    astrai_<family>      generate_until           a question of the demo's task family (tasks/chat/demo_tasks.py:
                                                  first_speaker, speech_count, word_count, is_question, last_word)
                                                  about a held-out passage, as a chat prompt; exact_match of the
                                                  greedy reply (what evaluate's task_accuracy.<family> counts)

The first two are plain text in the corpus's own layout (a speaker's name in capitals with a period, then the
lines, a blank line between speeches): what a pretrained model has learnt to continue, no chat template. The
families' prompts are rendered with astrai's default chat template (astrai_core/tokenizer/chat.py), so
`local-completions` sends exactly the tokens `astrai generate --chat` would; a model with its own template (an imported
one) is asked in astrai's. Each file is deterministic in (corpus, seed); `limit` items per task, drawn evenly from every
play.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Iterable

from astrai_core.runtime.errors import AstraiError
from astrai_core.runtime.io import atomic_path, check_output
from astrai_core.tokenizer.chat import compile_template
from tasks.chat.demo_tasks import TASKS as FAMILIES, items as family_items, passage_text
from tasks.chat.plays import Speech, read_plays

CONTEXT_SPEECHES = 2  # speeches before the one whose speaker is asked for
CHOICES = 4
SPEECH_LINES = 6  # lines of a speech kept for perplexity: short enough for a small model's context
KIND = "astrai lm-eval-data"  # what the data folder's OUTPUT_MARK records
FILES = {"astrai_next_speaker": "next_speaker.jsonl", "astrai_speech_ppl": "speeches.jsonl",
         **{f"astrai_{family}": f"{family}.jsonl" for family in FAMILIES}}


def next_speaker_items(plays: dict[str, list[Speech]], seed: int) -> list[dict]:
    """Each speech of a scene after its first CONTEXT_SPEECHES, in a play with at least CHOICES speakers: the
    preceding speeches as context, the true speaker and CHOICES - 1 other speakers of the play, shuffled."""
    out = []
    for play, speeches in plays.items():
        names = sorted({s.speaker for s in speeches})
        if len(names) < CHOICES:
            continue
        for i in range(CONTEXT_SPEECHES, len(speeches)):
            run = speeches[i - CONTEXT_SPEECHES:i + 1]
            if not all(a.scene == b.scene and a.pos + 1 == b.pos for a, b in zip(run, run[1:])):
                continue
            rng = random.Random(f"{seed}:{play}:{run[-1].pos}")
            truth = run[-1].speaker
            choices = [truth] + rng.sample([n for n in names if n != truth], CHOICES - 1)
            rng.shuffle(choices)
            out.append({"play": play, "context": passage_text(run[:-1]) + "\n\n",
                        "choices": [f"{name}." for name in choices], "label": choices.index(truth)})
    return out


def speech_items(plays: dict[str, list[Speech]]) -> list[dict]:
    return [{"play": play, "text": f"{s.speaker}.\n" + "\n".join(s.lines[:SPEECH_LINES])}
            for play, speeches in plays.items() for s in speeches if s.lines]


def family_tasks(plays: dict[str, list[Speech]], seed: int) -> dict[str, list[dict]]:
    """astrai_<family> -> its items: {"prompt": the question as a chat prompt (ending with the assistant header),
    "answer"}, from the demo's task generator on these plays."""
    template = compile_template()
    out: dict[str, list[dict]] = {f"astrai_{family}": [] for family in FAMILIES}
    for item in family_items(plays, f"lm-eval:{seed}"):
        prompt = template.render(messages=[{"role": "user", "content": item.prompt}], add_generation_prompt=True)
        out[f"astrai_{item.task}"].append({"prompt": prompt, "answer": item.answer})
    return out


def spread(items: list[dict], limit: int, seed: int) -> list[dict]:
    """At most `limit` items, drawn at random but kept in corpus order (every play contributes its share)."""
    if len(items) <= limit:
        return items
    keep = sorted(random.Random(seed).sample(range(len(items)), limit))
    return [items[i] for i in keep]


def write_lm_eval_data(corpus_dir: Path, out_dir: Path, limit: int = 500, seed: int = 0,
                       names: Iterable[str] = tuple(FILES), force: bool = False) -> dict[str, int]:
    """Write the named tasks' files (FILES) into the folder out_dir from corpus_dir/test.jsonl (the held-out
    plays); -> items per task. The folder is written whole (a temporary folder renamed into place) and replaces
    only an earlier one of its own (astrai_core.runtime.io.check_output), or any with `force`; never the corpus."""
    output = dict(force=force, inputs=[corpus_dir], force_option="--force")
    check_output(out_dir, KIND, folder=True, **output)  # before any work
    plays = read_plays(Path(corpus_dir) / "test.jsonl")
    tasks = {"astrai_next_speaker": next_speaker_items(plays, seed), "astrai_speech_ppl": speech_items(plays),
             **family_tasks(plays, seed)}
    tasks = {task: spread(items, limit, seed) for task, items in tasks.items() if task in names}
    for task, items in tasks.items():
        if not items:
            raise AstraiError(f"{corpus_dir}/test.jsonl: no items for {task} (no plays with speakers in the test split?)")
    with atomic_path(out_dir, KIND, **output) as tmp:
        tmp.mkdir()
        for task, items in tasks.items():
            (tmp / FILES[task]).write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items),
                                           encoding="utf-8")
    return {task: len(items) for task, items in tasks.items()}
