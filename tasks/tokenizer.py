"""Tokenizer stage: data/corpus/train.jsonl -> data/tokenizer/tokenizer.json (byte-level BPE) + chat_template.jinja.

Trained on the train split only, so validation and test text never shapes the vocabulary.

Run alone: `astrai stage tokenizer` (what dvc.yaml runs; paths in tasks/stages.py), or call the
function above from Python.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from astrai_core.chat import DEFAULT_TEMPLATE, TEMPLATE_FILE
from astrai_core.errors import AstraiError
from astrai_core.io import atomic_path
from astrai_core.tokenizer import train_tokenizer
from tasks.params import TokenizerParams


def build_tokenizer(params: TokenizerParams, corpus_dir: Path, out_dir: Path) -> Path:
    """Train on corpus_dir/train.jsonl and write out_dir/tokenizer.json (all or nothing); return its path."""
    train_file = Path(corpus_dir) / "train.jsonl"
    if not train_file.is_file():
        raise AstraiError(f"{train_file}: not found; run the corpus stage first")
    tok = train_tokenizer(iter_texts(train_file), params.vocab_size, params.min_frequency)
    out_dir = Path(out_dir)
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / TEMPLATE_FILE).write_text(DEFAULT_TEMPLATE)  # the chat format travels with the tokenizer
    return out_dir / "tokenizer.json"


def iter_texts(jsonl: Path) -> Iterator[str]:
    """The `text` of each line of a corpus split, one at a time (the corpus stage wrote and validated it)."""
    with open(jsonl, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            try:
                yield json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise AstraiError(f"{jsonl}:{lineno}: not a corpus line (expected {{\"id\", \"text\"}}); re-run the corpus stage") from None
