"""The training objectives as pure functions of tensors (tests/test_losses.py checks each against hand-computed
values). They return sums, never means: the training loop divides by the step's unit count (target tokens,
pairs, completion tokens) over every micro-step and rank, so batching never changes the gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # a target with this id is masked: no loss, not counted
CHUNKED_DEVICES = ("cpu",)  # where token_loss_sum walks the logits in cache-sized chunks (eagerly): faster there


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token loss over targets != ignore_index. logits (..., V), targets (...); computed in fp32 (the
    tests' reference; training sums token_loss_sum over its tokens instead)."""
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=ignore_index)


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Sum of next-token cross-entropy over targets != IGNORE_INDEX, in fp32: F.cross_entropy(logits.float(),
    reduction="sum", label_smoothing=...). logits (..., V), targets (...).

    On the CPU, eagerly, _CrossEntropySum below computes it in cache-sized chunks (1.8x faster in bf16 at vocab
    2,048 to 32,768, 2 cores). Elsewhere it is F.cross_entropy in one pass over every row: on a GPU the chunks'
    small kernels made the step launch-bound (1,024 chunks of ten kernels a step at vocab 32,768, 86 % of the
    step's time), and under torch.compile inductor fuses the one pass into a few kernels (a Python loop inside an
    autograd Function it cannot)."""
    if logits.device.type in CHUNKED_DEVICES and not torch.compiler.is_compiling():
        return _CrossEntropySum.apply(logits, targets, IGNORE_INDEX, label_smoothing)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum", label_smoothing=label_smoothing)


class _CrossEntropySum(torch.autograd.Function):
    """Summed cross-entropy in fp32 with its gradient, softmax - target distribution, computed in the same pass
    over the logits and stored in their dtype. F.cross_entropy on logits.float() instead keeps an fp32 copy of
    the logits and an fp32 log-softmax, and the backward makes two more passes (log-softmax backward, the cast
    back to bf16). The stored gradient is scaled by the incoming one after rounding, so bf16 gradients may
    differ from F.cross_entropy's by one rounding. Rows go in chunks of about 1 MB of fp32 so the temporaries
    stay in cache (2x faster than the whole (B*T, V) at once, vocab 2048)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                label_smoothing: float) -> torch.Tensor:
        flat, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        n, V = flat.shape
        need_grad = ctx.needs_input_grad[0]  # False under no_grad (evaluation): only the loss is computed
        grad = torch.empty_like(flat) if need_grad else None
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        rows = max(16, (1 << 18) // V)
        for i in range(0, n, rows):
            z = flat[i : i + rows].to(torch.float32, copy=True)
            valid = targets[i : i + rows] != ignore_index
            t = torch.where(valid, targets[i : i + rows], 0).unsqueeze(-1)
            lse = torch.logsumexp(z, dim=-1, keepdim=True)
            loss = lse - z.gather(-1, t)  # -log p(target)
            if label_smoothing:  # as F.cross_entropy: (1 - e) * nll + e * mean over the vocabulary of -log p
                loss = (1 - label_smoothing) * loss + label_smoothing * (lse - z.mean(dim=-1, keepdim=True))
            total += torch.where(valid, loss.squeeze(-1), 0.0).sum()
            if not need_grad:
                continue
            p = z.sub_(lse).exp_()  # softmax
            if label_smoothing:
                p.sub_(label_smoothing / V)
            p.scatter_add_(-1, t, p.new_full(t.shape, label_smoothing - 1.0))
            grad[i : i + rows] = p.masked_fill_(~valid.unsqueeze(-1), 0.0)
        ctx.save_for_backward(grad)
        ctx.shape = logits.shape
        return total

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (grad,) = ctx.saved_tensors
        return (grad * g).view(ctx.shape), None, None, None


def token_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per position, fp32, 0 where the target is IGNORE_INDEX. logits (B, T, V), targets (B, T)."""
    valid = targets != IGNORE_INDEX
    logp = torch.gather(F.log_softmax(logits.float(), dim=-1), -1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return logp * valid


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B,) summed log-probability of each row's unmasked targets: padding and prompt tokens carry
    IGNORE_INDEX and so never count."""
    return token_logps(logits, targets).sum(-1)


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float, kind: str = "sigmoid",
             label_smoothing: float = 0.0, nll_coef: float = 0.0,
             chosen_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair DPO losses and the implicit rewards (beta * log-ratio to the reference) of chosen and rejected.

    h = (pi_c - ref_c) - (pi_r - ref_r), the margin of the log-ratios.
    sigmoid (Rafailov et al. 2023): -log sigmoid(beta h)
    conservative (label-smoothed, cDPO): -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
    ipo (Azar et al. 2023): (h - 1 / (2 beta))^2
    nll_coef > 0 adds nll_coef * -pi_c / chosen_tokens, the chosen reply's per-token NLL (RPO, Pang et al. 2024):
    DPO alone can lower the chosen reply's probability as long as the rejected one falls faster.
    """
    h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    if kind == "sigmoid":
        loss = -F.logsigmoid(beta * h)
    elif kind == "conservative":
        loss = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif kind == "ipo":
        loss = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss {kind!r}: sigmoid, conservative or ipo")
    if nll_coef:
        loss = loss - nll_coef * policy_chosen / chosen_tokens
    rewards_chosen = beta * (policy_chosen - ref_chosen).detach()
    rewards_rejected = beta * (policy_rejected - ref_rejected).detach()
    return loss, rewards_chosen, rewards_rejected


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4, scale: bool = True) -> torch.Tensor:
    """GRPO advantages (r - mean) / (std + eps) within each group of `group_size` consecutive completions of one
    prompt (sample std, as DeepSeekMath). A group whose rewards are all equal gets zero advantage: no signal.
    scale=False leaves out the division, r - mean (Dr. GRPO, Liu et al. 2025: dividing by the std weighs the
    groups whose rewards barely differ, too easy or too hard prompts, the most)."""
    r = rewards.view(-1, group_size)
    centred = r - r.mean(1, keepdim=True)
    return (centred / (r.std(1, keepdim=True) + eps) if scale else centred).flatten()


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens (Schulman's k3): r - log r - 1 with
    r = p_ref / p_policy. Non-negative, unbiased, low variance."""
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1


def grpo_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, clip_eps: float, kl_coef: float,
                    clip_eps_high: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Summed GRPO loss over completion tokens (mask 1) and metric sums.

    Per token: -min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A) + kl_coef * k3(policy, reference), with
    ratio = p_policy / p_old (old: the policy that sampled the completion), A the completion's advantage and
    eps_high = clip_eps_high, or clip_eps when None (symmetric). A higher upper bound is DAPO's clip-higher (Yu et
    al. 2025): an unlikely token with a positive advantage may grow further before its gradient stops.
    logp, old_logp, ref_logp, mask: (N, T); advantages: (N,). The caller divides by the step's completion tokens
    (token-level normalization, as DAPO: long completions weigh by their length, not per sequence). clip_fraction
    counts the tokens whose ratio lies outside [1 - eps, 1 + eps_high]."""
    high = clip_eps if clip_eps_high is None else clip_eps_high
    mask = mask.float()
    adv = advantages.unsqueeze(1)
    ratio = torch.exp(logp - old_logp)
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + high) * adv)
    kl = k3_kl(logp, ref_logp)
    loss = ((-surrogate + kl_coef * kl) * mask).sum()
    clipped = ((ratio - 1 > high) | (ratio - 1 < -clip_eps)).float()
    return loss, {"kl": (kl.detach() * mask).sum(), "clip_fraction": (clipped * mask).sum()}


def full_kl_sum(logits: torch.Tensor, ref_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum over unmasked positions of KL(p_policy || p_ref) between the full next-token distributions.

    This is the real divergence of the two distributions, whose gradient pulls every token's probability toward
    the reference. (Policy loss minus the detached reference loss is not a KL: its gradient is the plain LM
    gradient, only rescaled.)"""
    logp, ref_logp = F.log_softmax(logits.float(), -1), F.log_softmax(ref_logits.float(), -1)
    kl = (logp.exp() * (logp - ref_logp)).sum(-1)
    return (kl * (targets != IGNORE_INDEX)).sum()
