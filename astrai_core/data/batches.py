"""What training reads from packed token files (data/packed.py): samplers whose order is a pure function of (seed,
step), token windows, documents with their loss mask, packed rows, DPO pairs, and the Batch they become."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from astrai_core.data.packed import PackedTokens
from astrai_core.model.losses import IGNORE_INDEX
from astrai_core.model.transformer import document_mask
from astrai_core.runtime.errors import AstraiError


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
