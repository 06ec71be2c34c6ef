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
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import h5py
import numpy as np
import torch

from astrai_core.errors import AstraiError
from astrai_core.io import atomic_path
from astrai_core.losses import IGNORE_INDEX
from astrai_core.model import document_mask

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


# ---- reading for training: samplers, token windows, documents with a loss mask, packed rows -------------------

@dataclass
class Batch:
    """One micro-batch, ready for the model: what it reads (x, and for packed rows positions and an attention
    mask), what the loss reads (`data`: targets and the like), the units it adds to the step's loss normalizer
    (target tokens, pairs, completion tokens) and the tokens it feeds the model (throughput)."""

    x: torch.Tensor
    data: dict[str, torch.Tensor]
    count: int
    n_tokens: int
    positions: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    def logits(self, model: torch.nn.Module, autocast=contextlib.nullcontext()) -> torch.Tensor:
        """The model's logits of this batch: the one forward of training, validation and evaluation."""
        with autocast:
            return model(self.x, positions=self.positions, mask=self.mask)


IN_MEMORY_TOKENS = 1 << 28  # below this (512 MB as uint16) read the token file into RAM once: no disk reads per batch


class IndexSampler:
    """Items 0..n-1 in a fresh random order every epoch: sample k is item perm_e[k mod n] of epoch e = k // n,
    perm_e seeded by (seed, e). A pure function of k, so the state is the number of samples consumed."""

    def __init__(self, n_items: int, seed: int) -> None:
        assert n_items >= 1
        self.n_items, self.seed = n_items, seed
        self.consumed = 0
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    @property
    def epoch(self) -> int:
        return self.consumed // self.n_items

    def indices(self, first: int, n: int) -> np.ndarray:
        """Items of samples first .. first + n - 1."""
        epochs, pos = np.divmod(np.arange(first, first + n), self.n_items)
        out = np.empty(n, dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._permutation(int(e))[pos[sel]]
        return out

    def next_indices(self, n: int) -> np.ndarray:
        out = self.indices(self.consumed, n)
        self.consumed += n
        return out

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:  # one epoch's order is cached: a step needs at most two
            self._perm_epoch, self._perm = epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n_items)
        return self._perm

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed = int(state["consumed_samples"])


class WindowSampler(IndexSampler):
    """Start offsets of non-overlapping (seq_len + 1)-token windows of a token stream, reshuffled every epoch."""

    def __init__(self, n_tokens: int, seq_len: int, seed: int) -> None:
        super().__init__((n_tokens - 1) // seq_len, seed)
        self.seq_len = seq_len

    def starts(self, first: int, n: int) -> np.ndarray:
        return self.indices(first, n) * self.seq_len

    def next_starts(self, n: int) -> np.ndarray:
        return self.next_indices(n) * self.seq_len


def open_checked(path: str, tokenizer_sha256: str, vocab_size: int) -> PackedTokens:
    """A packed file, refused unless its tokenizer is this one and every id in it is one the model embeds (the ids
    are read once, in chunks of 16M: ~3 GB/s; an id out of range would otherwise stop training with an IndexError
    that names no file)."""
    data = PackedTokens(path, expected_tokenizer_sha256=tokenizer_sha256)
    if data.vocab_size > vocab_size:
        data.close()
        raise AstraiError(f"{path}: token vocabulary {data.vocab_size} exceeds model.vocab_size {vocab_size}")
    chunk = 1 << 24
    largest = max((int(data.tokens[i:i + chunk].max()) for i in range(0, data.n_tokens, chunk)), default=0)
    if largest >= min(vocab_size, data.vocab_size):
        data.close()
        raise AstraiError(f"{path}: holds token id {largest}, outside its vocabulary of {data.vocab_size} ids "
                          f"(model.vocab_size {vocab_size}); pack it again with this tokenizer")
    return data


def open_tokens(path: str, tokenizer_sha256: str, vocab_size: int, seq_len: int):
    """The token ids of a packed file, checked against the tokenizer and the model: a numpy array if small,
    else the on-disk h5py dataset (both slice the same way)."""
    data = open_checked(path, tokenizer_sha256, vocab_size)
    if data.n_tokens < seq_len + 1:
        raise AstraiError(f"{path}: {data.n_tokens} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    return data.tokens[:] if data.n_tokens < IN_MEMORY_TOKENS else data.tokens


def read_windows(tokens, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y), each (len(starts), seq_len), in host memory: the windows at `starts`, y shifted by one token."""
    windows = torch.from_numpy(np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int64))
    return windows[:, :-1], windows[:, 1:]


def to_device(tensor: torch.Tensor | np.ndarray, device: torch.device) -> torch.Tensor:
    """A batch's array on `device`; to a GPU from pinned memory without waiting (the copy is queued behind the
    step that is running, and the host goes on to read the next batch)."""
    tensor = torch.from_numpy(tensor) if isinstance(tensor, np.ndarray) else tensor
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


class Documents:
    """A packed file of documents with a loss mask (SFT conversations, DPO pairs), in memory and checked like
    open_tokens: tokens (int64), loss_mask (1 where a token is a training target) and doc_offsets."""

    def __init__(self, path: str, tokenizer_sha256: str, vocab_size: int) -> None:
        with open_checked(path, tokenizer_sha256, vocab_size) as data:
            if data.loss_mask is None or data.n_docs == 0:
                raise AstraiError(f"{path}: no loss_mask or no documents: not a conversation/preference file; "
                                  "re-run chat_data")
            self.path, self.n_docs, self.doc_offsets = path, data.n_docs, data.doc_offsets
            self.tokens = data.tokens[:].astype(np.int64)
            self.loss_mask = data.loss_mask[:]

    def targets(self, d: int) -> tuple[np.ndarray, np.ndarray]:
        """(x, y) of document d: y[t] = tokens[t + 1] where that token is a target, else IGNORE_INDEX."""
        a, b = int(self.doc_offsets[d]), int(self.doc_offsets[d + 1])
        return row_targets(self.tokens[a:b], self.loss_mask[a:b])



def row_targets(tokens: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of one sequence: y[t] = tokens[t + 1] where mask[t + 1] (a target), else IGNORE_INDEX."""
    y = np.where(mask[1:] > 0, tokens[1:], IGNORE_INDEX)
    return tokens[:-1], y


def pad_rows(rows: list[np.ndarray], length: int, value: int) -> torch.Tensor:
    out = np.full((len(rows), length), value, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return torch.from_numpy(out)


def pair_batch(docs: Documents, pairs: np.ndarray, device: torch.device) -> dict[str, torch.Tensor]:
    """Rows [chosen of each pair..., rejected of each pair...] (documents 2i and 2i + 1), right-padded; targets
    only on response tokens (the loss mask), so prompt and padding never count in a log-probability."""
    ids = [2 * int(p) for p in pairs] + [2 * int(p) + 1 for p in pairs]
    xs, ys = zip(*(docs.targets(d) for d in ids))
    length = max(len(x) for x in xs)
    return {"x": pad_rows(xs, length, 0).to(device), "y": pad_rows(ys, length, IGNORE_INDEX).to(device),
            "docs": torch.tensor(ids)}


class PackedRows:
    """Documents with a loss mask packed whole into rows of at most seq_len + 1 tokens (first fit in file order;
    a longer document is cut). Row r gives x, y, positions restarting at 0 per document, and document ids, so
    attention can be blocked across documents (model.document_mask); y is IGNORE_INDEX where the mask is 0,
    across a document boundary, and on padding."""

    def __init__(self, docs: Documents, seq_len: int) -> None:
        self.seq_len = seq_len
        self.tokens, self.mask, self.offsets = docs.tokens, docs.loss_mask, docs.doc_offsets
        self.rows: list[list[int]] = []
        current, used = [], 0
        for d in range(docs.n_docs):
            n = min(int(self.offsets[d + 1] - self.offsets[d]), seq_len + 1)
            if current and used + n > seq_len + 1:
                self.rows.append(current)
                current, used = [], 0
            current.append(d)
            used += n
        if current:
            self.rows.append(current)

    def row(self, r: int) -> tuple[np.ndarray, ...]:
        toks, masks, docs, pos = [], [], [], []
        for j, d in enumerate(self.rows[r]):
            a = int(self.offsets[d])
            b = min(int(self.offsets[d + 1]), a + self.seq_len + 1)
            toks.append(self.tokens[a:b])
            masks.append(self.mask[a:b])
            docs.append(np.full(b - a, j))
            pos.append(np.arange(b - a))
        t, m, doc, p = (np.concatenate(v) for v in (toks, masks, docs, pos))
        x = t[:-1]
        y = np.where((m[1:] > 0) & (doc[1:] == doc[:-1]), t[1:], IGNORE_INDEX)  # never predict the next document
        pad = self.seq_len - len(x)  # padding: its own "document", no targets
        x, y = np.pad(x, (0, pad)), np.pad(y, (0, pad), constant_values=IGNORE_INDEX)
        return x, y, np.pad(p[:-1], (0, pad)), np.pad(doc[:-1], (0, pad), constant_values=len(self.rows[r]))

    def batch(self, rows: np.ndarray, device: torch.device) -> Batch:
        """`rows` as one batch: positions restart and attention stops at every document boundary."""
        x, y, pos, doc = (np.stack(v) for v in zip(*(self.row(int(r)) for r in rows)))
        count = int((y != IGNORE_INDEX).sum())  # counted on the host: on a GPU, reading it back would wait
        x, y, pos, doc = (to_device(v, device) for v in (x, y, pos, doc))
        return Batch(x, {"y": y}, count, x.numel(), positions=pos, mask=document_mask(doc))
