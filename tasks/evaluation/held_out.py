"""What the models are scored on, read for the evaluate stage (tasks/stages/evaluate.py) and bench/task_accuracy.py:
the test split's tokens (read_test_tokens), the chat data's question records (read_jsonl), and which items each metric
counts, as digests a later evaluation can be paired with (item_sets)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from astrai_core.data.packed import PackedTokens
from astrai_core.model.config import ModelConfig
from astrai_core.runtime.errors import AstraiError
from astrai_core.runtime.io import sha256_file


def read_test_tokens(test_split: Path, ckpt: Path, max_tokens: int | None) -> tuple[np.ndarray, int, int]:
    """The test split's tokens (test_split: the pack stage's test.h5, checked against the model's tokenizer; the
    first max_tokens, None: all), the characters they predict, the vocab size."""
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    with PackedTokens(test_split, expected_tokenizer_sha256=sha256_file(ckpt / "tokenizer.json")) as test:
        tokens = np.asarray(test.tokens[:max_tokens] if max_tokens else test.tokens[:])
    if len(tokens) < 2:
        raise AstraiError(f"{test_split}: the test split has fewer than 2 tokens")
    n_chars = len(tok.decode(tokens[1:].tolist(), skip_special_tokens=True))  # characters predicted
    vocab_size = ModelConfig.model_validate_json((ckpt / "config.json").read_text()).vocab_size
    return tokens, n_chars, vocab_size


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file (the chat data's grpo_test.jsonl, ...), none when there is no such file."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def item_sets(questions: list[dict], train_questions: list[dict], pairs: Path) -> dict[str, str]:
    """metric -> sha256 of the items it was scored on (pairs: the packed DPO test pairs, when there are any): two
    evaluations of the same items can be compared item by item (the register stage's champion gate pairs a new
    version with the champion only then)."""
    def digest(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()

    held_out, train = (digest(json.dumps(q, sort_keys=True).encode()) for q in (questions, train_questions))
    sets = {m: held_out for m in ("task_accuracy", "valid_answer_rate", "pass_at_1", "pass_at_k")}
    sets["train_task_accuracy"] = train
    if pairs.is_file():
        sets["preference_accuracy"] = sha256_file(pairs)
    return sets
