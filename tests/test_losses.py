"""Each objective against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from astrai_core.model.losses import (IGNORE_INDEX, dpo_loss, full_kl_sum, group_advantages, grpo_token_loss, k3_kl,
                                      sequence_logps, token_logps)


def test_token_logps_and_sequence_logps_skip_masked_targets():
    logits = torch.log(torch.tensor([[[0.5, 0.5], [0.25, 0.75], [0.9, 0.1]]]))  # probabilities per position
    targets = torch.tensor([[0, 1, IGNORE_INDEX]])
    expected = [math.log(0.5), math.log(0.75), 0.0]
    assert token_logps(logits, targets)[0].tolist() == pytest.approx(expected)
    assert sequence_logps(logits, targets).item() == pytest.approx(math.log(0.5) + math.log(0.75))


PAIR = dict(policy_chosen=torch.tensor([-1.0]), policy_rejected=torch.tensor([-2.0]),
            ref_chosen=torch.tensor([-1.5]), ref_rejected=torch.tensor([-1.5]))  # margin h = 0.5 - (-0.5) = 1


def test_dpo_sigmoid_by_hand():
    loss, r_c, r_r = dpo_loss(**PAIR, beta=0.5)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-0.5)))  # -log sigmoid(0.5 * 1)
    assert (r_c.item(), r_r.item()) == pytest.approx((0.25, -0.25))


def test_dpo_conservative_and_ipo_by_hand():
    loss, _, _ = dpo_loss(**PAIR, beta=0.5, kind="conservative", label_smoothing=0.1)
    assert loss.item() == pytest.approx(0.9 * math.log1p(math.exp(-0.5)) + 0.1 * math.log1p(math.exp(0.5)))
    loss, _, _ = dpo_loss(**PAIR, beta=0.25, kind="ipo")
    assert loss.item() == pytest.approx((1 - 1 / (2 * 0.25)) ** 2)  # (h - 1/(2 beta))^2 = (1 - 2)^2
    with pytest.raises(ValueError, match="unknown DPO loss"):
        dpo_loss(**PAIR, beta=0.5, kind="hinge?")


def test_dpo_gradient_raises_chosen_and_lowers_rejected():
    pc, pr = torch.tensor([-1.0], requires_grad=True), torch.tensor([-2.0], requires_grad=True)
    loss, _, _ = dpo_loss(pc, pr, PAIR["ref_chosen"], PAIR["ref_rejected"], beta=0.5)
    loss.sum().backward()
    s = 1 / (1 + math.exp(0.5))  # sigmoid(-beta h)
    assert (pc.grad.item(), pr.grad.item()) == pytest.approx((-0.5 * s, 0.5 * s))


def test_dpo_nll_term_by_hand():
    # RPO: + nll_coef * the chosen reply's per-token NLL; the chosen one's gradient grows by nll_coef / tokens
    pc = torch.tensor([-1.0], requires_grad=True)
    loss, _, _ = dpo_loss(pc, PAIR["policy_rejected"], PAIR["ref_chosen"], PAIR["ref_rejected"], beta=0.5,
                          nll_coef=2.0, chosen_tokens=torch.tensor([4]))
    assert loss.item() == pytest.approx(math.log1p(math.exp(-0.5)) + 2.0 * 1.0 / 4)
    loss.sum().backward()
    assert pc.grad.item() == pytest.approx(-0.5 / (1 + math.exp(0.5)) - 2.0 / 4)


def test_group_advantages_by_hand():
    adv = group_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]), group_size=2)
    std = math.sqrt(0.5)  # sample std of (1, 0)
    assert adv.tolist() == pytest.approx([0.5 / (std + 1e-4), -0.5 / (std + 1e-4), 0.0, 0.0])


def test_k3_kl_by_hand():
    kl = k3_kl(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)]))
    assert kl.item() == pytest.approx(0.5 - math.log(0.5) - 1)  # r - log r - 1, r = 0.25 / 0.5
    assert k3_kl(torch.tensor([-1.3]), torch.tensor([-1.3])).item() == 0.0


def test_grpo_token_loss_clips_the_ratio_and_adds_kl():
    old = torch.log(torch.tensor([[0.2, 0.2]]))
    logp = old + math.log(1.5)  # ratio 1.5 on both tokens
    mask = torch.tensor([[1, 0]])  # only the first token is a completion token
    loss, m = grpo_token_loss(logp, old, logp, torch.tensor([1.0]), mask, clip_eps=0.2, kl_coef=0.0)
    assert loss.item() == pytest.approx(-1.2)  # min(1.5 * 1, 1.2 * 1)
    assert m["clip_fraction"].item() == 1.0
    loss, _ = grpo_token_loss(logp, old, logp, torch.tensor([-1.0]), mask, clip_eps=0.2, kl_coef=0.0)
    assert loss.item() == pytest.approx(1.5)  # min(-1.5, -1.2): the pessimistic bound
    ref = old  # reference = old policy: k3 with r = 0.2 / 0.3
    loss, m = grpo_token_loss(logp, old, ref, torch.tensor([1.0]), mask, clip_eps=0.2, kl_coef=0.5)
    r = 0.2 / 0.3
    assert m["kl"].item() == pytest.approx(r - math.log(r) - 1)
    assert loss.item() == pytest.approx(-1.2 + 0.5 * (r - math.log(r) - 1))


def test_grpo_clip_higher_clips_at_the_high_bound_and_not_before():
    """DAPO clip-higher: with a positive advantage the gradient stops beyond 1 + clip_eps_high, not at
    1 + clip_eps; the low bound stays 1 - clip_eps; clip_fraction counts against the asymmetric bounds."""
    old = torch.log(torch.tensor([[0.2]]))
    mask = torch.tensor([[1]])

    def grad(ratio: float, adv: float, high: float | None) -> tuple[float, float]:
        logp = (old + math.log(ratio)).requires_grad_(True)
        loss, m = grpo_token_loss(logp, old, logp.detach(), torch.tensor([adv]), mask, clip_eps=0.2, kl_coef=0.0,
                                  clip_eps_high=high)
        loss.backward()
        return logp.grad.item(), m["clip_fraction"].item()

    assert grad(1.25, 1.0, 0.28) == pytest.approx((-1.25, 0.0))  # between 1 + 0.2 and 1 + 0.28: still learns
    assert grad(1.25, 1.0, None) == (0.0, 1.0)  # symmetric: clipped at 1.2
    assert grad(1.3, 1.0, 0.28) == (0.0, 1.0)  # beyond 1 + 0.28: clipped
    assert grad(0.75, -1.0, 0.28) == (0.0, 1.0)  # the low bound is still 1 - clip_eps
    assert grad(0.85, -1.0, 0.28) == pytest.approx((0.85, 0.0))
    logp = old + math.log(1.3)
    loss, _ = grpo_token_loss(logp, old, logp, torch.tensor([1.0]), mask, clip_eps=0.2, kl_coef=0.0, clip_eps_high=0.28)
    assert loss.item() == pytest.approx(-1.28)  # min(1.3 * 1, 1.28 * 1)


def test_group_advantages_without_scaling_are_reward_minus_group_mean():
    """Dr. GRPO: scale=False leaves out the division by the group's std, exactly r - mean."""
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 3.0, 3.0, 3.0, 3.0])
    adv = group_advantages(rewards, group_size=4, scale=False)
    assert adv.tolist() == [0.5625, -0.4375, 0.0625, -0.1875, 0.0, 0.0, 0.0, 0.0]
    assert not torch.equal(group_advantages(rewards, group_size=4), adv)  # the default still divides


def test_grpo_defaults_are_todays_formula_bit_for_bit():
    """The DAPO / Dr. GRPO options left at their defaults compute exactly what the objective computed before they
    existed: the same loss, gradient, metrics and advantages, to the bit."""
    g = torch.Generator().manual_seed(0)
    logp = (torch.randn(12, 16, generator=g) * 0.3 - 2).requires_grad_(True)
    old = logp.detach() + torch.randn(12, 16, generator=g) * 0.3  # ratios well beyond both clip bounds
    ref = logp.detach() + torch.randn(12, 16, generator=g) * 0.1
    mask = torch.rand(12, 16, generator=g) > 0.3
    rewards = torch.rand(12, generator=g).round()

    r = rewards.view(-1, 3)  # before: (r - mean) / (std + eps)
    expected_adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).flatten()
    adv = group_advantages(rewards, group_size=3)
    assert torch.equal(adv, expected_adv)

    ratio = torch.exp(logp - old)  # before: symmetric clipping, clip_fraction |ratio - 1| > eps
    a = expected_adv.unsqueeze(1)
    surrogate = torch.minimum(ratio * a, torch.clamp(ratio, 1 - 0.2, 1 + 0.2) * a)
    expected = ((-surrogate + 0.04 * k3_kl(logp, ref)) * mask.float()).sum()
    expected_clipped = ((((ratio - 1).abs() > 0.2).float()) * mask.float()).sum()
    (expected_grad,) = torch.autograd.grad(expected, logp)
    loss, m = grpo_token_loss(logp, old, ref, adv, mask, clip_eps=0.2, kl_coef=0.04)
    (grad,) = torch.autograd.grad(loss, logp)
    assert 0 < expected_clipped < mask.sum()
    assert torch.equal(loss, expected) and torch.equal(grad, expected_grad)
    assert torch.equal(m["clip_fraction"], expected_clipped)
    # The data can tell: another upper bound, or unscaled advantages, give another loss.
    assert not torch.equal(grpo_token_loss(logp, old, ref, adv, mask, 0.2, 0.04, clip_eps_high=0.28)[0], expected)
    assert not torch.equal(group_advantages(rewards, group_size=3, scale=False), expected_adv)


def test_full_kl_by_hand_and_its_gradient_pulls_toward_the_reference():
    logits = torch.log(torch.tensor([[[0.5, 0.5]]])).requires_grad_(True)
    ref = torch.log(torch.tensor([[[0.25, 0.75]]]))
    kl = full_kl_sum(logits, ref, torch.tensor([[0]]))
    assert kl.item() == pytest.approx(0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75))
    kl.backward()
    assert logits.grad[0, 0, 1] < 0 < logits.grad[0, 0, 0]  # raise token 1 (the reference prefers it)
    # Masked positions contribute nothing; identical distributions give exactly 0.
    assert full_kl_sum(logits, ref, torch.tensor([[IGNORE_INDEX]])).item() == 0.0
    assert full_kl_sum(ref, ref, torch.tensor([[0]])).item() == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_token_loss_sum_matches_cross_entropy_value_and_gradient(label_smoothing):
    from astrai_core.model.losses import token_loss_sum
    import torch.nn.functional as F

    torch.manual_seed(0)
    logits = torch.randn(3, 700, 50, requires_grad=True)  # > one chunk of rows
    targets = torch.randint(0, 50, (3, 700))
    targets[0, :100] = IGNORE_INDEX
    ours = token_loss_sum(logits, targets, label_smoothing)
    (g_ours,) = torch.autograd.grad(2.5 * ours, logits)
    ref = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum",
                          label_smoothing=label_smoothing)
    (g_ref,) = torch.autograd.grad(2.5 * ref, logits)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # evaluation: the loss alone, the same number
        torch.testing.assert_close(token_loss_sum(logits, targets, label_smoothing), ours.detach())
