"""Each objective against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from astrai_core.losses import (IGNORE_INDEX, dpo_loss, full_kl_sum, group_advantages, grpo_token_loss, k3_kl,
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
    from astrai_core.losses import token_loss_sum
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
