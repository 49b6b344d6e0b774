"""What a non-finite number can do to a run, and what the trainer does instead: the KL stays
finite at top-p 0.9 with two minibatches, and a step whose gradient norm is not finite is
skipped and counted, never applied (NaN weights would be published to every worker)."""

import math

import pytest
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


def test_the_held_eval_copy_tells_greedy_answers_from_written_ones(tiny_model):
    """Eval answers are checked on the learner: one teacher-forced pass under the version being
    evaluated. The model's own greedy completions sit on the argmax (gap 0); a completion the
    worker wrote itself (here: every answer replaced by another) does not."""
    from echo.hf import sample

    trainer = _trainer(tiny_model)
    tok = trainer.tokenizer
    prompts = [trainer.episodes.chat(f"{a}+{b}=") for a, b in ((3, 4), (5, 2), (1, 8), (6, 0), (2, 2), (4, 4))]
    outs = sample(trainer.hf, prompts, max_new_tokens=4, stop_ids=tok.eos_token_id, pad_id=tok.pad_token_id,
                  temperature=0.0)
    greedy = [o.tokens for o in outs]
    assert trainer.hold_for_eval() == 0
    for step in range(3):  # training goes on; the copy keeps version 0
        trainer.step(synthetic_batch(step, trainer.vocab_size))
    honest = trainer.greedy_gaps(prompts, greedy)
    assert max(honest) < 1e-3, honest
    digits = [tok.convert_tokens_to_ids(d) for d in "0123456789"]
    forged = [[next(d for d in digits if d != c[0])] + c[1:] for c in greedy]  # another first digit
    assert min(trainer.greedy_gaps(prompts, forged)) > 0.05


def test_in_lora_mode_the_held_eval_version_is_its_adapter_swapped_in_not_a_second_base(tiny_model):
    """LoRA: the version evaluated is its adapter. The eval check held a whole second base for it
    (15 GiB of an 8B run's 47 on one GPU); it now keeps the adapter and swaps it into the policy.
    After training has moved the policy's greedy answers, the held version's answers still sit
    on its argmax, the trained adapter is back in place, and no second model exists."""
    from echo.hf import sample
    from learner.train.lora import adapter_parameters

    trainer = _trainer(tiny_model, "--trainer.lora", "{rank = 4, alpha = 16}", "--trainer.lr", "0.05")
    tok = trainer.tokenizer
    prompts = [trainer.episodes.chat(f"{a}+{b}=") for a, b in ((3, 4), (5, 2), (1, 8), (6, 0), (2, 2), (4, 4))]

    def greedy():
        return [o.tokens for o in sample(trainer.hf, prompts, max_new_tokens=4, stop_ids=tok.eos_token_id,
                                          pad_id=tok.pad_token_id, temperature=0.0)]

    held = greedy()
    assert trainer.hold_for_eval() == 0
    for step in range(8):
        trainer.step(synthetic_batch(step, trainer.vocab_size))
    assert greedy() != held, "training did not move the greedy answers: the check below would prove nothing"
    trained = [p.detach().clone() for _, p in adapter_parameters(trainer.hf)]
    assert max(trainer.greedy_gaps(prompts, held)) < 1e-3
    assert all(torch.equal(p, t) for (_, p), t in zip(adapter_parameters(trainer.hf), trained))
    assert trainer._eval_copy is None and not trainer.policy.greedy
    digits = [tok.convert_tokens_to_ids(d) for d in "0123456789"]
    forged = [[next(d for d in digits if d != c[0])] + c[1:] for c in held]
    assert min(trainer.greedy_gaps(prompts, forged)) > 0.05


def test_a_one_rank_cuda_device_gets_an_index_and_no_gpu_is_one_clear_line(monkeypatch):
    """`[model] device = "cuda"` on one rank (configs/learner-gpu.toml): torch refuses to make an
    index-less `cuda` current, so every one-rank GPU run failed as the trainer started; on a
    machine without CUDA it was a 50-line traceback ending in BrokenThreadPool (a new user)."""
    import torch

    from learner.train import dist

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    if not torch.cuda.is_available():
        with pytest.raises(dist.DeviceError, match=r'\[model\] device = "cpu"'):
            dist.init_world("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    world = dist.init_world("cuda")
    assert world.device == torch.device("cuda", 0)
    made_current = []
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    world.use_device()
    assert made_current == [torch.device("cuda", 0)]


def test_the_learner_sets_expandable_segments_unless_the_user_chose_an_allocator(monkeypatch):
    """On an H200 the caching allocator's default reserved up to 1.32x a step's tensors, and a
    1.9B bf16 step peaked 7% above the preflight (docs/benchmarks.md, table 8b): the learner
    sets expandable segments before CUDA starts, and keeps a user's own setting of either name."""
    import os

    from learner.train.dist import CUDA_ALLOC_CONF, cuda_allocator_defaults

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    cuda_allocator_defaults()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == CUDA_ALLOC_CONF == "expandable_segments:True"
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        monkeypatch.setenv(name, "backend:cudaMallocAsync")
        cuda_allocator_defaults()
        assert os.environ[name] == "backend:cudaMallocAsync"
        assert name == "PYTORCH_CUDA_ALLOC_CONF" or "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
        monkeypatch.delenv(name)
