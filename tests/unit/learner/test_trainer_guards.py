"""What a non-finite number can do to a run, and what the trainer does instead: the KL stays
finite at top-p 0.9 with two minibatches, and a step whose gradient norm is not finite is
skipped and counted, never applied (NaN weights would be published to every worker)."""

import math

import torch
from dist_trainer import synthetic_batch

from learner.config import load_learner_config
from learner.train.trainer import Trainer


def _trainer(model, *overrides):
    return Trainer(load_learner_config(None, ["--model.path", str(model), "--rollout.group_size", "4",
                                               "--trainer.batch_prompts", "4", *overrides]))


def test_kl_stays_finite_at_top_p_with_minibatches(tiny_model):
    trainer = _trainer(tiny_model, "--rollout.top_p", "0.9", "--trainer.minibatches", "2",
                       "--trainer.kl_coef", "0.1", "--trainer.lr", "3e-3")
    for step in range(6):
        stats = trainer.step(synthetic_batch(step, trainer.vocab_size))
        assert math.isfinite(stats["loss"]) and math.isfinite(stats["kl_ref"]), stats
    assert stats["skipped_steps"] == 0
    assert all(torch.isfinite(p).all() for p in trainer.policy.parameters())


def test_a_non_finite_gradient_skips_the_step_and_is_counted(tiny_model):
    trainer = _trainer(tiny_model)
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    first = next(p for p in trainer.policy.parameters() if p.requires_grad)
    hook = first.register_hook(lambda grad: torch.full_like(grad, math.nan))
    stats = trainer.step(synthetic_batch(0, trainer.vocab_size))
    assert stats["skipped_steps"] == 1 and not math.isfinite(stats["grad_norm"])
    assert all(torch.equal(p.detach(), before[n]) for n, p in trainer.policy.named_parameters())
    hook.remove()
    stats = trainer.step(synthetic_batch(1, trainer.vocab_size))
    assert stats["skipped_steps"] == 1 and math.isfinite(stats["grad_norm"])
    assert any(not torch.equal(p.detach(), before[n]) for n, p in trainer.policy.named_parameters())
