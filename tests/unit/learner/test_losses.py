"""GRPO loss and advantages against hand-computed values."""

import math

import pytest
import torch

from learner.train.losses import LossStats, group_advantages
from learner.train.losses import grpo_loss as grpo_loss_sums


def grpo_loss(*args, **kwargs):
    loss, sums = grpo_loss_sums(*args, **kwargs)
    return loss, LossStats.from_vector(sums)


def test_group_advantages_normalise_within_each_group():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 3.0, 3.0, 3.0]]), eps=0.0 + 1e-12)
    assert torch.allclose(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-6)
    assert torch.equal(adv[1], torch.zeros(4))  # identical rewards carry no signal


def test_truncated_importance_weights_hand_computed():
    # Two tokens; current = old policy, behaviour mu differs: pi/mu = 2 and 0.5, cap 1.5.
    logp = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_()
    behaviour = torch.log(torch.tensor([[0.25, 0.5]]))
    loss, stats = grpo_loss(logp, logp.detach(), behaviour, torch.tensor([2.0]), torch.ones(1, 2),
                            clip_eps=0.2, is_cap=1.5, total_tokens=2)
    # objective per token = w * A = [1.5 * 2, 0.5 * 2]; loss = -(3 + 1) / 2
    assert loss.item() == pytest.approx(-2.0)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.5, -0.5]]))
    assert stats.mean_is_weight == pytest.approx(1.0)
    assert stats.is_truncated_fraction == pytest.approx(0.5)
    # E_mu[log mu - log pi] over the two tokens
    assert stats.mismatch_kl == pytest.approx((math.log(0.25 / 0.5) + math.log(0.5 / 0.25)) / 2)


def test_ratio_clip_stops_gradient_only_on_the_clipped_side():
    old = torch.log(torch.tensor([[0.4]]))
    for adv, expect_grad in ((1.0, 0.0), (-1.0, 1.5)):  # ratio 1.5 > 1 + eps
        logp = torch.log(torch.tensor([[0.6]])).requires_grad_()
        loss, stats = grpo_loss(logp, old, old, torch.tensor([adv]), torch.ones(1, 1),
                                clip_eps=0.2, is_cap=10.0, total_tokens=1)
        loss.backward()
        # d(-r*A)/dlogp = -r*A = 1.5 for A = -1; clipped branch for A = +1 has no gradient
        assert logp.grad.item() == pytest.approx(expect_grad)
        assert stats.clip_fraction == 1.0
        assert loss.item() == pytest.approx(-min(1.5 * adv, 1.2 * adv))


def test_asymre_reports_nothing_clipped():
    """AsymRE has no clipping; a new user read `clip_fraction` 0.11 in its run log."""
    old = torch.log(torch.tensor([[0.4]]))
    logp = torch.log(torch.tensor([[0.6]])).requires_grad_()  # ratio 1.5, outside 1 ± 0.2
    _, stats = grpo_loss(logp, old, old, torch.tensor([1.0]), torch.ones(1, 1), clip_eps=0.2, is_cap=10.0,
                         total_tokens=1, reinforce=True)
    assert stats.clip_fraction == 0.0 and stats.mean_ratio == pytest.approx(1.5)


def test_mask_and_normaliser_over_the_whole_batch():
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, _ = grpo_loss(logp, logp.detach(), torch.zeros(2, 3), torch.tensor([1.0, -1.0]), mask,
                        clip_eps=0.2, is_cap=2.0, total_tokens=3)
    assert loss.item() == pytest.approx(-(1 + 1 - 1) / 3)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1 / 3, -1 / 3, 0.0], [1 / 3, 0.0, 0.0]]))


def test_kl_to_reference_is_zero_at_the_reference_and_positive_away():
    logp = torch.log(torch.tensor([[0.5, 0.5]]))
    zero, st0 = grpo_loss(logp, logp, logp, torch.tensor([0.0]), torch.ones(1, 2), clip_eps=0.2, is_cap=2,
                          total_tokens=2, ref_logp=logp, kl_coef=1.0)
    assert st0.kl_ref == pytest.approx(0.0)
    _, st1 = grpo_loss(logp, logp, logp, torch.tensor([0.0]), torch.ones(1, 2), clip_eps=0.2, is_cap=2,
                       total_tokens=2, ref_logp=torch.log(torch.tensor([[0.25, 0.25]])), kl_coef=1.0)
    # k3 = exp(d) - d - 1 with d = log(0.25/0.5)
    d = math.log(0.5)
    assert st1.kl_ref == pytest.approx(math.exp(d) - d - 1)


def test_learning_rate_schedules():
    from learner.train.trainer import lr_factor

    assert lr_factor(0, "constant", 0, 100, 0.1) == 1.0
    assert lr_factor(0, "linear", 10, 110, 0.1) == pytest.approx(0.1)  # warm-up from lr/10
    assert lr_factor(60, "linear", 10, 110, 0.1) == pytest.approx(0.55)
    assert lr_factor(110, "cosine", 10, 110, 0.1) == pytest.approx(0.1)
    assert lr_factor(60, "cosine", 10, 110, 0.1) == pytest.approx(0.55)


def test_asymre_is_reinforce_with_a_shifted_baseline_and_no_importance_weight():
    """∂loss/∂log π = −Â / N: the behaviour log-probs (far off π here) change nothing, nor does
    the ratio clip; the advantages are the trainer's r − (mean + δV)."""
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    adv = torch.tensor([0.6, -0.4, 0.6])
    for behaviour in (torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-9.0, -0.1, -5.0])):
        logp.grad = None
        loss, _ = grpo_loss(logp, logp.detach() - 1.0, behaviour, adv, clip_eps=0.2, is_cap=2.0, total_tokens=3,
                            reinforce=True)
        loss.backward()
        assert torch.allclose(logp.grad, -adv / 3)


def test_a_workers_mu_on_a_masked_token_cannot_make_the_loss_nan():
    """μ is the worker's word. −1000 (accepted: finite, ≤ 0, above the floor) on an environment
    token (mask 0) made exp(π_old − μ) inf there and inf · 0 a NaN: the step's loss was NaN and
    the step skipped, for one group. Where a token counts, the weight is capped as before."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = logp.detach().clone()
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    loss, sums = grpo_loss_sums(logp, old, torch.tensor([[-1.0, -1000.0, -0.5]]), torch.tensor([1.0]), mask,
                           clip_eps=0.2, is_cap=2.0, total_tokens=3)
    assert torch.isfinite(loss) and torch.isfinite(sums).all() and float(loss) == pytest.approx(-2 / 3)
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    loss, sums = grpo_loss_sums(logp, old, torch.tensor([[-1.0, -2.0, -1000.0]]), torch.tensor([1.0]), mask,
                           clip_eps=0.2, is_cap=2.0, total_tokens=3)
    assert float(loss) == pytest.approx(-(1 + 2) / 3) and float(sums[6]) == 1  # capped at 2, counted over the cap
