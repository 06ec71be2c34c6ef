"""The demo's chat tasks: questions about a short passage of a play whose answer follows from the prompt alone.

A model of a million parameters trained for minutes cannot know facts about an unseen play, but it can learn to
read a prompt: count speeches or words, tell a question by its mark, copy a name or a word. Each task below has
one exactly checkable answer (`astrai_core/training/rewards.py: exact_answer`) and one plausible wrong answer,
which is what a DPO pair rejects:

    task            prompt (abridged)                                       answer       wrong answer
    first_speaker   Who speaks first in this passage?  + 2-4 speeches        ROMEO        the next speaker
    speech_count    How many speeches are in this passage? + 2-4 speeches    3            one more or fewer
    word_count      How many words are in this line? + one line              6            one more or fewer
    is_question     Does this line ask a question? + one line                yes          no (and vice versa)
    last_word       What is the last word of this line? + one line           night        the word before it

Copying a name or a word out of the prompt needs attention that looks a token up by its neighbour (an induction
head), which a 0.85M-parameter model pretrained on 2M tokens barely has: measured after 600 SFT steps, the last
word was right 31% of the time, the first speaker 8%, the last speaker 3% and three words reversed 2% (those two
were dropped), while counting speeches reached 89%. Counting and yes/no questions are learnable at the demo's
budget; the copying tasks stay near zero, and neither DPO nor GRPO has moved them (README, Measured).

A passage is 2-4 consecutive speeches of one scene, each cut to its first line (MAX_LINES). Every function is
deterministic in its random generator, so the chat_data stage writes the same records on every run.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable

from tasks.chat.plays import Speech

PASSAGE_SPEECHES = (2, 4)  # speeches per passage, inclusive
MAX_LINES = 1  # lines kept of each speech in a passage: short prompts, cheap to train and score
MAX_LINE_CHARS = 80  # a longer verse line is not used
_WORD = re.compile(r"[A-Za-z][a-z]*(?:'[a-z]+)?")  # a plain word: "night", "thou'rt", "Romeo"; not "O'er-" etc.


@dataclass(frozen=True)
class Item:
    task: str
    prompt: str
    answer: str
    wrong: str  # a plausible wrong answer: the rejected reply of a DPO pair

    def record(self, kind: str) -> dict:
        """The item as a chat_data record of `kind` (tasks/chat/records.py), with its task's name."""
        if kind == "sft":
            return {"messages": [{"role": "user", "content": self.prompt},
                                 {"role": "assistant", "content": self.answer}], "task": self.task}
        if kind == "dpo":
            return {"prompt": self.prompt, "chosen": self.answer, "rejected": self.wrong, "task": self.task}
        return {"prompt": self.prompt, "answer": self.answer, "options": [], "task": self.task}


def passage_text(speeches: list[Speech]) -> str:
    return "\n\n".join(f"{s.speaker}.\n" + "\n".join(s.lines[:MAX_LINES]) for s in speeches)


def _passage_question(question: str, speeches: list[Speech]) -> str:
    return f"{question}\n\n{passage_text(speeches)}"


def first_speaker(speeches: list[Speech], rng: random.Random) -> Item | None:
    others = [s.speaker for s in speeches[1:] if s.speaker != speeches[0].speaker]
    if not others:
        return None
    return Item("first_speaker", _passage_question("Who speaks first in this passage?", speeches),
                speeches[0].speaker, others[0])


def speech_count(speeches: list[Speech], rng: random.Random) -> Item:
    n = len(speeches)
    return Item("speech_count", _passage_question("How many speeches are in this passage?", speeches),
                str(n), str(n + rng.choice((-1, 1))))


def _words(line: str) -> list[str] | None:
    """The line's words without punctuation, or None if any piece of it is not a plain word."""
    pieces = [p.strip(".,;:!?-()\"") for p in line.split()]
    if not pieces or not all(_WORD.fullmatch(p) for p in pieces):
        return None
    return pieces


def _lines(speeches: list[Speech]) -> list[str]:
    """The passage's lines short enough to ask about."""
    return [ln for s in speeches for ln in s.lines[:MAX_LINES] if len(ln) <= MAX_LINE_CHARS]


def _verse_line(speeches: list[Speech], rng: random.Random) -> str | None:
    lines = _lines(speeches)
    return rng.choice(lines) if lines else None


def last_word(speeches: list[Speech], rng: random.Random) -> Item | None:
    line = _verse_line(speeches, rng)
    words = _words(line) if line else None
    if not words or len(words) < 3 or words[-1] == words[-2]:
        return None
    return Item("last_word", f"What is the last word of this line?\n{line}", words[-1], words[-2])


def word_count(speeches: list[Speech], rng: random.Random) -> Item | None:
    line = _verse_line(speeches, rng)
    words = _words(line) if line else None
    if not words:
        return None
    n = len(words)
    return Item("word_count", f"How many words are in this line?\n{line}", str(n), str(n + rng.choice((-1, 1))))


def is_question(speeches: list[Speech], rng: random.Random) -> Item | None:
    """Half the items ask about a line that ends with a question mark (when the passage has one)."""
    lines = _lines(speeches)
    want = rng.random() < 0.5
    lines = [ln for ln in lines if ln.rstrip().endswith("?") == want]
    if not lines:
        return None
    answer = "yes" if want else "no"
    return Item("is_question", f"Does this line ask a question?\n{rng.choice(lines)}", answer,
                "no" if want else "yes")


TASKS: dict[str, Callable[[list[Speech], random.Random], Item | None]] = {
    "first_speaker": first_speaker, "speech_count": speech_count, "word_count": word_count,
    "is_question": is_question, "last_word": last_word}


def passages(plays: dict[str, list[Speech]], rng: random.Random) -> list[list[Speech]]:
    """Every run of consecutive speeches of one scene, starting at each speech, of a random length in
    PASSAGE_SPEECHES (shorter runs at a scene's end are left out), in a shuffled order."""
    out = []
    for speeches in plays.values():
        for k in range(len(speeches)):
            n = rng.randint(*PASSAGE_SPEECHES)
            run = speeches[k:k + n]
            if len(run) == n and all(a.scene == b.scene and a.pos + 1 == b.pos for a, b in zip(run, run[1:])):
                out.append(run)
    rng.shuffle(out)
    return out


def items(plays: dict[str, list[Speech]], seed: str, exclude: set[str] = frozenset()) -> list[Item]:
    """The tasks' items of a split, the tasks taking turns (so any prefix is balanced across them), each prompt at
    most once and none of `exclude` (the other split's prompts: a held-out item never appears in training)."""
    rng = random.Random(seed)
    seen = set(exclude)
    per_task: dict[str, list[Item]] = {name: [] for name in TASKS}
    for run in passages(plays, rng):
        for name, fn in TASKS.items():
            item = fn(run, rng)
            if item is not None and item.prompt not in seen:
                seen.add(item.prompt)
                per_task[name].append(item)
    out = []
    for group in zip(*per_task.values()):  # round robin, as long as every task has items left
        out.extend(group)
    return out
