"""The corpus's plays as speeches: who speaks which lines, scene by scene (what the demo chat records are made of).

parse_play reads one Project Gutenberg play (a speaker's name alone on a line in capitals, then the speech; act
and scene headings; stage directions in brackets dropped); read_plays reads a corpus split (data/corpus/*.jsonl).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from astrai_core.runtime.errors import AstraiError

MIN_SPEAKER_SPEECHES = 2  # a "name" heading a single block is a title, "THE END." or a misparse, not a speaker

_HEADING = re.compile(r"(ACT|Act|SCENE|Scene|PROLOGUE|Prologue|EPILOGUE|Epilogue|INDUCTION|Induction)\b")
_DIRECTION = re.compile(r"[\[{][^\]\[{]*\]")  # [Aside.], multi-line [Exeunt ...], and the edition's odd {Aside.]
_NAME_WORD = re.compile(r"[A-Z0-9][A-Za-z'\-]*\.?|and|AND|of|de|the")


@dataclass(frozen=True)
class Speech:
    play: str
    scene: int  # consecutive speeches of one scene form a dialogue
    pos: int  # index among every speech line parsed in the play, before rare names are dropped
    speaker: str  # as the edition writes it, without the final period: "HAMLET", "FIRST LORD", "Ham"
    lines: tuple[str, ...]  # stage directions removed


def speaker_name(line: str) -> str | None:
    """The name of a speaker line ("KING HENRY.", "Ham.", "QUINCE", "FIRST LORD. [Aside.]"), else None."""
    s = _DIRECTION.sub("", line).strip()
    if not s or line[:1].isspace() or len(s) > 40 or _HEADING.match(s):
        return None
    if s.endswith("."):
        name = s[:-1].rstrip()
    elif s == s.upper():  # one edition (A Midsummer Night's Dream) writes speakers without the period
        name = s
    else:
        return None
    words = name.split()
    if not 1 <= len(words) <= 5 or not all(_NAME_WORD.fullmatch(w) for w in words):
        return None
    if not re.search(r"[A-Za-z]", name) or re.fullmatch(r"[IVXLC]+", name):  # "II." numbers a song or a poem
        return None
    return name


def parse_play(play: str, text: str) -> list[Speech]:
    """The speeches of a Gutenberg play: a speaker line after a blank line, then the speech up to the next blank
    line (a stage-direction block between the two is skipped). Poems have no speaker lines and give nothing."""
    lines = text.replace("\r\n", "\n").split("\n")
    found: list[tuple[int, str, list[str]]] = []
    scene = 0
    for i in range(1, len(lines) - 1):
        if lines[i - 1].strip():
            continue
        if _HEADING.match(lines[i].strip()):
            scene += 1
            continue
        name = speaker_name(lines[i])
        if name is None:
            continue
        body = _body(lines, i + 1)
        if body:
            found.append((scene, name, body))
    counts = Counter(name for _, name, _ in found)
    # Before the first ACT/SCENE heading come the title and the Dramatis Personae, where "KING JOHN" followed by
    # the rest of the list parses like a speech; a play without headings keeps everything.
    first_scene = 1 if scene > 0 else 0
    return [Speech(play, sc, pos, name, tuple(body)) for pos, (sc, name, body) in enumerate(found)
            if counts[name] >= MIN_SPEAKER_SPEECHES and sc >= first_scene]


def _body(lines: list[str], j: int) -> list[str] | None:
    """The speech starting at line j: its block, or the block after one blank-separated stage direction."""
    if j < len(lines) and not lines[j].strip():
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j >= len(lines) or not lines[j].lstrip().startswith("["):
            return None
        while j < len(lines) and lines[j].strip():  # the direction block
            j += 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j >= len(lines) or speaker_name(lines[j]) or _HEADING.match(lines[j].strip()):
            return None
    block = []
    while j < len(lines) and lines[j].strip():
        block.append(lines[j])
        j += 1
    text = _DIRECTION.sub("", "\n".join(block))
    if "[" in text or "]" in text:
        return None  # a direction that does not close inside the block: not safe to cut
    body = [ln.strip() for ln in text.split("\n") if ln.strip()]
    return body or None


def read_plays(path: Path) -> dict[str, list[Speech]]:
    """{document id: its speeches} of one split file of the corpus stage, in file order."""
    if not path.is_file():
        raise AstraiError(f"{path}: not found (run the corpus stage first)")
    plays = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
                doc_id, text = str(doc["id"]), doc["text"]
            except (json.JSONDecodeError, KeyError, TypeError):
                doc_id, text = None, None
            if not isinstance(text, str):
                raise AstraiError(f"{path}:{lineno}: not a corpus record {{'id': ..., 'text': str}}")
            plays[doc_id] = parse_play(doc_id, text)
    return plays


