"""The data layer: packed token files (one HDF5 file per split, every document's token ids end to end) and what
training reads from them (samplers, token windows, documents with their loss mask, packed rows, DPO pairs).

Layout (FORMAT_VERSION 1):

    attrs     format_version, tokenizer_sha256, vocab_size, source_manifest_sha256, split
    tokens       1-D uint16 (vocab_size <= 65536) or uint32, uncompressed
    doc_offsets  1-D int64, n_docs + 1 entries starting at 0: document i is tokens[off[i]:off[i + 1]]
    loss_mask    optional 1-D uint8 beside tokens: 1 where the token is a training target (SFT: assistant
                 replies; DPO: the response). Pretraining files have none: every token is a target.

`tokens` is chunked and resizable so the writer can stream; it is left uncompressed because compression makes
the random window reads of training 10-100x slower. Readers refuse a file packed with another tokenizer.

    with PackedWriter("train.h5", vocab_size=2048, tokenizer_sha256=h, source_manifest_sha256=m, split="train") as w:
        w.add_document([5, 9, 1])
    with PackedTokens("train.h5", expected_tokenizer_sha256=h) as data:
        first = data.tokens[data.doc_offsets[0] : data.doc_offsets[1]]  # the first document
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Sequence

import h5py
import numpy as np

from astrai_core.runtime.errors import AstraiError
from astrai_core.runtime.io import atomic_path

FORMAT_VERSION = 1

# 1M tokens: 2 MB per uint16 chunk, few enough chunks that the chunk index stays tiny even for billions of tokens.
TOKEN_CHUNK = 1 << 20
OFFSET_CHUNK = 1 << 16
# Reader chunk cache: several whole chunks, so neighbouring window reads hit memory instead of the disk.
READ_CACHE_BYTES = 64 << 20

_REQUIRED_ATTRS = ("format_version", "tokenizer_sha256", "vocab_size", "source_manifest_sha256", "split")


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type that holds every id: halves the file (and the page cache) for vocabularies <= 64K."""
    return np.dtype(np.uint16 if vocab_size <= 65536 else np.uint32)


class PackedWriter:
    """Stream documents into a packed file; the file appears at `path` only when the `with` block succeeds.

    Tokens and offsets are buffered up to one chunk and then appended to resizable datasets, so memory stays
    bounded however large the corpus. On an exception the temporary file is removed and `path` is untouched.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        vocab_size: int,
        tokenizer_sha256: str,
        source_manifest_sha256: str,
        split: str,
        with_loss_mask: bool = False,
    ) -> None:
        self.path = Path(path)
        self.with_loss_mask = with_loss_mask
        self.vocab_size = int(vocab_size)
        self.dtype = token_dtype(self.vocab_size)
        self._attrs = {
            "format_version": FORMAT_VERSION,
            "tokenizer_sha256": tokenizer_sha256,
            "vocab_size": self.vocab_size,
            "source_manifest_sha256": source_manifest_sha256,
            "split": split,
        }
        self._stack: contextlib.ExitStack | None = None
        self.n_tokens = 0  # written to the file so far plus buffered
        self.n_docs = 0

    def __enter__(self) -> "PackedWriter":
        with contextlib.ExitStack() as stack:
            # Exit order is the reverse: the HDF5 file is closed before atomic_path renames (or removes) it.
            tmp = stack.enter_context(atomic_path(self.path, "HDF5 dataset"))
            self._file = stack.enter_context(h5py.File(tmp, "w"))
            self._file.attrs.update(self._attrs)
            self._tokens = self._file.create_dataset(
                "tokens", shape=(0,), maxshape=(None,), dtype=self.dtype, chunks=(TOKEN_CHUNK,)
            )
            self._offsets = self._file.create_dataset(
                "doc_offsets", shape=(0,), maxshape=(None,), dtype=np.int64, chunks=(OFFSET_CHUNK,)
            )
            self._mask = (self._file.create_dataset("loss_mask", shape=(0,), maxshape=(None,), dtype=np.uint8,
                                                    chunks=(TOKEN_CHUNK,)) if self.with_loss_mask else None)
            self._mask_buf: list[np.ndarray] = []
            self._token_buf: list[np.ndarray] = []
            self._buffered_tokens = 0
            self._offset_buf: list[int] = [0]
            self._stack = stack.pop_all()
        return self

    def add_document(self, ids: Sequence[int] | np.ndarray, loss_mask: Sequence[int] | np.ndarray | None = None) -> None:
        """Append `ids` and end the document: a whole document, or the last part of one begun with add_tokens."""
        self._buffer(ids, loss_mask)
        self.n_docs += 1
        self._offset_buf.append(self.n_tokens)
        if self._buffered_tokens >= TOKEN_CHUNK or len(self._offset_buf) >= OFFSET_CHUNK:
            self._flush()

    def add_tokens(self, ids: Sequence[int] | np.ndarray) -> None:
        """Append `ids` to the document in progress without ending it: a document too long to hold at once is
        written in parts (its last part through add_document), and memory stays at one chunk."""
        assert not self.with_loss_mask, "documents with a loss mask are written whole"
        self._buffer(ids, None)
        if self._buffered_tokens >= TOKEN_CHUNK:
            self._flush()

    def _buffer(self, ids: Sequence[int] | np.ndarray, loss_mask: Sequence[int] | np.ndarray | None) -> None:
        assert self._stack is not None, "use PackedWriter as a context manager"
        if (loss_mask is not None) != self.with_loss_mask:
            raise ValueError(f"{self.path}: pass loss_mask with every document exactly when with_loss_mask=True")
        arr = np.asarray(ids)
        if loss_mask is not None:
            mask = np.asarray(loss_mask, dtype=np.uint8)
            if mask.shape != arr.shape:
                raise ValueError(f"{self.path}: loss_mask shape {mask.shape} differs from the document's {arr.shape}")
            self._mask_buf.append(mask)
        if arr.ndim != 1:
            raise ValueError(f"{self.path}: a document must be a 1-D sequence of token ids, got shape {arr.shape}")
        if arr.size:
            if not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"{self.path}: token ids must be integers, got {arr.dtype}")
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(f"{self.path}: token id {lo if lo < 0 else hi} outside [0, {self.vocab_size})")
            self._token_buf.append(arr.astype(self.dtype, copy=True))
            self._buffered_tokens += arr.size
        self.n_tokens += arr.size

    def _flush(self) -> None:
        if self._token_buf:
            block = np.concatenate(self._token_buf)
            start = self._tokens.shape[0]
            self._tokens.resize((start + block.size,))
            self._tokens[start:] = block
            self._token_buf, self._buffered_tokens = [], 0
        if self._mask_buf:
            block = np.concatenate(self._mask_buf)
            start = self._mask.shape[0]
            self._mask.resize((start + block.size,))
            self._mask[start:] = block
            self._mask_buf = []
        if self._offset_buf:
            block = np.asarray(self._offset_buf, dtype=np.int64)
            start = self._offsets.shape[0]
            self._offsets.resize((start + block.size,))
            self._offsets[start:] = block
            self._offset_buf = []

    def __exit__(self, exc_type, exc, tb) -> bool:
        assert self._stack is not None
        stack, self._stack = self._stack, None
        if exc_type is not None:
            return stack.__exit__(exc_type, exc, tb)  # closes the file, atomic_path removes it
        with stack:  # a failure in the last flush also reaches atomic_path, which then removes the file
            self._flush()
        return False


class PackedTokens:
    """Read-only view of a packed file, checked against the tokenizer the caller is about to use.

    `tokens` stays on disk (an h5py dataset); `doc_offsets` is loaded (8 bytes per document).
    h5py handles do not survive fork: open one PackedTokens per process.
    """

    def __init__(self, path: str | os.PathLike, expected_tokenizer_sha256: str | None = None) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise AstraiError(f"{self.path}: packed token file not found; run the pack stage")
        try:
            self._file = h5py.File(self.path, "r", rdcc_nbytes=READ_CACHE_BYTES)
        except OSError as e:
            raise AstraiError(f"{self.path}: not a packed token file (HDF5 open failed: {e})") from None
        try:
            self._validate(expected_tokenizer_sha256)
        except BaseException:
            self._file.close()
            raise

    def _validate(self, expected_tokenizer_sha256: str | None) -> None:
        f, attrs = self._file, self._file.attrs
        missing = [k for k in _REQUIRED_ATTRS if k not in attrs] + [k for k in ("tokens", "doc_offsets") if k not in f]
        if missing:
            raise AstraiError(f"{self.path}: not a packed token file (missing {', '.join(missing)}); re-run the pack stage")
        version = int(attrs["format_version"])
        if version != FORMAT_VERSION:
            raise AstraiError(
                f"{self.path}: packed token format version {version}, this code reads {FORMAT_VERSION}; "
                "re-run the pack stage"
            )
        self.tokenizer_sha256 = str(attrs["tokenizer_sha256"])
        if expected_tokenizer_sha256 is not None and self.tokenizer_sha256 != expected_tokenizer_sha256:
            raise AstraiError(
                f"{self.path}: packed with tokenizer sha256 {self.tokenizer_sha256[:12]}… but the tokenizer is "
                f"{expected_tokenizer_sha256[:12]}…; re-run the pack stage"
            )
        self.vocab_size = int(attrs["vocab_size"])
        self.source_manifest_sha256 = str(attrs["source_manifest_sha256"])
        self.split = str(attrs["split"])
        self.tokens: h5py.Dataset = f["tokens"]
        self.doc_offsets: np.ndarray = f["doc_offsets"][:]
        self.loss_mask: h5py.Dataset | None = f["loss_mask"] if "loss_mask" in f else None
        self.n_tokens = int(self.tokens.shape[0])
        self.n_docs = len(self.doc_offsets) - 1
        offsets = self.doc_offsets
        if (
            self.tokens.ndim != 1
            or self.tokens.dtype != token_dtype(self.vocab_size)
            or self.n_docs < 0
            or offsets[0] != 0
            or offsets[-1] != self.n_tokens
            or np.any(np.diff(offsets) < 0)
            or (self.loss_mask is not None and self.loss_mask.shape != self.tokens.shape)
        ):
            raise AstraiError(f"{self.path}: corrupt packed token file (tokens/doc_offsets disagree); re-run the pack stage")

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "PackedTokens":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return self.n_tokens
