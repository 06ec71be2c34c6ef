"""Autoregressive decoding with a KV cache, for one prompt or a batch (the engine serves requests; this serves the
training-time and offline callers: GRPO rollouts, evaluate, dpo_reference, `astrai generate`); the next token is
chosen by sampling.py.

One decoder (`decode`): the prompts are encoded once (prefill) and each new token costs one single-position
forward against the cache (for MLA the cache holds the compressed latent).

generate: one prompt, a batch of one. It runs on the model's plain causal path, and once the context fills
max_seq_len every step re-encodes the last max_seq_len tokens, exactly what a model without a cache would see.

generate_batch: prompts of different lengths at once. They are left-padded (pad id 0, masked out of attention,
positions counted from each row's first real token), so every row's new tokens sit in the same column and one
forward per step serves all rows. The whole request must fit in max_seq_len (no re-encoding window). Several
samples of one prompt (samples_per_prompt, e.g. for pass@k) share its prefill: the prompt is encoded once and its
KV cache copied into each sample's row.
"""

from __future__ import annotations

from typing import Iterable

import torch
from tokenizers import Tokenizer

from astrai_core.inference.sampling import sample_next
from astrai_core.model.transformer import KVCache, Transformer, padding_mask, positions_from_mask


@torch.no_grad()
def decode(model: Transformer, prompts: list[list[int]], max_new_tokens: int, temperature: float,
           top_k: int | None, top_p: float | None, stop_ids: Iterable[int], generator: torch.Generator | None,
           padded: bool, samples_per_prompt: int = 1) -> list[list[int]]:
    """The new token ids of each prompt. A row stops after max_new_tokens or after emitting one of stop_ids (which
    is included, so the caller can tell a stop from a cut-off); finished rows are still fed, their tokens ignored,
    until every row is done. padded: left padding masked out of attention (a batch; it must fit max_seq_len);
    else the rows share one length and a full context re-encodes its last max_seq_len tokens.
    samples_per_prompt (padded only): rows i * n .. i * n + n - 1 continue prompt i from its one prefill."""
    assert padded or samples_per_prompt == 1
    stop = set(stop_ids)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    window, longest = model.cfg.max_seq_len, max(len(p) for p in prompts)
    B = len(prompts) * samples_per_prompt  # rows after the prefill
    ids = torch.zeros(len(prompts), longest, dtype=torch.long, device=device)  # pad id 0, never attended to
    valid = torch.zeros(len(prompts), longest, dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):] = torch.tensor(p, dtype=torch.long)
        valid[i, longest - len(p):] = True
    new: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    cache = None
    for _ in range(max_new_tokens):
        if padded and cache is None:  # prefill, positions counted from each row's first real token
            cache, positions = KVCache(), positions_from_mask(valid)
            logits = model(ids, cache, positions=positions, mask=padding_mask(valid, longest))[:, -1].float()
            positions = positions[:, -1:]  # (B, 1): each row's last position
            if samples_per_prompt > 1:  # each prompt's cache (batch dim 0) and last logits serve all its samples
                cache.layers = {layer: tuple(t.repeat_interleave(samples_per_prompt, dim=0) for t in kept)
                                for layer, kept in cache.layers.items()}
                logits, positions, valid = (t.repeat_interleave(samples_per_prompt, dim=0)
                                            for t in (logits, positions, valid))
        elif padded:
            valid, positions = torch.cat([valid, valid.new_ones(B, 1)], dim=1), positions + 1
            logits = model(next_ids[:, None], cache, positions=positions, mask=padding_mask(valid, 1))[:, -1].float()
        elif cache is None or cache.length >= window:  # prefill, or the window is full: re-encode its last part
            cache = KVCache()
            logits = model(ids[:, -window:], cache)[:, -1].float()
        else:  # one position against the cache
            logits = model(next_ids[:, None], cache)[:, -1].float()
        next_ids = sample_next(logits, temperature, top_k, top_p, generator)
        for i, t in enumerate(next_ids.tolist()):
            if not done[i]:
                new[i].append(t)
                done[i] = t in stop
        if all(done):
            break
        if not padded:
            ids = torch.cat([ids, next_ids[:, None]], dim=1)
    model.train(was_training)
    return new


@torch.no_grad()
def generate(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_ids: Iterable[int] = (),
    generator: torch.Generator | None = None,
) -> list[int]:
    """The new token ids only. Stops after max_new_tokens or after emitting one of stop_ids (which is included,
    so the caller can tell a stop from a cut-off). The context is cropped to the model's max_seq_len."""
    if not prompt_ids:
        raise ValueError("generate needs at least one prompt token (e.g. the BOS id)")
    return decode(model, [list(prompt_ids)], max_new_tokens, temperature, top_k, top_p, stop_ids, generator,
                  padded=False)[0]


@torch.no_grad()
def generate_batch(
    model: Transformer,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_ids: Iterable[int] = (),
    generator: torch.Generator | None = None,
    samples_per_prompt: int = 1,
) -> list[list[int]]:
    """The new token ids of each prompt, as generate would return them for that prompt alone (greedy: the same
    tokens). samples_per_prompt n > 1: n completions of each prompt (prompt i's are rows i * n .. i * n + n - 1),
    its prompt encoded once."""
    if not prompts or not all(prompts):
        raise ValueError("generate_batch needs at least one prompt, each with at least one token (e.g. the BOS id)")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > model.cfg.max_seq_len:
        raise ValueError(f"longest prompt ({longest}) + max_new_tokens ({max_new_tokens}) exceeds max_seq_len "
                         f"({model.cfg.max_seq_len}): shorten the prompts or ask for fewer tokens")
    if samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt must be at least 1, got {samples_per_prompt}")
    return decode(model, prompts, max_new_tokens, temperature, top_k, top_p, stop_ids, generator, padded=True,
                  samples_per_prompt=samples_per_prompt)


def generate_text(model: Transformer, tokenizer: Tokenizer, prompt: str, **kw) -> str:
    """Continuation of `prompt` (without the prompt); keyword arguments as for generate. A final stop token is
    dropped before decoding."""
    kw["stop_ids"] = stop = tuple(kw.get("stop_ids", ()))
    ids = generate(model, tokenizer.encode(prompt, add_special_tokens=False).ids, **kw)
    if ids and ids[-1] in stop:
        ids = ids[:-1]
    return tokenizer.decode(ids)
