"""Byte-level BPE tokenizer (the `tokenizers` library), the GPT-2/Llama-3 recipe.

Text is mapped to bytes before merging, and all 256 bytes are in the initial alphabet, so any UTF-8 string
(Chinese, emoji, leading spaces, newlines) encodes without an unknown token and decodes back exactly.
The special tokens take ids 0..6 in the order of SPECIAL_TOKENS, so they are the same for every vocabulary size.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from astrai_core.runtime.errors import AstraiError

SPECIAL_TOKENS = {
    "bos": "<|begin_of_text|>",
    "eos": "<|end_of_text|>",
    "pad": "<|pad|>",
    "system": "<|system|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
    "end_of_turn": "<|end_of_turn|>",
}


MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256  # every special token and every byte has an id


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """Train on `texts` (any iterable: streamed, never held in memory at once by this function)."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise AstraiError(f"tokenizer vocab_size {vocab_size} is too small: it needs at least {MIN_VOCAB_SIZE} "
                          "(7 special + 256 bytes)")
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: a leading space stays a real character, so decode(encode(s)) == s exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS.values()),  # the trainer assigns these ids 0..6 first
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte has an id even if unseen in training
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def read_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A tokenizer.json as it is (no special tokens required); AstraiError naming the file if it is not one."""
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises a bare Exception with a multi-line serde message
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise AstraiError(f"{path}: not a valid tokenizer file ({first})") from None


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A tokenizer the stages can use: a model's own with its special_tokens.json beside it (an imported model that
    brings a chat template keeps its tokenizer as it is), or one with astrai's special tokens."""
    path = Path(path)
    if not path.is_file():
        raise AstraiError(f"{path}: tokenizer file not found; run the tokenizer stage")
    tok = read_tokenizer(path)
    specials(tok, path)  # a model's own: each of its tokens is in the vocabulary
    if not path.with_name(SPECIALS_FILE).is_file():
        for name, text in SPECIAL_TOKENS.items():
            if tok.token_to_id(text) is None:
                raise AstraiError(f"{path}: tokenizer lacks the special token {text} ({name}); re-run the tokenizer "
                                  "stage")
    return tok


# A model's own special tokens, beside its tokenizer.json: what `astrai import-hf` writes for a model that brings its
# chat template (from its generation_config.json, config.json and tokenizer_config.json, or the GGUF's metadata), so
# that it stops where it stops and nothing is added to its vocabulary:
#     {"bos": "<|im_start|>", "eos": "<|im_end|>", "pad": "<|im_end|>", "stop": ["<|im_end|>"]}
SPECIALS_FILE = "special_tokens.json"


@dataclass(frozen=True)
class Specials:
    """The token ids generation, packing and export need, whichever tokenizer it is."""

    eos: int  # ends a document in packed data, and a plain-text completion
    pad: int
    stop: tuple[int, ...]  # any of these ends a reply (chat) or a completion: the end of turn and eos
    bos: int | None = None


def specials(tok: Tokenizer, path: str | os.PathLike | None = None) -> Specials:
    """The special ids of `tok`: from the special_tokens.json beside its file `path` if there is one (a model's
    own), else astrai's SPECIAL_TOKENS. AstraiError naming the file for a token the vocabulary lacks."""
    own = Path(path).with_name(SPECIALS_FILE) if path is not None else None
    if own is None or not own.is_file():
        ids = {name: tok.token_to_id(text) for name, text in SPECIAL_TOKENS.items()}
        return Specials(eos=ids["eos"], pad=ids["pad"], stop=(ids["end_of_turn"], ids["eos"]), bos=ids["bos"])
    try:
        spec = json.loads(own.read_text(encoding="utf-8"))
        texts = {"bos": spec.get("bos"), "eos": spec["eos"], "pad": spec.get("pad") or spec["eos"],
                 "stop": list(spec.get("stop") or [spec["eos"]])}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise AstraiError(f"{own}: expected {{\"eos\": TOKEN, \"stop\": [TOKEN, ...], \"bos\": ..., \"pad\": ...}} "
                          f"({type(e).__name__}: {e})") from None

    def id_of(key: str, text: str) -> int:
        i = tok.token_to_id(text) if isinstance(text, str) else None
        if i is None:
            raise AstraiError(f"{own}: {key} {text!r} is not a token of {Path(path).name}")
        return i

    return Specials(eos=id_of("eos", texts["eos"]), pad=id_of("pad", texts["pad"]),
                    stop=tuple(dict.fromkeys(id_of("stop", t) for t in texts["stop"])),
                    bos=id_of("bos", texts["bos"]) if texts["bos"] is not None else None)


# Just before a space that follows a non-space character, the byte-level pre-tokenizer (the GPT-2 pattern that
# train_tokenizer uses) always splits: none of its pattern's matches holds a non-space character followed by
# whitespace (words, numbers and punctuation stop at whitespace; only a leading space joins the word after it), and
# how it goes on from there depends only on the text from there on. BPE never merges across a split, so text cut
# there encodes to exactly the tokens of the whole. (A copied tokenizer, tokenizer.source, with another
# pre-tokenizer or a normalizer may encode the cut differently.)
_SAFE_CUT = re.compile(r"\S(?= )")


def piece_bounds(text: str, max_chars: int) -> list[int]:
    """Cut positions [0, ..., len(text)] that split `text` into pieces of at most `max_chars` characters whose
    encodings, end to end, are the encoding of the whole: each cut is the last safe place (above) within the budget.
    A stretch of `max_chars` characters with no such place (no space after a non-space) is cut at the budget; the
    tokens at that cut may then differ from the whole's (no merge across it), the same way every run."""
    bounds = [0]
    while len(text) - bounds[-1] > max_chars:
        start, cut = bounds[-1], None
        for cut in _SAFE_CUT.finditer(text, start, start + max_chars):
            pass
        bounds.append(cut.end() if cut else start + max_chars)
    bounds.append(len(text))
    return bounds


def special_id(tok: Tokenizer, name: str) -> int:
    """Id of a special token by its short name ("eos", "pad", ...)."""
    token_id = tok.token_to_id(SPECIAL_TOKENS[name])
    assert token_id is not None, f"tokenizer has no {SPECIAL_TOKENS[name]}"
    return token_id
