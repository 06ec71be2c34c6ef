"""Choosing the next token from logits, for every decoder here (the engine's steps, generate and generate_batch):
greedy (temperature 0) or temperature / top-k / top-p sampling, each row with its own settings and generator.

sample_rows: all rows of a step in one call (per-row temperature, top-k, top-p, generator), one host read of the
chosen ids by the caller; sample_next: one setting for every row (generate's case). kept_floor: what top-k and
top-p keep, decided among the CANDIDATES most likely tokens.
"""

from __future__ import annotations

import torch


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
