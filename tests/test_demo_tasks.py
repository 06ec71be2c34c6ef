"""The demo's chat tasks (tasks/chat/demo_tasks.py): each answer is right, each wrong answer is wrong, and the items
of a split are balanced, unique and deterministic."""

from __future__ import annotations

import random

from astrai_core.training.rewards import exact_answer
from tasks.chat.demo_tasks import TASKS, Item, items, passage_text, passages
from tasks.chat.plays import Speech


def speech(pos: int, speaker: str, *lines: str, scene: int = 1, play: str = "p") -> Speech:
    return Speech(play, scene, pos, speaker, tuple(lines))


PASSAGE = [speech(0, "ROMEO", "But soft, what light through yonder window breaks?", "It is the east."),
           speech(1, "JULIET", "Ay me!"),
           speech(2, "ROMEO", "She speaks.", "O, speak again, bright angel!", "A third line is cut."),
           speech(3, "NURSE", "Madam!")]


def ask(task: str, passage=PASSAGE, seed: int = 0) -> Item:
    item = TASKS[task](passage, random.Random(seed))
    assert item is not None and item.task == task
    assert exact_answer(f" {item.answer}\n", item.record("grpo")) == 1.0
    assert exact_answer(item.wrong, item.record("grpo")) == 0.0
    return item


def test_passage_text_keeps_the_first_line_of_each_speech():
    assert passage_text(PASSAGE[1:3]) == "JULIET.\nAy me!\n\nROMEO.\nShe speaks."


def test_first_speaker():
    first = ask("first_speaker")
    assert first.prompt == "Who speaks first in this passage?\n\n" + passage_text(PASSAGE)
    assert (first.answer, first.wrong) == ("ROMEO", "JULIET")
    # one speaker all through: nothing to tell apart, no item
    alone = [speech(0, "HAMLET", "To be."), speech(1, "HAMLET", "Or not.")]
    assert TASKS["first_speaker"](alone, random.Random(0)) is None


def test_speech_count():
    for n in (2, 3, 4):
        item = ask("speech_count", PASSAGE[:n], seed=n)
        assert item.answer == str(n) and item.wrong in {str(n - 1), str(n + 1)}
        assert item.prompt == "How many speeches are in this passage?\n\n" + passage_text(PASSAGE[:n])


def test_last_word_and_word_count():
    passage = [speech(0, "ROMEO", "O, speak again, bright angel!")]
    item = ask("last_word", passage)
    assert item.prompt == "What is the last word of this line?\nO, speak again, bright angel!"
    assert (item.answer, item.wrong) == ("angel", "bright")
    item = ask("word_count", passage)
    assert item.prompt == "How many words are in this line?\nO, speak again, bright angel!"
    assert item.answer == "5" and item.wrong in {"4", "6"}
    # a line with anything but plain words (a number, a dash-joined compound) gives no item
    for line in ("Enter 2 Murderers, quickly", "O'er-leaps itself and falls"):
        assert TASKS["last_word"]([speech(0, "A", line)], random.Random(0)) is None
        assert TASKS["word_count"]([speech(0, "A", line)], random.Random(0)) is None


def test_is_question_is_balanced_and_right():
    passage = [speech(0, "A", "What light through yonder window breaks?"), speech(1, "B", "It is the east.")]
    answers = []
    for seed in range(40):
        item = TASKS["is_question"](passage, random.Random(seed))
        line = item.prompt.split("\n")[1]
        assert item.answer == ("yes" if line.endswith("?") else "no") and item.wrong != item.answer
        answers.append(item.answer)
    assert 10 < answers.count("yes") < 30  # about half and half: "no" alone is not a good score


def test_passages_stay_in_one_scene():
    plays = {"p": [speech(i, "AB"[i % 2], f"line {i}", scene=1 + i // 5) for i in range(10)]}
    runs = passages(plays, random.Random(0))
    assert runs and all(2 <= len(r) <= 4 for r in runs)
    assert all(len({s.scene for s in r}) == 1 for r in runs)
    assert all(b.pos == a.pos + 1 for r in runs for a, b in zip(r, r[1:]))


def test_items_are_balanced_unique_and_deterministic():
    words = "the king doth wake tonight and all his court is merry with the wine".split()
    plays = {"p": [speech(i, ["ANNE", "BEN", "CLEO"][i % 3], " ".join(words[i % 7:i % 7 + 5]).capitalize() + ".",
                          scene=1 + i // 12) for i in range(60)]}
    out = items(plays, "seed")
    assert out == items(plays, "seed") and out != items(plays, "other")
    assert [i.task for i in out[:len(TASKS)]] == list(TASKS)  # the tasks take turns
    prompts = [i.prompt for i in out]
    assert len(set(prompts)) == len(prompts)
    held_out = items(plays, "test", exclude=set(prompts))
    assert held_out == []  # the same play again: every prompt is excluded
