"""The learner and its workers on a GPU, as a user with one runs them: the real `echo-learner`
with its trainer on CUDA (nccl, bf16 through FSDP2's mixed precision, the KL reference, top-p,
the eval copy and the claim copy on the device) and spawned transformers workers on the same
GPU. CI has no GPU: every test here is skipped there; `make test-gpu` runs them where one is.

What each asserts is what a fault seen only on GPUs breaks: the run ends with every update
applied, every logged number finite (KL under top-p turned NaN before), and no honest worker
quarantined (bf16 kernels on the learner against the workers' own must stay within the checks'
tolerances: the π-vs-μ check, the greedy-answer check of the eval, the stale-claim check)."""

import math

import pytest
import torch
from learner_runs import build_poker_model, run_learner

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu on a machine with one)")]

# A small run that reaches every GPU path once: 2 spawned workers, S = 2 with a version per
# update (so most groups are stale and their claims get checked), greedy eval on the workers
# checked on the learner, bf16 compute and versions, the KL reference, top-p 0.9.
ARITH = ["--run.steps", "12", "--run.eval_every", "6", "--eval.limit", "64", "--trainer.batch_prompts", "8",
         "--rollout.group_size", "8", "--model.device", "cuda", "--trainer.compute_dtype", "bfloat16",
         "--publish.dtype", "bfloat16", "--trainer.kl_coef", "0.05", "--rollout.top_p", "0.9",
         "--buffer.max_staleness", "2", "--publish.every", "1", "--verify.stale_check_fraction", "1.0",
         "--scheduler.pool", '""', "--scheduler.provider", "static", "--workers.spawn", "2",
         "--workers.overrides", '["--engine.device=cuda"]']


def _assert_healthy(summary: dict, records: list[dict], steps: int) -> list[dict]:
    assert summary["steps"] == steps, summary
    assert not summary["quarantined"], summary["quarantined"]
    updates = [r for r in records if "event" not in r and "loss" in r]
    assert len(updates) >= steps
    for r in updates:
        for key in ("loss", "grad_norm", "kl_ref", "mismatch_kl"):
            assert math.isfinite(r[key]), (key, r)
    # bf16 on the learner against the workers' engines: the fresh batches' π and μ agree
    assert abs(updates[0]["mismatch_kl"]) < 0.01, updates[0]
    return updates


def test_a_bf16_learner_on_a_gpu_trains_with_gpu_workers_and_quarantines_none(tiny_model, tmp_path):
    summary, records = run_learner("configs/demo.toml", tiny_model, tmp_path / "runs", *ARITH)
    updates = _assert_healthy(summary, records, 12)
    assert sum(r["claims_checked"] for r in updates) > 0  # the claim copy ran on the GPU
    evals = [r for r in records if r.get("event") == "eval"]
    assert evals and all(r["where"] == "workers" and 0.0 <= r["eval_accuracy"] <= 1.0 for r in evals), evals


def test_a_lora_learner_on_a_gpu_trains_with_gpu_workers_and_quarantines_none(tiny_model, tmp_path):
    summary, records = run_learner("configs/demo.toml", tiny_model, tmp_path / "runs", *ARITH,
                                   "--trainer.lora", "{rank = 4, alpha = 16}", "--trainer.lr", "3e-3")
    _assert_healthy(summary, records, 12)
    assert (next((tmp_path / "runs").glob("*/model-adapter")) / "adapter_config.json").exists()


def test_poker_episodes_on_a_gpu_are_replayed_and_evaluated_on_the_learner(tmp_path):
    model = build_poker_model(tmp_path / "tiny-poker", 20, 16)
    summary, records = run_learner("configs/poker.toml", model, tmp_path / "runs", "--task.opponent_model", str(model),
                                   "--model.device", "cuda", "--trainer.compute_dtype", "bfloat16", "--publish.dtype",
                                   "bfloat16", "--run.steps", "6", "--run.eval_every", "3", "--eval.limit", "40",
                                   "--workers.overrides", '["--engine.device=cuda"]')
    _assert_healthy(summary, records, 6)
    assert summary["rewards_checked"] > 0 and summary["rewards_mismatched"] == 0, summary
    evals = [r for r in records if r.get("event") == "eval"]
    assert len(evals) == 3 and all(r["where"] == "learner" and math.isfinite(r["eval_accuracy"]) for r in evals)
