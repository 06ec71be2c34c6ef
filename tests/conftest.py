"""Shared pytest fixtures. Each helper area prefixes its fixtures (data_: corpus, tokenizer and pack stages)."""

# --- data stages (corpus, tokenizer, pack): fixtures prefixed data_ ---------------------------------------------

import json

import pytest

DATA_SAMPLE_TEXTS = {
    "a.txt": "ROMEO.\nBut soft, what light through yonder window breaks?\n",
    "b.txt": "  Leading spaces, tabs\tand\n\nblank lines.\n",
    "c.txt": "中文测试：你好，世界。\n",
    "d.txt": "Emoji 👍🏽🎉 and accents: café, naïve.\n",
    "nested/e.txt": "JULIET.\nO Romeo, Romeo, wherefore art thou Romeo?\n",
}


@pytest.fixture(scope="session")
def data_tokenizer():
    """A small byte-level BPE trained on mixed-script text (well under a second)."""
    from astrai_core.tokenizer import train_tokenizer

    return train_tokenizer(list(DATA_SAMPLE_TEXTS.values()) * 20, vocab_size=320, min_frequency=2)


@pytest.fixture
def data_source_dir(tmp_path):
    """A directory corpus: five .txt documents (one nested) and a .jsonl file holding three more."""
    src = tmp_path / "src"
    for name, text in DATA_SAMPLE_TEXTS.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text, encoding="utf-8")
    records = [{"text": f"Document {i} from jsonl: the quick brown fox.\n"} for i in range(3)]
    (src / "more.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return src


# --- training core (model, train, checkpoint): fixtures and helpers prefixed core_ -----------------------------

import random
from pathlib import Path


def _core_text(n_sentences: int, seed: int) -> str:
    """Tiny English-like text with structure a 2-layer model picks up within 20 steps."""
    rng = random.Random(seed)
    subjects = ["the king", "a queen", "my lord", "the fool", "sweet romeo", "fair juliet"]
    verbs = ["speaks to", "loves", "follows", "betrays", "sings for", "waits for"]
    objects = ["the crown.", "his horse.", "the night.", "her brother.", "the people.", "a ghost."]
    return "\n".join(f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}" for _ in range(n_sentences))


def _core_write_packed(path, ids, *, tokenizer_sha256: str, vocab_size: int, split: str = "train") -> Path:
    """Write token ids as a packed HDF5 file (one document)."""
    from astrai_core.data import PackedWriter

    with PackedWriter(path, vocab_size=vocab_size, tokenizer_sha256=tokenizer_sha256,
                      source_manifest_sha256="0" * 64, split=split) as w:
        w.add_document(ids)
    return Path(path)


@pytest.fixture(scope="session")
def core_write_packed():
    """The packed-file writer above: core_write_packed(path, ids, tokenizer_sha256=..., vocab_size=...)."""
    return _core_write_packed


@pytest.fixture(scope="session")
def core_tiny_data(tmp_path_factory) -> dict:
    """A byte-level BPE tokenizer (vocab 300) and train/val packed files: {"tokenizer", "train", "val", "vocab_size"}."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from astrai_core.io import sha256_file

    root = tmp_path_factory.mktemp("core_data")
    vocab_size = 300
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|end_of_text|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_core_text(2000, 0)], trainer=trainer)
    tok_path = root / "tokenizer.json"
    tok.save(str(tok_path))
    sha = sha256_file(tok_path)
    out = {"tokenizer": tok_path, "vocab_size": vocab_size, "tokenizer_obj": tok}
    for split, seed, n in (("train", 1, 3000), ("val", 2, 300)):
        ids = tok.encode(_core_text(n, seed)).ids
        out[split] = _core_write_packed(root / f"{split}.h5", ids, tokenizer_sha256=sha, vocab_size=vocab_size,
                                       split=split)
    return out
