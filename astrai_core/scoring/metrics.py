"""Held-out metrics of a model: language modeling (loss and bits per character; the unigram baseline and the
intervals are statistics.py's) and the chat models' (held-out SFT loss, preference margins, answers to questions for
task accuracy and pass@k); `token_loss_total` is also what training validates with.

Bits per character (total negative log-likelihood in bits / number of characters) compares models with
different tokenizers; per-token loss does not.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from astrai_core.data.batches import Batch, Documents, PackedRows
from astrai_core.model.losses import IGNORE_INDEX, token_loss_sum
from astrai_core.runtime.device import model_device
from astrai_core.runtime.progress import advance, expect
from astrai_core.scoring.dpo_reference import reference_logps


@torch.no_grad()
def sequence_nll(model: torch.nn.Module, tokens: np.ndarray, seq_len: int, batch_size: int) -> tuple[float, int]:
    """Sum of next-token NLL (nats) over `tokens`, scored in non-overlapping windows of `seq_len` targets.

    Every token but the first is predicted exactly once. Returns (nll_sum, n_predicted).
    """
    model.eval()
    device = model_device(model)
    n = len(tokens) - 1
    starts = list(range(0, n, seq_len))
    total, count = 0.0, 0
    expect(len(starts), "test windows")
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
        advance(len(chunk))
    assert count == n, (count, n)
    return total, count


@torch.no_grad()
def continuation_logprobs(model: torch.nn.Module, context: list[int], continuations: list[list[int]]) -> list[float]:
    """log p(continuation | context) of each continuation, summed over its tokens: how a multiple-choice item is
    scored (the likeliest choice is the model's answer; lm-evaluation-harness's loglikelihood requests)."""
    model.eval()
    device = model_device(model)
    out = []
    for continuation in continuations:
        ids = torch.tensor([context + continuation], device=device)
        logp = torch.log_softmax(model(ids[:, :-1]).float()[0, -len(continuation):], dim=-1)
        out.append(logp.gather(1, ids[0, -len(continuation):, None]).sum().item())
    return out


@torch.no_grad()
def target_logprobs(model: torch.nn.Module, rows: Sequence[Sequence[int]],
                    targets: Sequence[int]) -> list[tuple[float, bool]]:
    """For each row of token ids, (summed log-probability of its last targets[i] tokens given the tokens before
    them, whether each of those is the model's greedy choice), all rows in one forward: right-padded, which the
    causal attention keeps out of every real position (lm-evaluation-harness's loglikelihood requests)."""
    model.eval()
    longest = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
    logp = torch.log_softmax(model(ids[:, :-1].to(model_device(model))).float(), dim=-1).cpu()
    out = []
    for i, (r, n) in enumerate(zip(rows, targets)):
        row_logp = logp[i, len(r) - 1 - n: len(r) - 1]  # the predictions of the last n tokens
        wanted = ids[i, len(r) - n: len(r)]
        out.append((row_logp.gather(1, wanted[:, None]).sum().item(), bool((row_logp.argmax(-1) == wanted).all())))
    return out


# ---- chat-model metrics (post-training) ---------------------------------------------------------------------

@torch.no_grad()
def token_loss_total(model: torch.nn.Module, batches: Iterable[Batch], autocast=contextlib.nullcontext()) -> torch.Tensor:
    """(summed next-token loss, target count) over `batches` as a float64 pair: validation (whose ranks then sum
    the pairs) and held-out evaluation alike. No label smoothing: a plain loss."""
    was_training = model.training
    model.eval()
    total = None
    for batch in batches:
        logits = batch.logits(model, autocast)
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
    expect(len(rows.rows), "SFT test rows")

    def batches():
        for first in range(0, len(rows.rows), batch_size):
            yield rows.batch(np.arange(first, min(first + batch_size, len(rows.rows))), model_device(model))
            advance(min(batch_size, len(rows.rows) - first))

    total, count = token_loss_total(model, batches()).tolist()
    return total / count


@torch.no_grad()
def preference_margins(model: torch.nn.Module, data_path: str, tokenizer_sha256: str) -> np.ndarray:
    """Per preference pair (dpo_*.h5): the model's summed log-probability of the chosen response minus that of the
    rejected one. A pair is right (counts toward preference accuracy) when its margin is positive."""
    logps = reference_logps(model, data_path, tokenizer_sha256)
    return logps[0::2] - logps[1::2]


@torch.no_grad()
def answer_questions(model: torch.nn.Module, chat, records: list[dict], max_new_tokens: int, *, samples: int = 1,
                     temperature: float = 0.0, seed: int = 0, rows_per_batch: int = 64) -> list[list[str]]:
    """Replies to GRPO-style questions ({"prompt", ...}): `samples` per question, greedy at temperature 0 (then one
    is enough), else sampled from the full distribution with a generator seeded by `seed`. A question's prompt's
    full KV blocks are computed once for all its samples (generate_batch's samples_per_prompt)."""
    from astrai_core.inference.generate import generate_batch

    generator = torch.Generator(model_device(model)).manual_seed(seed)
    questions_per_batch = max(1, rows_per_batch // samples)
    replies: list[list[str]] = []
    expect(len(records), "questions" if samples == 1 else f"questions ({samples} samples each)")
    for first in range(0, len(records), questions_per_batch):
        chunk = records[first: first + questions_per_batch]
        prompts = [chat.encode_prompt([{"role": "user", "content": r["prompt"]}]) for r in chunk]
        outs = generate_batch(model, prompts, max_new_tokens, temperature=temperature, stop_ids=chat.stop_ids,
                              generator=generator, samples_per_prompt=samples)
        decoded = [chat.decode_reply(o) for o in outs]
        replies += [decoded[i * samples: (i + 1) * samples] for i in range(len(chunk))]
        advance(len(chunk))
    return replies
