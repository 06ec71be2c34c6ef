"""Autoregressive sampling: greedy (temperature 0) or temperature / top-k sampling, with a KV cache.

The prompt is encoded once (prefill) and each new token costs one single-position forward against the cache
(for MLA the cache holds the compressed latent). Once the context fills max_seq_len, every step re-encodes the
last max_seq_len tokens, exactly what a model without a cache would see.
"""

from __future__ import annotations

from typing import Iterable

import torch
from tokenizers import Tokenizer

from astrai_core.model import KVCache, Transformer


@torch.no_grad()
def generate(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    stop_ids: Iterable[int] = (),
    generator: torch.Generator | None = None,
) -> list[int]:
    """The new token ids only. Stops after max_new_tokens or after emitting one of stop_ids (which is included,
    so the caller can tell a stop from a cut-off). The context is cropped to the model's max_seq_len."""
    if not prompt_ids:
        raise ValueError("generate needs at least one prompt token (e.g. the BOS id)")
    stop = set(stop_ids)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    window = model.cfg.max_seq_len
    idx = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    new: list[int] = []
    cache = KVCache()
    logits = model(idx[:, -window:], cache)[0, -1].float()  # prefill: (vocab,)
    for step in range(max_new_tokens):
        if step > 0:
            if cache.length < window:
                logits = model(idx[:, -1:], cache)[0, -1].float()  # one position against the cache
            else:  # the window is full: re-encode its last max_seq_len tokens
                cache = KVCache()
                logits = model(idx[:, -window:], cache)[0, -1].float()
        if temperature <= 0:
            next_id = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            next_id = int(torch.multinomial(probs, 1, generator=generator))
        new.append(next_id)
        if next_id in stop:
            break
        idx = torch.cat([idx, torch.tensor([[next_id]], device=device)], dim=1)
    model.train(was_training)
    return new


def generate_text(model: Transformer, tokenizer: Tokenizer, prompt: str, **kw) -> str:
    """Continuation of `prompt` (without the prompt); keyword arguments as for generate. A final stop token is
    dropped before decoding."""
    kw["stop_ids"] = stop = tuple(kw.get("stop_ids", ()))
    ids = generate(model, tokenizer.encode(prompt, add_special_tokens=False).ids, **kw)
    if ids and ids[-1] in stop:
        ids = ids[:-1]
    return tokenizer.decode(ids)
