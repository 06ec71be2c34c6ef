"""Tokenizer stage: data/corpus/train.jsonl -> data/tokenizer/tokenizer.json (byte-level BPE) + chat_template.jinja.

Trained on the train split only, so validation and test text never shapes the vocabulary. A long document is
fed to the trainer in pieces of at most PIECE_CHARACTERS, cut before a space as the pack stage cuts them
(astrai_core.tokenizer.bpe.piece_bounds): the pre-tokenizer splits there anyway, so the trainer counts the same words
and learns the same vocabulary and merges, while its memory follows the piece, not the longest line (a 20 MB
single-line document held 2.16 GB; bench/tokenizer_memory.py). With
`tokenizer.source: PATH` (a checkpoint directory, e.g. `astrai import-hf`'s, or a tokenizer.json) the stage
copies that tokenizer byte for byte instead, so `pretrain.init_from` that checkpoint accepts the packed data.

Run alone: `astrai stage tokenizer` (what dvc.yaml runs; paths in tasks/run/table.py), or call the
function above from Python.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterable, Iterator

from astrai_core.runtime.errors import AstraiError
from astrai_core.runtime.io import atomic_path
from astrai_core.runtime.progress import advance, expect
from astrai_core.tokenizer.bpe import SPECIALS_FILE, load_tokenizer, piece_bounds, train_tokenizer
from astrai_core.tokenizer.chat import DEFAULT_TEMPLATE, TEMPLATE_FILE, load_chat
from tasks.run.schema import TokenizerParams


def build_tokenizer(params: TokenizerParams, corpus_dir: Path, out_dir: Path) -> Path:
    """Train on corpus_dir/train.jsonl (or copy tokenizer.source) and write out_dir/tokenizer.json (all or
    nothing); return its path."""
    if params.source != "train":
        return copy_tokenizer(params.source, Path(out_dir))
    train_file = Path(corpus_dir) / "train.jsonl"
    if not train_file.is_file():
        raise AstraiError(f"{train_file}: not found; run the corpus stage first")
    expect(corpus_documents(Path(corpus_dir), "train"), "training documents read (then the merges)")
    tok = train_tokenizer(pieces(iter_texts(train_file), PIECE_CHARACTERS), params.vocab_size, params.min_frequency)
    out_dir = Path(out_dir)
    with atomic_path(out_dir, "stage tokenizer") as tmp:
        tmp.mkdir()
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / TEMPLATE_FILE).write_text(DEFAULT_TEMPLATE)  # the chat format travels with the tokenizer
    return out_dir / "tokenizer.json"


def copy_tokenizer(source: str, out_dir: Path) -> Path:
    """Copy tokenizer.source (a checkpoint directory's tokenizer.json, or a tokenizer.json) and the
    chat_template.jinja beside it (else the default template) into out_dir; return the tokenizer's path."""
    src = Path(source)
    path = src / "tokenizer.json" if src.is_dir() else src
    if not path.is_file():
        raise AstraiError(f"tokenizer.source: {path} not found (expected \"train\", a checkpoint directory or a "
                          "tokenizer.json)")
    try:
        load_chat(path)  # the stages need special tokens (astrai's or the model's own) and a valid chat template
    except AstraiError as e:
        why = str(e).removesuffix("; re-run the tokenizer stage")
        raise AstraiError(f"tokenizer.source: {why} (`astrai import-hf` adds the special tokens to a Hugging Face "
                          "model's tokenizer)") from None
    template = path.with_name(TEMPLATE_FILE)
    with atomic_path(out_dir, "stage tokenizer") as tmp:
        tmp.mkdir()
        shutil.copyfile(path, tmp / "tokenizer.json")  # byte for byte: init_from compares the sha256
        if template.is_file():
            shutil.copyfile(template, tmp / TEMPLATE_FILE)
        else:
            (tmp / TEMPLATE_FILE).write_text(DEFAULT_TEMPLATE)
        # a model's own special tokens (astrai_core/tokenizer/bpe.py)
        if (own := path.with_name(SPECIALS_FILE)).is_file():
            shutil.copyfile(own, tmp / SPECIALS_FILE)
    return out_dir / "tokenizer.json"


def check_vocab_size(tokenizer_path: Path, model_vocab_size: int) -> None:
    """model.vocab_size must cover the tokenizer's ids; params.yaml checks it against tokenizer.vocab_size, but a
    copied tokenizer's (tokenizer.source) size is known only here."""
    size = load_tokenizer(tokenizer_path).get_vocab_size()
    if model_vocab_size < size:
        raise AstraiError(f"params.yaml: model.vocab_size ({model_vocab_size}) must be >= the size of the tokenizer "
                          f"{tokenizer_path} ({size})")


# Characters the trainer gets at once, at most. The trainer pre-tokenizes each text it is given whole (~100 bytes
# per character of it, measured) and takes them in batches, so this bounds its memory; documents up to this size,
# most of a usual corpus, go in as they are.
PIECE_CHARACTERS = 100_000


def pieces(texts: Iterable[str], max_chars: int) -> Iterator[str]:
    """Each text in pieces of at most max_chars characters, cut where the byte-level pre-tokenizer splits anyway
    (piece_bounds); a text that fits is the string itself."""
    for text in texts:
        bounds = piece_bounds(text, max_chars)
        for a, b in zip(bounds, bounds[1:]):
            yield text[a:b]


def iter_texts(jsonl: Path) -> Iterator[str]:
    """The `text` of each line of a corpus split, one at a time (the corpus stage wrote and validated it), each
    counted as one document read by the stage's Progress."""
    with open(jsonl, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            try:
                text = json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise AstraiError(f"{jsonl}:{lineno}: not a corpus line (expected {{\"id\", \"text\"}}); re-run the corpus stage") from None
            yield text
            advance()


def corpus_documents(corpus_dir: Path, split: str) -> int | None:
    """How many documents the corpus stage wrote to `split` (its manifest.json), None when it does not say."""
    try:
        return int(json.loads((corpus_dir / "manifest.json").read_text())["splits"][split]["documents"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
