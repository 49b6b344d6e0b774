"""The KL term stays finite when a sampled token leaves π_θ's top-p nucleus after the first
optimizer step of a batch (log π_θ = −inf while π_old and the reference give it mass)."""

import math

import torch

from learner.train.losses import LossStats, grpo_loss


def test_a_token_outside_the_current_nucleus_is_left_out_of_the_kl_and_counted():
    logits = torch.tensor([[0.1, -0.2, 0.3]], requires_grad=True)
    logp = torch.log_softmax(logits, dim=-1)
    logp = torch.where(torch.tensor([[False, True, False]]), torch.full_like(logp, -math.inf), logp)
    old = torch.tensor([[-1.0, -1.2, -0.9]])
    behaviour = torch.tensor([[-1.1, -1.3, -0.8]])
    ref = torch.tensor([[-1.0, -1.0, -1.0]])
    loss, sums = grpo_loss(logp, old, behaviour, torch.tensor([1.0]), torch.ones(1, 3), clip_eps=0.2, is_cap=2.0,
                           total_tokens=3, ref_logp=ref, kl_coef=0.1)
    loss.backward()
    stats = LossStats.from_vector(sums)
    assert math.isfinite(loss.item()) and torch.isfinite(logits.grad).all()
    assert math.isfinite(stats.kl_ref) and stats.kl_ref > 0
    assert stats.kl_excluded == 1.0 and stats.tokens == 3.0
