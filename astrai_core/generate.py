"""Autoregressive sampling with a KV cache: greedy (temperature 0) or temperature / top-k / top-p sampling.

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

from astrai_core.model.transformer import KVCache, Transformer, padding_mask, positions_from_mask


def sample_next(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits (B, V) -> next token ids (B,), every row with the same settings (see sample_rows)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    B = logits.shape[0]
    return sample_rows(logits, [temperature] * B, [top_k] * B, [top_p] * B, generator)


# top-k / top-p read the most likely tokens first (torch.topk: on 2 CPU cores 0.09 ms for a row of 49,152 logits,
# against 3 ms for a full sort); a row whose kept set reaches past them is sorted whole. A vocabulary of at most
# 4 x CANDIDATES is sorted whole at once (cheaper than asking twice when a nucleus is wide).
CANDIDATES = 256


def sample_rows(
    logits: torch.Tensor,
    temperature: list[float],
    top_k: list[int | None],
    top_p: list[float | None],
    generator: torch.Generator | list[torch.Generator | None] | None = None,
) -> torch.Tensor:
    """logits (B, V) -> next token ids (B,), all rows at once, row i with its own settings. Temperature 0: argmax.
    Otherwise logits / temperature, then top-k (keep the k largest, ties included), then top-p (nucleus, Holtzman et
    al. 2020: keep the smallest set of most probable tokens whose mass reaches top_p, always at least the top one,
    ties included), then one draw: an exponential race, argmax(p / E) with E ~ Exp(1) drawn per token id, which
    picks token i with probability p_i (renormalized over what the filters kept). generator: one for every row (its
    (B, V) draws in row order), or one per row (None: the global one): a seeded row's draws come from its own
    generator only, V of them a step, so its tokens do not depend on the rows beside it."""
    greedy = [t <= 0 for t in temperature]
    if all(greedy):
        return logits.argmax(dim=-1)
    dev, V = logits.device, logits.shape[-1]
    logits = logits.float() / torch.tensor([t if t > 0 else 1.0 for t in temperature], device=dev)[:, None]
    ks = [k if k is not None and k < V else V for k in top_k]
    ps = [p if p is not None and p < 1.0 else 2.0 for p in top_p]  # 2.0: a mass never reached
    if min(ks) < V or min(ps) < 2.0:
        candidates = V if V <= 4 * CANDIDATES else min(V, max([CANDIDATES, *(k for k in ks if k < V)]))
        ks_t, ps_t = torch.tensor(ks, device=dev), torch.tensor(ps, device=dev)
        floor, covered = kept_floor(logits, ks_t, ps_t, candidates, min(ks) < V)
        if candidates < V and not covered.all():
            rows = (~covered).nonzero()[:, 0]
            floor[rows] = kept_floor(logits[rows], ks_t[rows], ps_t[rows], V, min(ks) < V)[0]
        logits.masked_fill_(logits < floor, float("-inf"))
    argmax = logits.argmax(dim=-1) if any(greedy) else None
    # The race in log space, in place: log p_i - log E_i, E_i = -log(u_i) ~ Exp(1), is log p_i plus a Gumbel draw
    # (u = 0 gives -inf: never picked), and argmax ignores p's normalizer.
    noise = torch.empty_like(logits)
    if not isinstance(generator, list):
        noise.uniform_(generator=generator)
    else:  # the seeded rows one by one, the others in one call
        for row, g in zip(noise, generator):
            if g is not None:
                row.uniform_(generator=g)
        unseeded = [i for i, g in enumerate(generator) if g is None]
        if unseeded:
            noise[unseeded] = torch.rand(len(unseeded), V, device=dev)
    picked = logits.add_(noise.log_().neg_().log_().neg_()).argmax(dim=-1)
    return picked if argmax is None else torch.where(torch.tensor(greedy, device=dev), argmax, picked)


def kept_floor(logits: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor, candidates: int, any_k: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The lowest logit each row keeps after top-k (ks: V where off, at most `candidates`; any_k: some row has one)
    and top-p (ps: above 1 where off), (B, 1), found among the `candidates` most likely tokens; and whether those
    decide it, (B,): not for a top-p whose mass they do not reach (ask again with every token a candidate)."""
    V = logits.shape[-1]
    values, order = logits.topk(candidates, dim=-1)  # most likely first
    probs = torch.softmax(logits, dim=-1).gather(1, order)  # the candidates' probabilities
    floor = torch.full_like(values[:, :1], float("-inf"))
    if any_k:
        floor = values.gather(1, (ks.clamp(max=candidates) - 1)[:, None]).masked_fill((ks >= V)[:, None], float("-inf"))
        # renormalized over what top-k keeps: all among the candidates
        probs = torch.where((ks < V)[:, None], torch.softmax(values.masked_fill(values < floor, float("-inf")), -1),
                            probs)
    mass = probs.cumsum(dim=-1)
    kept = ((mass - probs) < ps[:, None]).sum(dim=-1).clamp(min=1)  # ranks whose mass before them is below top_p
    p_floor = values.gather(1, (kept - 1)[:, None]).masked_fill((ps > 1.0)[:, None], float("-inf"))
    covered = (ps > 1.0) | (mass[:, -1] >= ps) | (candidates == V)
    return torch.maximum(floor, p_floor), covered


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
