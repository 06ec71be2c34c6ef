"""What the training loop trains on and which loss it takes: one class per strategy.

    seq   next-token prediction on packed text windows (optionally two-stage KL-regularized)
    sft   packed conversations: loss on assistant tokens only, attention blocked across conversations
    dpo   preference pairs against cached reference log-probabilities
    grpo  completions sampled from the policy, scored by reward functions

The loop (astrai_core/train.py) asks a strategy for this rank's micro-batches of the coming step and for each
micro-batch's summed loss; it divides by the step's unit count (target tokens, pairs or completion tokens) summed
over all micro-batches and ranks. A strategy's data order is a pure function of the step (IndexSampler), and
anything else it carries across steps is in state_dict(), so every strategy resumes exactly.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np
import torch

from astrai_core.data import PackedTokens
from astrai_core.errors import AstraiError
from astrai_core.io import atomic_path, sha256_file
from astrai_core.losses import (IGNORE_INDEX, dpo_loss, full_kl_sum, group_advantages, grpo_token_loss,
                                sequence_logps, token_logps, token_loss_sum)
from astrai_core.model import Transformer, document_mask

if TYPE_CHECKING:
    from astrai_core.config import TrainConfig
    from astrai_core.train import Run

IN_MEMORY_TOKENS = 1 << 28  # below this (512 MB as uint16) read the token file into RAM once: no disk reads per batch
VAL_SEED_OFFSET = 10**9  # the validation sampler's seed: never equal to the training sampler's


# ---- sampling and reading ----------------------------------------------------------------------------------

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
        self.n_windows = self.n_items

    def starts(self, first: int, n: int) -> np.ndarray:
        return self.indices(first, n) * self.seq_len

    def next_starts(self, n: int) -> np.ndarray:
        return self.next_indices(n) * self.seq_len


def open_tokens(path: str, tokenizer_sha256: str, vocab_size: int, seq_len: int):
    """The token ids of a packed file, checked against the tokenizer and the model: a numpy array if small,
    else the on-disk h5py dataset (both slice the same way)."""
    data = PackedTokens(path, expected_tokenizer_sha256=tokenizer_sha256)
    if data.vocab_size > vocab_size:
        raise AstraiError(f"{path}: token vocabulary {data.vocab_size} exceeds model.vocab_size {vocab_size}")
    if data.n_tokens < seq_len + 1:
        raise AstraiError(f"{path}: {data.n_tokens} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    return data.tokens[:] if data.n_tokens < IN_MEMORY_TOKENS else data.tokens


def read_windows(tokens, starts: np.ndarray, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y), each (len(starts), seq_len): the windows at `starts`, y shifted by one token."""
    windows = torch.from_numpy(np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int64))
    if device.type == "cuda":
        windows = windows.pin_memory().to(device, non_blocking=True)
    return windows[:, :-1], windows[:, 1:]


def open_documents(path: str, tokenizer_sha256: str, vocab_size: int) -> PackedTokens:
    """A packed file of documents with a loss mask (SFT conversations, DPO pairs), checked like open_tokens."""
    data = PackedTokens(path, expected_tokenizer_sha256=tokenizer_sha256)
    if data.vocab_size > vocab_size:
        raise AstraiError(f"{path}: token vocabulary {data.vocab_size} exceeds model.vocab_size {vocab_size}")
    if data.loss_mask is None or data.n_docs == 0:
        raise AstraiError(f"{path}: no loss_mask or no documents: not a conversation/preference file; re-run chat_data")
    return data


@dataclass
class Batch:
    """One micro-batch: tensors for the strategy's loss, the units it adds to the step's normalizer, and the
    tokens it feeds the model (for throughput)."""

    data: dict[str, torch.Tensor]
    count: int
    n_tokens: int


def _row_targets(tokens: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of one sequence: y[t] = tokens[t + 1] where mask[t + 1] (a target), else IGNORE_INDEX."""
    y = np.where(mask[1:] > 0, tokens[1:], IGNORE_INDEX)
    return tokens[:-1], y


def _pad_rows(rows: list[np.ndarray], length: int, value: int) -> torch.Tensor:
    out = np.full((len(rows), length), value, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return torch.from_numpy(out)


# ---- strategies ----------------------------------------------------------------------------------------------

class Strategy:
    """Base: the loop calls micro_batches once per step, loss once per micro-batch, eval_batches to validate."""

    unit = "tokens"  # what count measures

    def __init__(self, cfg: "TrainConfig", rank: int, world_size: int, device: torch.device, tokenizer_sha256: str):
        self.cfg, self.rank, self.world_size, self.device = cfg, rank, world_size, device
        self.per_step = world_size * cfg.grad_accum * cfg.batch_size  # samples per optimizer step, all ranks
        self.step_stats: dict[str, tuple[float, float]] = {}  # (sum, count) pairs to average over ranks this step

    def setup(self, model: Transformer) -> None:
        """Called once the starting weights are loaded (before LoRA or DDP wrap the model)."""

    def my_slices(self, items: np.ndarray) -> list[np.ndarray]:
        """This rank's micro-batches out of a step's items: micro-step m of rank r takes slice m * ranks + r."""
        b = self.cfg.batch_size
        return [items[(m * self.world_size + self.rank) * b:][:b] for m in range(self.cfg.grad_accum)]

    def micro_batches(self, run: "Run") -> list[Batch]:
        raise NotImplementedError

    def loss(self, run: "Run", batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(summed loss, metric sums): both divided by the step's total count by the loop."""
        raise NotImplementedError

    def eval_batches(self, i: int) -> Batch | None:
        """This rank's i-th validation batch (fixed across the run), or None without validation data."""
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class SeqStrategy(Strategy):
    """Next-token prediction on (seq_len + 1)-token windows of the packed stream. With two_stage: after
    stage1_tokens a frozen snapshot becomes the reference and the loss gains beta * KL(policy || reference)
    over the full next-token distributions, on stage 2's own data mixture."""

    def __init__(self, cfg, rank, world_size, device, tokenizer_sha256):
        super().__init__(cfg, rank, world_size, device, tokenizer_sha256)
        open_ = lambda p: open_tokens(p, tokenizer_sha256, cfg.model.vocab_size, cfg.seq_len)
        self.tokens = open_(cfg.train_data)
        self.sampler = WindowSampler(len(self.tokens), cfg.seq_len, cfg.seed)
        self.val_tokens = open_(cfg.val_data) if cfg.val_data else None
        self.val_sampler = (WindowSampler(len(self.val_tokens), cfg.seq_len, cfg.seed + VAL_SEED_OFFSET)
                            if cfg.val_data else None)
        self.reference: Transformer | None = None
        self.switch_step: int | None = None
        if cfg.two_stage is not None:
            self.switch_step = math.ceil(cfg.two_stage.stage1_tokens / (self.per_step * cfg.seq_len))
            mix = cfg.two_stage.stage2_data or {cfg.train_data: 1.0}
            if any(w <= 0 for w in mix.values()):
                raise AstraiError(f"two_stage.stage2_data: weights must be > 0, got {mix}")
            # Source j: its tokens and its own sampler (the main one when it is train_data itself).
            self.mix_paths = list(mix)
            self.mix_weights = np.array([mix[p] for p in self.mix_paths], dtype=np.float64)
            self.mix_weights /= self.mix_weights.sum()
            self.mix_tokens = [self.tokens if p == cfg.train_data else open_(p) for p in self.mix_paths]
            self.mix_samplers = [self.sampler if p == cfg.train_data else
                                 WindowSampler(len(t), cfg.seq_len, cfg.seed + 1 + j)
                                 for j, (p, t) in enumerate(zip(self.mix_paths, self.mix_tokens))]

    def in_stage2(self, step: int) -> bool:
        return self.switch_step is not None and step >= self.switch_step

    def _stage2_starts(self, step: int) -> tuple[list[Any], np.ndarray]:
        """Stage 2: which source each of the step's samples comes from (seeded by the step), and its start."""
        choice = np.random.default_rng([self.cfg.seed, step]).choice(len(self.mix_paths), self.per_step,
                                                                     p=self.mix_weights)
        starts = np.empty(self.per_step, dtype=np.int64)
        for j, sampler in enumerate(self.mix_samplers):
            sel = choice == j
            starts[sel] = sampler.next_starts(int(sel.sum()))
        return [self.mix_tokens[j] for j in choice], starts

    def micro_batches(self, run):
        cfg = self.cfg
        if self.in_stage2(run.step):
            if self.reference is None:  # the switch: freeze a snapshot of the model as it is now
                self.reference = frozen_copy(run.raw_model)
                run.print0(f"two-stage: step {run.step}, the reference is frozen; KL beta {cfg.two_stage.beta}", flush=True)
            sources, starts = self._stage2_starts(run.step)
        else:
            sources, starts = None, self.sampler.next_starts(self.per_step)
        batches = []
        for sel in self.my_slices(np.arange(self.per_step)):
            if sources is None:
                x, y = read_windows(self.tokens, starts[sel], cfg.seq_len, self.device)
            else:  # a mixture: each window from its own source
                xs, ys = zip(*(read_windows(sources[i], starts[i : i + 1], cfg.seq_len, self.device) for i in sel))
                x, y = torch.cat(xs), torch.cat(ys)
            batches.append(Batch({"x": x, "y": y}, int((y != IGNORE_INDEX).sum()), x.numel()))
        return batches

    def loss(self, run, batch):
        x, y = batch.data["x"], batch.data["y"]
        with run.autocast:
            logits = run.model(x)
        ce = token_loss_sum(logits, y, self.cfg.label_smoothing)
        if self.reference is None or not self.in_stage2(run.step):
            return ce, {}
        with torch.no_grad(), run.autocast:
            ref_logits = self.reference(x)
        kl = full_kl_sum(logits, ref_logits, y)
        return ce + self.cfg.two_stage.beta * kl, {"train/ce": ce.detach(), "train/kl": kl.detach()}

    def eval_batches(self, i):
        if self.val_tokens is None:
            return None
        b = self.cfg.batch_size
        starts = self.val_sampler.starts(i * self.world_size * b, self.world_size * b)
        x, y = read_windows(self.val_tokens, starts[self.rank * b : (self.rank + 1) * b], self.cfg.seq_len, self.device)
        return Batch({"x": x, "y": y}, int((y != IGNORE_INDEX).sum()), x.numel())

    def state_dict(self):
        state: dict[str, Any] = {}
        if self.switch_step is not None:
            state["mix_consumed"] = [s.consumed for s in self.mix_samplers]
            if self.reference is not None:  # resuming after the switch needs the same reference
                state["reference"] = {k: v.detach().cpu().clone() for k, v in self.reference.state_dict().items()}
        return state

    def load_state_dict(self, state):
        if self.switch_step is None:
            return
        for s, n in zip(self.mix_samplers, state.get("mix_consumed", [])):
            s.consumed = int(n)
        if "reference" in state:
            self.reference = Transformer(self.cfg.model).to(self.device)
            self.reference.load_state_dict(state["reference"])
            self.reference = frozen_copy(self.reference)


class PackedRows:
    """Documents with a loss mask packed whole into rows of at most seq_len + 1 tokens (first fit in file order;
    a longer document is cut). Row r gives x, y, positions restarting at 0 per document, and document ids, so
    attention can be blocked across documents (model.document_mask); y is IGNORE_INDEX where the mask is 0,
    across a document boundary, and on padding."""

    def __init__(self, data: PackedTokens, seq_len: int) -> None:
        self.seq_len = seq_len
        self.tokens = data.tokens[:].astype(np.int64)
        self.mask = data.loss_mask[:]
        self.offsets = data.doc_offsets
        self.rows: list[list[int]] = []
        current, used = [], 0
        for d in range(data.n_docs):
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
        x, y, pos, doc = (torch.from_numpy(np.stack(v)).to(device) for v in zip(*(self.row(int(r)) for r in rows)))
        return Batch({"x": x, "y": y, "positions": pos, "doc_ids": doc}, int((y != IGNORE_INDEX).sum()), x.numel())


class SFTStrategy(Strategy):
    """Supervised fine-tuning on packed conversations: several per row, each attending only to itself, the
    loss on assistant tokens only (the chat_data stage wrote the loss mask)."""

    def __init__(self, cfg, rank, world_size, device, tokenizer_sha256):
        super().__init__(cfg, rank, world_size, device, tokenizer_sha256)
        self.rows = PackedRows(open_documents(cfg.train_data, tokenizer_sha256, cfg.model.vocab_size), cfg.seq_len)
        self.sampler = IndexSampler(len(self.rows.rows), cfg.seed)
        self.val_rows = (PackedRows(open_documents(cfg.val_data, tokenizer_sha256, cfg.model.vocab_size), cfg.seq_len)
                         if cfg.val_data else None)

    def micro_batches(self, run):
        rows = self.sampler.next_indices(self.per_step)
        return [self.rows.batch(sel, self.device) for sel in self.my_slices(rows)]

    def loss(self, run, batch):
        d = batch.data
        with run.autocast:
            logits = run.model(d["x"], positions=d["positions"], mask=document_mask(d["doc_ids"]))
        return token_loss_sum(logits, d["y"], self.cfg.label_smoothing), {}

    def eval_batches(self, i):
        if self.val_rows is None:
            return None
        n, b = len(self.val_rows.rows), self.cfg.batch_size
        first = (i * self.world_size + self.rank) * b
        return self.val_rows.batch(np.arange(first, first + b) % n, self.device)


def pair_batch(data: PackedTokens, tokens: np.ndarray, pairs: np.ndarray, device: torch.device) -> dict[str, torch.Tensor]:
    """Rows [chosen of each pair..., rejected of each pair...] (documents 2i and 2i + 1), right-padded; targets
    only on response tokens (the loss mask), so prompt and padding never count in a log-probability."""
    docs = [2 * int(p) for p in pairs] + [2 * int(p) + 1 for p in pairs]
    xs, ys = [], []
    for d in docs:
        a, b = int(data.doc_offsets[d]), int(data.doc_offsets[d + 1])
        x, y = _row_targets(tokens[a:b], data.mask_array[a:b])
        xs.append(x)
        ys.append(y)
    length = max(len(x) for x in xs)
    return {"x": _pad_rows(xs, length, 0).to(device), "y": _pad_rows(ys, length, IGNORE_INDEX).to(device),
            "docs": torch.tensor(docs)}


class DPOStrategy(Strategy):
    """Direct preference optimization. The reference's summed log-probabilities of every response were computed
    once (reference_logps) and are read from a file keyed by the data's and the reference weights' hashes."""

    unit = "pairs"

    def __init__(self, cfg, rank, world_size, device, tokenizer_sha256):
        super().__init__(cfg, rank, world_size, device, tokenizer_sha256)
        self.data = open_documents(cfg.train_data, tokenizer_sha256, cfg.model.vocab_size)
        if self.data.n_docs % 2:
            raise AstraiError(f"{cfg.train_data}: {self.data.n_docs} documents; DPO pairs need an even number")
        self.tokens = self.data.tokens[:].astype(np.int64)
        self.data.mask_array = self.data.loss_mask[:]
        self.ref_logps = load_reference_logps(cfg.dpo.reference_logps, cfg.train_data,
                                              Path(cfg.init_from) / "model.safetensors")
        self.sampler = IndexSampler(self.data.n_docs // 2, cfg.seed)

    def micro_batches(self, run):
        pairs = self.sampler.next_indices(self.per_step)
        out = []
        for sel in self.my_slices(pairs):
            data = pair_batch(self.data, self.tokens, sel, self.device)
            data["ref"] = torch.from_numpy(self.ref_logps[data["docs"].numpy()]).float().to(self.device)
            out.append(Batch(data, len(sel), data["x"].numel()))
        return out

    def loss(self, run, batch):
        d, c = batch.data, self.cfg.dpo
        with run.autocast:
            logits = run.model(d["x"])
        logps = sequence_logps(logits, d["y"])
        n = len(logps) // 2
        losses, r_chosen, r_rejected = dpo_loss(logps[:n], logps[n:], d["ref"][:n], d["ref"][n:], c.beta, c.loss,
                                                c.label_smoothing)
        return losses.sum(), {"dpo/rewards_chosen": r_chosen.sum(), "dpo/rewards_rejected": r_rejected.sum(),
                              "dpo/reward_margin": (r_chosen - r_rejected).sum(),
                              "dpo/reward_accuracy": (r_chosen > r_rejected).float().sum(),
                              "dpo/logps_chosen": logps[:n].detach().sum(), "dpo/logps_rejected": logps[n:].detach().sum()}


@torch.no_grad()
def reference_logps(model: Transformer, data_path: str, tokenizer_sha256: str, batch_size: int = 16,
                    dtype: str = "fp32") -> np.ndarray:
    """Summed log-probability of each document's masked tokens under `model`: the DPO reference. `dtype` bf16
    runs the forward under autocast, as a bf16 DPO run computes its policy's (log-probabilities stay fp32)."""
    data = open_documents(data_path, tokenizer_sha256, model.cfg.vocab_size)
    tokens, data.mask_array = data.tokens[:].astype(np.int64), data.loss_mask[:]
    out = np.zeros(data.n_docs, dtype=np.float64)
    model.eval()
    for first in range(0, data.n_docs, 2 * batch_size):
        pairs = np.arange(first // 2, min(first // 2 + batch_size, data.n_docs // 2))
        b = pair_batch(data, tokens, pairs, torch.device("cpu"))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            logits = model(b["x"])
        out[b["docs"].numpy()] = sequence_logps(logits, b["y"]).double().numpy()
    return out


def save_reference_logps(path: str | Path, logps: np.ndarray, data_path: str | Path, reference_weights: str | Path) -> None:
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        f.create_dataset("logps", data=logps)
        f.attrs["data_sha256"] = sha256_file(data_path)
        f.attrs["reference_sha256"] = sha256_file(reference_weights)


def load_reference_logps(path: str, data_path: str, reference_weights: Path) -> np.ndarray:
    """The cached log-probabilities, refused unless they were computed on this data with these weights."""
    if not Path(path).is_file():
        raise AstraiError(f"{path}: reference log-probabilities not found; run the dpo_reference stage")
    with h5py.File(path, "r") as f:
        for key, file in (("data_sha256", data_path), ("reference_sha256", reference_weights)):
            if f.attrs.get(key) != sha256_file(file):
                raise AstraiError(f"{path}: computed for another {file} ({key} differs); re-run the dpo_reference stage")
        return f["logps"][:]


def frozen_copy(model: Transformer) -> Transformer:
    """An eval-mode copy of the bare model whose weights never train (a reference)."""
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


class GRPOStrategy(Strategy):
    """Group relative policy optimization. Each step takes batch_size prompts per micro-step and rank, samples
    group_size completions of each from the current policy, scores them with the weighted reward functions, and
    normalizes rewards within each group into advantages. The loss is the clipped ratio objective against the
    policy that sampled (new rollouts every `iterations` steps) plus kl_coef * k3 KL to the frozen starting
    model, summed over completion tokens and divided by all completion tokens of the step (token-level)."""

    def __init__(self, cfg, rank, world_size, device, tokenizer_sha256):
        super().__init__(cfg, rank, world_size, device, tokenizer_sha256)
        from astrai_core.chat import load_chat
        from astrai_core.rewards import resolve_reward

        self.chat = load_chat(cfg.tokenizer)
        self.rewards = {name: (resolve_reward(name), w) for name, w in cfg.grpo.rewards.items()}
        self.records = []
        with open(cfg.train_data, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        record = json.loads(line)
                        prompt = self.chat.encode_prompt([{"role": "user", "content": record["prompt"]}])
                    except (json.JSONDecodeError, KeyError, TypeError, AstraiError) as e:
                        raise AstraiError(f"{cfg.train_data}:{lineno}: not a GRPO prompt record ({e})") from None
                    if len(prompt) + cfg.grpo.max_new_tokens > cfg.model.max_seq_len:
                        raise AstraiError(f"{cfg.train_data}:{lineno}: prompt of {len(prompt)} tokens + max_new_tokens "
                                          f"exceeds the context ({cfg.model.max_seq_len})")
                    self.records.append((record, prompt))
        if not self.records:
            raise AstraiError(f"{cfg.train_data}: no prompts")
        self.sampler = IndexSampler(len(self.records), cfg.seed)
        self.buffer: list[dict[str, torch.Tensor]] = []  # this rank's rollouts, reused for `iterations` steps

    def setup(self, model):
        self.reference = frozen_copy(model)

    def micro_batches(self, run):
        g = self.cfg.grpo
        self.step_stats = {}  # rollout statistics are logged on the step that sampled them
        if run.step % g.iterations == 0 or not self.buffer:
            self.buffer = self._rollouts(run, self.sampler.next_indices(self.per_step))
        return [Batch(d, int(d["mask"].sum()), d["x"].numel()) for d in self.buffer]

    @torch.no_grad()
    def _rollouts(self, run, items: np.ndarray) -> list[dict[str, torch.Tensor]]:
        from astrai_core.generate import generate_batch

        g, model = self.cfg.grpo, run.raw_model
        # Sampling randomness is a function of (seed, step, rank): a resumed run samples the same completions.
        gen = torch.Generator(device=self.device).manual_seed(hash((self.cfg.seed, run.step, self.rank)) % 2**63)
        stats = {k: [0.0, 0.0] for k in ("grpo/reward_mean", "grpo/reward_std", "grpo/zero_spread_fraction",
                                          "grpo/completion_length", "grpo/reward_errors")}
        out = []
        for sel in self.my_slices(items):
            prompts = [self.records[int(i)][1] for i in sel for _ in range(g.group_size)]
            records = [self.records[int(i)][0] for i in sel for _ in range(g.group_size)]
            with run.autocast:
                completions = generate_batch(model, prompts, g.max_new_tokens, temperature=g.temperature,
                                             top_k=g.top_k, top_p=g.top_p, stop_ids=self.chat.stop_ids, generator=gen)
            rewards = torch.tensor([self._reward(self.chat.decode_reply(c), r) for c, r in zip(completions, records)])
            bad = ~torch.isfinite(rewards).view(-1, g.group_size).all(1)  # groups with a failed reward: skipped
            rewards = torch.where(torch.isfinite(rewards), rewards, torch.zeros(()))
            adv = group_advantages(rewards, g.group_size) * (~bad).repeat_interleave(g.group_size)
            xs, ys = [], []
            for p, c in zip(prompts, completions):
                seq = np.array(p + c, dtype=np.int64)
                x, y = _row_targets(seq, np.array([0] * len(p) + [1] * len(c)))
                xs.append(x)
                ys.append(y)
            length = max(len(x) for x in xs)
            x, y = _pad_rows(xs, length, 0).to(self.device), _pad_rows(ys, length, IGNORE_INDEX).to(self.device)
            with run.autocast:
                ref_logits = self.reference(x)
                old_logits = model(x) if g.iterations > 1 else None
            ref_logp = token_logps(ref_logits, y)
            old_logp = token_logps(old_logits, y) if old_logits is not None else None
            batch = {"x": x, "y": y, "mask": y != IGNORE_INDEX, "adv": adv.to(self.device), "ref_logp": ref_logp}
            if old_logp is not None:
                batch["old_logp"] = old_logp
            out.append(batch)
            spread = rewards.view(-1, g.group_size).std(1)
            for key, value, n in (("grpo/reward_mean", rewards.sum(), len(rewards)),
                                  ("grpo/reward_std", spread.sum(), len(spread)),
                                  ("grpo/zero_spread_fraction", (spread == 0).float().sum(), len(spread)),
                                  ("grpo/completion_length", float(sum(map(len, completions))), len(completions)),
                                  ("grpo/reward_errors", bad.float().sum(), len(spread))):
                stats[key][0] += float(value)
                stats[key][1] += n
        self.step_stats = {k: tuple(v) for k, v in stats.items()}
        # With on_reward_error: skip, a reward that always fails would "train" on zero advantages and exit 0.
        failed, groups = run.all_reduce_sum(torch.tensor(stats["grpo/reward_errors"], device=self.device)).tolist()
        if failed == groups:
            raise AstraiError(f"step {run.step + 1}: every reward failed on every rank (grpo.on_reward_error: skip), "
                              "nothing to learn from; fix the reward functions (grpo.rewards)")
        return out

    def _reward(self, completion: str, record: dict) -> float:
        total = 0.0
        for name, (fn, weight) in self.rewards.items():
            try:
                r = float(fn(completion, record))
                if not math.isfinite(r):
                    raise ValueError(f"returned {r}")
            except Exception as e:
                if self.cfg.grpo.on_reward_error == "stop":
                    raise AstraiError(f"reward {name!r} failed on prompt {record.get('prompt', '')[:60]!r}: {e}") from None
                return math.nan
            total += weight * r
        return total

    def loss(self, run, batch):
        d, g = batch.data, self.cfg.grpo
        with run.autocast:
            logits = run.model(d["x"])
        logp = token_logps(logits, d["y"])
        old = d.get("old_logp", logp.detach())  # one step per rollout batch: the sampler is the current policy
        loss, metrics = grpo_token_loss(logp, old, d["ref_logp"], d["adv"], d["mask"], g.clip_eps, g.kl_coef)
        return loss, {f"grpo/{k}": v for k, v in metrics.items()}

    def state_dict(self):
        return {"buffer": [{k: v.cpu() for k, v in b.items()} for b in self.buffer]}

    def load_state_dict(self, state):
        self.buffer = [{k: v.to(self.device) for k, v in b.items()} for b in state.get("buffer", [])]


STRATEGIES = {"seq": SeqStrategy, "sft": SFTStrategy, "dpo": DPOStrategy, "grpo": GRPOStrategy}
