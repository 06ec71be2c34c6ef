"""Decoding outside a server: one prompt on the model's plain path, or a batch through the serving engine.

generate: one prompt, decoded by the model's plain causal path with a KV cache (a prefill, then a single-position
forward per new token); once the context fills max_seq_len, every step re-encodes the last max_seq_len tokens,
exactly what a model without a cache would see. It is the reference the engine is checked against (a served greedy
reply equals it) and what `astrai generate` runs.

generate_batch: many prompts at once (GRPO's rollouts and validation, evaluate's tasks, lm-eval), run by the same
engine `astrai serve` runs (engine/): continuous batching over a paged KV cache, so a finished row leaves the batch
at once and a prompt's full blocks are shared by the samples that continue it, stepped here in the caller's thread
until every request is done. The whole request must fit in max_seq_len (no re-encoding window).
"""

from __future__ import annotations

from typing import Iterable

import torch
from tokenizers import Tokenizer

from astrai_core.inference.engine import Engine, EngineConfig, SamplingParams
from astrai_core.inference.sampling import sample_next
from astrai_core.model.transformer import KVCache, Transformer


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
    stop, window = set(stop_ids), model.cfg.max_seq_len
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    new: list[int] = []
    cache = None
    for _ in range(max_new_tokens):
        if cache is None or cache.length >= window:  # prefill, or the window is full: re-encode its last part
            cache = KVCache()
            logits = model(ids[:, -window:], cache)[:, -1].float()
        else:  # one position against the cache
            logits = model(ids[:, -1:], cache)[:, -1].float()
        token = int(sample_next(logits, temperature, top_k, top_p, generator))
        new.append(token)
        if token in stop:
            break
        ids = torch.cat([ids, ids.new_tensor([[token]])], dim=1)
    model.train(was_training)
    return new


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
    """The new token ids of each prompt (a stop token included, as generate returns it); greedy: generate's
    tokens for that prompt alone, but at near-ties (the engine batches rows: the last bits of a logit may differ).
    samples_per_prompt n > 1: n completions of each prompt (prompt i's are rows i * n .. i * n + n - 1). Sampled
    rows draw from generators of their own, each seeded from `generator` in row order: a row's tokens depend on
    `generator`'s state and its index, never on the other rows."""
    if not prompts or not all(prompts):
        raise ValueError("generate_batch needs at least one prompt, each with at least one token (e.g. the BOS id)")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > model.cfg.max_seq_len:
        raise ValueError(f"longest prompt ({longest}) + max_new_tokens ({max_new_tokens}) exceeds max_seq_len "
                         f"({model.cfg.max_seq_len}): shorten the prompts or ask for fewer tokens")
    if samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt must be at least 1, got {samples_per_prompt}")
    rows = [p for p in prompts for _ in range(samples_per_prompt)]
    if max_new_tokens < 1:
        return [[] for _ in rows]
    seeds = (torch.randint(2**62, (len(rows),), generator=generator, device=generator.device if generator else "cpu"
                           ).tolist() if temperature > 0 else [None] * len(rows))
    # every row at once, each at its longest with no block shared: no request ever waits or is preempted
    blocks = sum(-(-(len(p) + max_new_tokens) // EngineConfig.block_size) for p in rows)
    stop, was_training = tuple(stop_ids), model.training
    engine = Engine(model, EngineConfig(max_batch_size=len(rows), max_waiting=len(rows), kv_blocks=blocks,
                                        max_model_len=longest + max_new_tokens))
    out: list[list[int]] = [[] for _ in rows]

    def submit(row: int) -> None:
        # logprobs=0: each event's third argument lists every sampled token, a stop token included
        params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p or 1.0, top_k=top_k,
                                seed=seeds[row], stop_token_ids=stop, logprobs=0)
        engine.submit(rows[row], params, lambda tokens, reason, logprobs: out[row].extend(lp.token for lp in logprobs))

    # Each prompt's first sample, until its prompt is in the pool (its first token sampled); then the other
    # samples, which find the prompt's full blocks in the prefix cache and compute only the rest.
    firsts = range(0, len(rows), samples_per_prompt)
    try:
        for row in firsts:
            submit(row)
        while samples_per_prompt > 1 and not all(out[row] for row in firsts):
            engine.step()
        for row in range(len(rows)):
            if row % samples_per_prompt:
                submit(row)
        while engine.step():
            pass
    finally:
        model.train(was_training)
    return out


def generate_text(model: Transformer, tokenizer: Tokenizer, prompt: str, **kw) -> str:
    """Continuation of `prompt` (without the prompt); keyword arguments as for generate. A final stop token is
    dropped before decoding."""
    kw["stop_ids"] = stop = tuple(kw.get("stop_ids", ()))
    ids = generate(model, tokenizer.encode(prompt, add_special_tokens=False).ids, **kw)
    if ids and ids[-1] in stop:
        ids = ids[:-1]
    return tokenizer.decode(ids)
