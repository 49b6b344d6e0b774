"""The trainer uses the behaviour log-probs the worker recorded: a batch where π/μ is known."""

import math

import pytest
import torch

from echo.hf import completion_logprobs, sample
from learner.buffer import BatchInfo, Group
from learner.config import load_learner_config
from learner.trainer import Trainer


@pytest.mark.parametrize("is_cap,expected_weight,truncated", [(1.5, 1.5, 1.0), (3.0, 2.0, 0.0)])
def test_importance_weights_follow_recorded_behaviour_logprobs(tiny_model, is_cap, expected_weight, truncated):
    cfg = load_learner_config(None, ["--model.path", str(tiny_model), "--trainer.is_cap", str(is_cap),
                                     "--rollout.group_size", "4", "--trainer.batch_prompts", "2"])
    trainer = Trainer(cfg)
    tok = trainer.tokenizer
    prompts = [trainer.encode("3+4="), trainer.encode("5+5=")]
    torch.manual_seed(0)
    outs = sample(trainer.model, [p for p in prompts for _ in range(4)], max_new_tokens=4,
                  eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    with torch.no_grad():
        logp, mask = completion_logprobs(trainer.model, [p for p in prompts for _ in range(4)],
                                         [o.tokens for o in outs], pad_id=tok.pad_token_id)
    # Behaviour μ = π / 2 on every token, as if an older snapshot had generated them.
    behaviour = [(logp[i, : len(o.tokens)] - math.log(2)).tolist() for i, o in enumerate(outs)]
    groups = [Group(f"p{g}", 0, prompts[g], [o.tokens for o in outs[4 * g: 4 * g + 4]],
                    behaviour[4 * g: 4 * g + 4], [1.0, 0.0, 1.0, 0.0]) for g in range(2)]
    stats = trainer.step(BatchInfo(groups, learner_version=0, staleness=[0, 0]))
    assert stats["is_weight_mean"] == pytest.approx(expected_weight, rel=1e-4)
    assert stats["is_truncated_fraction"] == pytest.approx(truncated)
    assert stats["mismatch_kl"] == pytest.approx(-math.log(2), abs=1e-4)
    assert trainer.version == 1
