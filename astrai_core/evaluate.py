"""Held-out metrics: language modeling (loss, perplexity and bits per character, with a unigram baseline) and the
chat models' (held-out SFT loss, preference accuracy, task accuracy); `forward` and `token_loss_total` are also
what training validates with.

Bits per character (total negative log-likelihood in bits / number of characters) compares models with
different tokenizers; per-token loss does not.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterable

import numpy as np
import torch
import torch.nn.functional as F

from astrai_core.data import Batch, Documents, PackedRows
from astrai_core.dpo_reference import reference_logps
from astrai_core.losses import IGNORE_INDEX, token_loss_sum


@torch.no_grad()
def sequence_nll(model: torch.nn.Module, tokens: np.ndarray, seq_len: int, batch_size: int,
                 device: str | torch.device = "cpu") -> tuple[float, int]:
    """Sum of next-token NLL (nats) over `tokens`, scored in non-overlapping windows of `seq_len` targets.

    Every token but the first is predicted exactly once. Returns (nll_sum, n_predicted).
    """
    model.eval()
    n = len(tokens) - 1
    starts = list(range(0, n, seq_len))
    total, count = 0.0, 0
    for i in range(0, len(starts), batch_size):
        chunk = starts[i:i + batch_size]
        length = min(seq_len, n - chunk[0])  # windows in a batch share a length; the last one may be short
        rows = [s for s in chunk if s + length <= n]
        x = torch.stack([torch.from_numpy(tokens[s:s + length].astype(np.int64)) for s in rows]).to(device)
        y = torch.stack([torch.from_numpy(tokens[s + 1:s + 1 + length].astype(np.int64)) for s in rows]).to(device)
        logits = model(x).float()
        total += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        count += y.numel()
        for s in chunk[len(rows):]:  # the final short window, scored alone
            x = torch.from_numpy(tokens[s:n].astype(np.int64))[None].to(device)
            y = torch.from_numpy(tokens[s + 1:n + 1].astype(np.int64))[None].to(device)
            total += F.cross_entropy(model(x).float()[0], y[0], reduction="sum").item()
            count += y.numel()
    assert count == n, (count, n)
    return total, count


def unigram_nll(tokens: np.ndarray, vocab_size: int) -> tuple[float, int]:
    """NLL (nats) of tokens[1:] under their own unigram distribution: the best any unigram model can do."""
    targets = tokens[1:]
    counts = np.bincount(targets, minlength=vocab_size).astype(np.float64)
    probs = counts / counts.sum()
    nz = counts > 0
    return float(-(counts[nz] * np.log(probs[nz])).sum()), int(len(targets))


def summarize(nll: float, n_tokens: int, n_chars: int) -> dict[str, float]:
    loss = nll / n_tokens
    return {"loss": loss, "perplexity": math.exp(loss), "bits_per_char": nll / math.log(2) / n_chars}


# ---- chat-model metrics (post-training) ---------------------------------------------------------------------

def forward(model: torch.nn.Module, batch: Batch, autocast=contextlib.nullcontext()) -> torch.Tensor:
    """The model's logits of a batch: the one forward of training, validation and evaluation."""
    with autocast:
        return model(batch.x, positions=batch.positions, mask=batch.mask)


@torch.no_grad()
def token_loss_total(model: torch.nn.Module, batches: Iterable[Batch], autocast=contextlib.nullcontext()) -> torch.Tensor:
    """(summed next-token loss, target count) over `batches` as a float64 pair: validation (whose ranks then sum
    the pairs) and held-out evaluation alike. No label smoothing: a plain loss."""
    was_training = model.training
    model.eval()
    total = None
    for batch in batches:
        logits = forward(model, batch, autocast)
        y = batch.data["y"]
        pair = torch.stack([token_loss_sum(logits, y).double(), (y != IGNORE_INDEX).sum().double()])
        total = pair if total is None else total + pair
    model.train(was_training)
    return total


@torch.no_grad()
def masked_token_loss(model: torch.nn.Module, data_path: str, tokenizer_sha256: str, seq_len: int,
                      batch_size: int = 16) -> float:
    """Mean loss (nats) per target token of a conversation file (sft_*.h5): assistant tokens only, conversations
    packed and attention-blocked exactly as SFT trains."""
    rows = PackedRows(Documents(data_path, tokenizer_sha256, model.cfg.vocab_size), seq_len)
    batches = (rows.batch(np.arange(first, min(first + batch_size, len(rows.rows))), torch.device("cpu"))
               for first in range(0, len(rows.rows), batch_size))
    total, count = token_loss_total(model, batches).tolist()
    return total / count


@torch.no_grad()
def preference_accuracy(model: torch.nn.Module, data_path: str, tokenizer_sha256: str) -> dict[str, float]:
    """On preference pairs (dpo_*.h5): the share where the model gives the chosen response a higher summed
    log-probability than the rejected one, and the mean log-probability margin."""
    logps = reference_logps(model, data_path, tokenizer_sha256)
    margin = logps[0::2] - logps[1::2]
    return {"preference_accuracy": float((margin > 0).mean()), "preference_margin": float(margin.mean())}


@torch.no_grad()
def task_accuracy(model: torch.nn.Module, chat, records: list[dict], max_new_tokens: int,
                  batch_size: int = 32) -> tuple[dict[str, float], list[str]]:
    """Greedy replies to GRPO-style questions: the share exactly right and the share naming a listed option.
    Returns (metrics, replies)."""
    from astrai_core.generate import generate_batch
    from astrai_core.rewards import exact_answer, valid_option

    replies = []
    for i in range(0, len(records), batch_size):
        chunk = records[i : i + batch_size]
        prompts = [chat.encode_prompt([{"role": "user", "content": r["prompt"]}]) for r in chunk]
        outs = generate_batch(model, prompts, max_new_tokens, stop_ids=chat.stop_ids)
        replies += [chat.decode_reply(o) for o in outs]
    exact = [exact_answer(c, r) for c, r in zip(replies, records)]
    valid = [valid_option(c, r) for c, r in zip(replies, records)]
    return {"task_accuracy": float(np.mean(exact)), "valid_answer_rate": float(np.mean(valid))}, replies
