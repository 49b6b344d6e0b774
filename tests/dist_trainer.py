"""Driven by tests/integration/test_trainer_dist.py under `torchrun --nproc_per_node N`: a Trainer on the
same synthetic batches whatever N is, steered through `Lockstep` exactly as the learner does
(rank 0 calls, the other ranks replay). Writes, from rank 0, `result.json` (the losses, the
token check's and the stale groups' check's sums, the sha256 of the snapshot before the first step) and `final.safetensors` (the weights at the end).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from pathlib import Path

import torch

from learner.buffer import BatchInfo, Group
from learner.config import load_learner_config
from learner.train.dist import Lockstep, close, init_world
from learner.train.trainer import Trainer

GROUPS, SAMPLES = 4, 4


def synthetic_batch(step: int, vocab: int, skipped: int = 0, stale: bool = False) -> BatchInfo:
    """Prompts and completions of different lengths (so splits and padding differ between
    rank counts), rewards with signal, behaviour log-probs off π (so IS weights vary); with
    `skipped`, that many groups dynamic sampling skipped, uniform rewards, for the token check;
    `stale`: labelled with the version before (checked against it, `Trainer._check_claims`)."""
    rng = random.Random(step)
    groups = []
    for g in range(GROUPS + skipped):
        prompt = [1] + [rng.randrange(4, vocab) for _ in range(rng.randint(2, 9))]
        completions = [[rng.randrange(4, vocab) for _ in range(rng.randint(1, 12))] for _ in range(SAMPLES)]
        groups.append(Group(f"s{step}g{g}", max(0, step - stale), prompt, completions,
                            [[-rng.uniform(1.5, 4.0) for _ in c] for c in completions],
                            [float(rng.random() < 0.5) if g < GROUPS else 1.0 for _ in completions]))
    return BatchInfo(groups[:GROUPS], step, [step - groups[0].version] * GROUPS, skipped=3 * skipped,
                     skipped_sample=groups[GROUPS:])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--save-at", type=int, default=0, help="write a checkpoint after this many steps")
    p.add_argument("--resume", type=Path, default=None)
    p.add_argument("--skipped", type=int, default=0, help="groups skipped by dynamic sampling in each batch's sample")
    p.add_argument("--stale", action="store_true",
                   help="label each batch with the version before and publish every step, so stale groups are "
                        "checked against the version they claim")
    p.add_argument("--evaluate-first", action="store_true",
                   help="a learner-side eval before the first step, as the learner's v0 eval ([eval] where = 'learner')")
    p.add_argument("overrides", nargs="*", help="extra --section.key VALUE config overrides")
    args = p.parse_args()
    cfg = load_learner_config(None, [
        "--model.path", args.model, "--run.seed", "3", "--trainer.lr", "1e-3", "--trainer.minibatches", "2",
        "--trainer.micro_batch_tokens", "64", "--trainer.kl_coef", "0.05", "--trainer.batch_prompts", str(GROUPS),
        "--rollout.group_size", str(SAMPLES), "--publish.dtype", "float32", *args.overrides])
    torch.set_num_threads(1)
    world = init_world("cpu")
    trainer = Trainer(cfg, world, checkpoint=args.resume)
    if not world.is_main:
        Lockstep(trainer, world).follow()
        close(world)
        return 0
    drive = Lockstep(trainer, world)
    first = drive.call("snapshot")
    accuracy = None
    if args.evaluate_first:
        from echo.tasks import load_task

        task = load_task("arith", {})
        accuracy = drive.call("evaluate", task, task.eval_prompts()[:4])
    losses, token_checks, claim_checks, improbable = [], [], [], []
    while trainer.version < args.steps:
        stats = drive.call("step", synthetic_batch(trainer.version, trainer.vocab_size, args.skipped, args.stale))
        losses.append(stats["loss"])
        token_checks.append({"groups": stats["group_tokens"], "skipped": stats["skipped_tokens"]})
        claim_checks.append({"groups": stats["claim_checks"], "skipped": stats["skipped_claims"]})
        improbable.append(sorted(stats["improbable"]))
        if args.stale:
            drive.call("snapshot")  # published, so kept for the next batch's claims
        if trainer.version == args.save_at:
            drive.call("save_checkpoint", args.out / "checkpoints", {})
    blob = drive.call("snapshot")
    drive.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "final.safetensors").write_bytes(blob)
    (args.out / "result.json").write_text(json.dumps({
        "ranks": world.size, "losses": losses, "token_checks": token_checks, "claim_checks": claim_checks, "improbable": improbable, "first_snapshot_sha256": hashlib.sha256(first).hexdigest(),
        "parameters": trainer.num_parameters, "accuracy": accuracy}))
    close(world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
