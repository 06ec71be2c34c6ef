"""Chat data stage: data/corpus -> data/chat/{sft,dpo,grpo}_{train,test}.jsonl + stats.json.

Each kind (`chat_data.sft`, `.dpo`, `.grpo` in params.yaml) is either "demo", derived from the plays without any
download, or the path of the user's own JSONL file, read and validated here.

Demo records come from the speeches of the corpus stage's plays: train records from the `train` split's plays,
test records from the `test` split's plays (the `validation` plays are left alone), so no play feeds both and the
test files are truly held out. Kinds:

* SFT: a mix of the multiple-choice question below answered with the right name (a third) and "continue the
  scene" (the previous 1-2 speeches, then the next speech as the assistant's reply).
* DPO: prompt "Continue the scene:\\n" + the previous speech(es); chosen = the true next speech; rejected = a
  speech of similar length (within 30% characters) from another play of the same split, attributed to the same
  speaker, so only the content differs.
* GRPO: 'Which of these characters says: "<first sentence of a speech>"?\\nA, B, C' with the exact name as answer;
  the options are the answer and n_options - 1 other speakers of the play with at least 5 speeches.

Record formats (the contract with the training code; every record is validated by `check_record`):

    sft:  {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}
    dpo:  {"prompt": str, "chosen": str, "rejected": str}
    grpo: {"prompt": str, "answer": str, "options": [str, ...]}     (options [] when a user file gives none)

A user file may also hold SFT records as {"prompt", "response"}: they become a user and an assistant message.
Its records are split by `test_fraction` (chosen by seed). Everything is deterministic in the seed: two runs write
the same bytes.

The plays' parsing is tasks/plays.py, the records' schema and validation tasks/chat_records.py; this module
derives the demo records and writes the files. Run alone: `astrai stage chat_data`, or from Python:
    build_chat_data(ChatDataParams(), Path("data/corpus"), Path("data/chat"))
"""

from __future__ import annotations

import bisect
import json
import random
import re
from collections import Counter
from pathlib import Path
from typing import Iterator

from astrai_core.errors import AstraiError
from astrai_core.io import atomic_path
from tasks.chat_records import (KINDS, TURN_CHARS, check_record, choice_question, continue_prompt, format_speech,
                                read_records, rendered_chars)
from tasks.params import DEMO, ChatDataParams
from tasks.plays import MAX_SPEECH_CHARS, MAX_SPEECH_LINES, Speech, read_plays

MIN_OPTION_SPEECHES = 5  # GRPO names (the answer and the distractors) are characters with at least this many
SFT_QUESTION_SHARE = 1 / 2
LENGTH_TOLERANCE = 0.3  # a rejected speech is within 30% of the chosen one's characters
QUOTE_CHARS = (20, 100)  # a quoted line long enough to tell speakers apart, short enough for one prompt line
_GROUPS = {"ALL", "BOTH"}  # speak together: not an answer to "which character says"


def _capped(lines: tuple[str, ...], tail: bool = False) -> list[str] | None:
    """At most MAX_SPEECH_LINES whole lines and MAX_SPEECH_CHARS characters, from the start (or the end)."""
    seq = list(reversed(lines)) if tail else list(lines)
    out, size = [], -1
    for line in seq[:MAX_SPEECH_LINES]:
        if size + 1 + len(line) > MAX_SPEECH_CHARS:
            break
        out.append(line)
        size += 1 + len(line)
    if not out:
        return None
    return list(reversed(out)) if tail else out


# --- speeches -> records --------------------------------------------------------------------------------------------


class _Derivation:
    """The demo records of one split. Each speech position feeds at most one record (DPO before SFT, GRPO before
    SFT's questions), so no GRPO prompt is answered in the SFT data and no DPO pair repeats an SFT example."""

    def __init__(self, plays: dict[str, list[Speech]], params: ChatDataParams, split: str) -> None:
        self.p = params
        self.rng = random.Random(f"{params.seed}:chat_data:{split}")  # str seeds hash with sha512: stable
        self.skipped: dict[str, Counter] = {kind: Counter() for kind in KINDS}
        self.multi_play = sum(1 for s in plays.values() if s) > 1

        # "continue the scene": every speech that follows another of the same scene
        self.follows: list[tuple[list[Speech], int]] = []
        for speeches in plays.values():
            for k in range(1, len(speeches)):
                if self._adjacent(speeches[k - 1], speeches[k]):
                    self.follows.append((speeches, k))
        self.rng.shuffle(self.follows)

        # rejected replies: every speech in a list sorted by length, for a bisect on the +-30% window
        pool = []
        for speeches in plays.values():
            for s in speeches:
                head = _capped(s.lines)
                if head:
                    pool.append((len("\n".join(head)), s.play, s.scene, head))
        pool.sort()
        self.pool, self.pool_len = pool, [x[0] for x in pool]

        # questions: the first sentence of a speech by a major character, said by nobody else in the play
        self.questions: list[tuple[Speech, str, list[str]]] = []
        for speeches in plays.values():
            counts = Counter(s.speaker for s in speeches)
            major = [n for n in dict.fromkeys(s.speaker for s in speeches)  # first-appearance order: stable
                     if counts[n] >= MIN_OPTION_SPEECHES and n.upper() not in _GROUPS and " and " not in n.lower()]
            if len(major) < params.n_options:
                continue
            firsts = Counter(_quote(s) for s in speeches)
            for s in speeches:
                q = _quote(s)
                if s.speaker in major and firsts[q] == 1 and QUOTE_CHARS[0] <= len(q) <= QUOTE_CHARS[1]:
                    self.questions.append((s, q, major))
        self.rng.shuffle(self.questions)
        self._next_follow = self._next_question = 0

    @staticmethod
    def _adjacent(a: Speech, b: Speech) -> bool:
        return a.scene == b.scene and a.pos + 1 == b.pos

    def _fits(self, record: dict, kind: str) -> bool:
        if rendered_chars(record, kind) > self.p.max_chars:
            self.skipped[kind]["longer than max_chars"] += 1
            return False
        return True

    def _continuation(self, kind: str) -> Iterator[tuple[str, Speech, list[str]]]:
        """(prompt, the next speech, its capped lines): the prompt holds the previous 1 or 2 speeches."""
        while self._next_follow < len(self.follows):
            speeches, k = self.follows[self._next_follow]
            self._next_follow += 1
            nxt = speeches[k]
            head = _capped(nxt.lines)
            if head is None:
                self.skipped[kind]["speech line longer than the cap"] += 1
                continue
            # the previous speech, and half the time the one before it too (oldest first)
            context = [speeches[k - 1]]
            if k >= 2 and self._adjacent(speeches[k - 2], speeches[k - 1]) and self.rng.random() < 0.5:
                context.insert(0, speeches[k - 2])
            prompt = self._prompt(context, len(format_speech(nxt.speaker, head)))
            if prompt is None:
                self.skipped[kind]["longer than max_chars"] += 1
                continue
            yield prompt, nxt, head

    def _prompt(self, context: list[Speech], reply_chars: int) -> str | None:
        """The continue-the-scene prompt of the most recent speeches that fit beside a reply of reply_chars."""
        for n in range(len(context), 0, -1):
            speeches = [(s.speaker, _capped(s.lines, tail=True)) for s in context[-n:]]  # a speech's end leads on
            if any(tail is None for _, tail in speeches):
                continue
            prompt = continue_prompt([format_speech(name, tail) for name, tail in speeches])
            if len(prompt) + reply_chars + 2 * TURN_CHARS <= self.p.max_chars:
                return prompt
        return None

    def sft_continue(self) -> Iterator[dict]:
        for prompt, nxt, head in self._continuation("sft"):
            yield {"messages": [{"role": "user", "content": prompt},
                                {"role": "assistant", "content": format_speech(nxt.speaker, head)}]}

    def dpo(self) -> Iterator[dict]:
        for prompt, nxt, head in self._continuation("dpo"):
            rejected = self._rejected(nxt, head)
            if rejected is None:
                self.skipped["dpo"]["no speech of similar length in another play"] += 1
                continue
            record = {"prompt": prompt, "chosen": format_speech(nxt.speaker, head),
                      "rejected": format_speech(nxt.speaker, rejected)}
            if self._fits(record, "dpo"):
                yield record

    def _rejected(self, chosen: Speech, head: list[str]) -> list[str] | None:
        n = len("\n".join(head))
        lo = bisect.bisect_left(self.pool_len, n * (1 - LENGTH_TOLERANCE))
        hi = bisect.bisect_right(self.pool_len, n * (1 + LENGTH_TOLERANCE))
        for _ in range(32 if hi > lo else 0):
            _, play, scene, lines = self.pool[self.rng.randrange(lo, hi)]
            # another play; a corpus whose split holds one play falls back to another scene of it
            other = play != chosen.play if self.multi_play else scene != chosen.scene
            if other and lines != head:
                return lines
        return None

    def _question_records(self) -> Iterator[tuple[str, str, list[str]]]:
        while self._next_question < len(self.questions):
            s, quote, major = self.questions[self._next_question]
            self._next_question += 1
            others = self.rng.sample([n for n in major if n != s.speaker], self.p.n_options - 1)
            options = others + [s.speaker]
            self.rng.shuffle(options)
            yield choice_question(quote, options), s.speaker, options

    def grpo(self) -> Iterator[dict]:
        for prompt, answer, options in self._question_records():
            record = {"prompt": prompt, "answer": answer, "options": options}
            if self._fits(record, "grpo"):
                yield record

    def sft_questions(self) -> Iterator[dict]:
        for prompt, answer, _ in self._question_records():
            record = {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}
            if self._fits(record, "sft"):
                yield record


_SENTENCE = re.compile(r"(.+?[.!?;:])(?=\s|--|$)")


def _quote(s: Speech) -> str:
    """The speech's first sentence (or clause up to ; or :), quoted without its closing , ; : or dash."""
    m = _SENTENCE.match(" ".join(s.lines))
    return m.group(1).rstrip(" ,;:-") if m else ""


def _take(records: Iterator[dict], n: int) -> list[dict]:
    out: list[dict] = []
    if n > 0:
        for record in records:  # stop right after the n-th: the generator's cursor stays on the next position
            out.append(record)
            if len(out) == n:
                break
    return out


def derive_demo(plays: dict[str, list[Speech]], params: ChatDataParams, split: str,
                sizes: dict[str, int], kinds: tuple[str, ...]) -> tuple[dict[str, list[dict]], dict[str, Counter]]:
    """Records of the demo kinds for one split: {kind: records}, {kind: Counter of skip reasons}."""
    d = _Derivation(plays, params, split)
    out: dict[str, list[dict]] = {}
    if "dpo" in kinds:
        out["dpo"] = _take(d.dpo(), sizes["dpo"])
    if "grpo" in kinds:
        out["grpo"] = _take(d.grpo(), sizes["grpo"])
    if "sft" in kinds:
        n_questions = round(sizes["sft"] * SFT_QUESTION_SHARE)
        sft = _take(d.sft_questions(), n_questions)
        sft += _take(d.sft_continue(), sizes["sft"] - len(sft))
        d.rng.shuffle(sft)
        out["sft"] = sft
    for kind, records in out.items():
        for record in records:  # the derivation keeps the contract: an invariant, not user input
            assert check_record(record, kind, params.max_chars)[1] is None, (kind, record)
    return out, d.skipped


# --- the stage ------------------------------------------------------------------------------------------------------


def split_records(records: list[dict], test_fraction: float, seed: int, kind: str) -> tuple[list[dict], list[dict]]:
    """(train, test) of a user file: test_fraction of the records (at least one when there are two or more and the
    fraction is not 0, never all of them), chosen by seed; both keep the file's order."""
    n = len(records)
    k = round(n * test_fraction)
    if test_fraction > 0 and n >= 2:
        k = max(k, 1)
    k = min(k, n - 1)
    test = set(random.Random(f"{seed}:chat_data:{kind}:split").sample(range(n), k))
    return [r for i, r in enumerate(records) if i not in test], [r for i, r in enumerate(records) if i in test]


def build_chat_data(params: ChatDataParams, corpus_dir: Path, out_dir: Path) -> dict:
    """Write out_dir/{sft,dpo,grpo}_{train,test}.jsonl and stats.json (all or nothing); return the stats."""
    corpus_dir, out_dir = Path(corpus_dir), Path(out_dir)
    data: dict[str, dict[str, list[dict]]] = {"train": {}, "test": {}}
    stats: dict = {"seed": params.seed, "max_chars": params.max_chars, "sources": {}, "skipped": {}}

    for kind in KINDS:  # user files first: a missing one fails before the plays are parsed
        source = getattr(params, kind)
        if source == DEMO:
            continue
        path = Path(source).expanduser()
        if not path.is_file():
            raise AstraiError(f"chat_data.{kind}: {source}: file not found (expected 'demo' or a JSONL file)")
        records, problems = read_records(path, kind, params.on_bad_record, params.max_chars)
        data["train"][kind], data["test"][kind] = split_records(records, params.test_fraction, params.seed, kind)
        stats["sources"][kind] = str(path)
        stats["skipped"][kind] = {"count": len(problems), "problems": problems[:100]}

    demo = tuple(k for k in KINDS if getattr(params, k) == DEMO)
    if demo:
        sizes = {"train": {"sft": params.sft_examples, "dpo": params.dpo_pairs, "grpo": params.grpo_prompts},
                 "test": {k: params.test_examples for k in KINDS}}
        stats["plays"] = {}
        skipped = {k: Counter() for k in demo}
        for split in ("train", "test"):
            plays = read_plays(corpus_dir / f"{split}.jsonl")
            stats["plays"][split] = {doc_id: len(speeches) for doc_id, speeches in plays.items()}
            if not any(plays.values()):
                raise AstraiError(f"{corpus_dir / f'{split}.jsonl'}: no play with speeches in the corpus's {split} "
                                  f"split to derive the demo {'/'.join(demo)} data from; set chat_data.{demo[0]} "
                                  "to a JSONL file")
            records, reasons = derive_demo(plays, params, split, sizes[split], demo)
            for kind in demo:
                if not records[kind]:
                    raise AstraiError(f"{corpus_dir}: no demo {kind} records could be derived from the {split} "
                                      f"plays ({dict(reasons[kind]) or 'too few speeches'})")
                data[split][kind] = records[kind]
                skipped[kind] += reasons[kind]
        for kind in demo:
            stats["sources"][kind] = (f"demo: the speeches of the train/test plays of {corpus_dir} "
                                      f"({len(stats['plays']['train'])}/{len(stats['plays']['test'])} documents)")
            stats["skipped"][kind] = {"count": sum(skipped[kind].values()),
                                      "reasons": dict(sorted(skipped[kind].items()))}

    stats["files"] = {}
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        for kind in KINDS:
            for split in ("train", "test"):
                name = f"{kind}_{split}.jsonl"
                with open(tmp / name, "w", encoding="utf-8") as f:
                    for record in data[split][kind]:
                        f.write(json.dumps(record, ensure_ascii=False) + "\n")
                stats["files"][name] = len(data[split][kind])
        (tmp / "stats.json").write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n")
    return stats
