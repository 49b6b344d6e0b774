"""The trainer: one GRPO update per batch of groups, snapshots, checkpoints and greedy eval.

Runs in a worker thread (the learner's event loop stays free to serve workers); everything
here is blocking torch code.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch

from echo.hf import completion_logprobs, load_model_dir, sample
from echo.tasks import Prompt, Task
from learner.buffer import BatchInfo
from learner.config import LearnerConfig
from learner.losses import LossStats, group_advantages, grpo_loss


def lr_factor(step: int, schedule: str, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the base learning rate after `step` updates."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    if schedule == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0


class Trainer:
    def __init__(self, cfg: LearnerConfig, model_path: Path | None = None):
        self.cfg = cfg
        torch.manual_seed(cfg.run.seed)
        self.model, self.tokenizer = load_model_dir(model_path or cfg.model.path, cfg.model.dtype, cfg.model.device)
        t = cfg.trainer
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: lr_factor(
            step, t.schedule, t.warmup_steps, cfg.run.steps, t.min_lr_ratio))
        self.reference = copy.deepcopy(self.model).requires_grad_(False) if t.kl_coef > 0 else None
        self.version = 0  # number of updates applied

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]

    def step(self, batch: BatchInfo) -> dict[str, float]:
        """One update on `batch`; returns the step's statistics."""
        t, r = self.cfg.trainer, self.cfg.rollout
        prompts, completions, behaviour, rewards = [], [], [], []
        for g in batch.groups:
            prompts += [g.prompt_ids] * len(g.completions)
            completions += g.completions
            behaviour += g.behaviour_logprobs
            rewards.append(g.rewards)
        reward_t = torch.tensor(rewards, dtype=torch.float32)
        advantages = group_advantages(reward_t, t.adv_eps).flatten()
        width = max(map(len, completions))
        behaviour_t = torch.zeros((len(completions), width))
        for i, lp in enumerate(behaviour):
            behaviour_t[i, : len(lp)] = torch.tensor(lp)
        total_tokens = sum(map(len, completions))

        self.model.train()
        old_logp = ref_logp = None
        if t.minibatches > 1 or self.reference is not None:
            with torch.no_grad():
                if t.minibatches > 1:
                    old_logp, _ = completion_logprobs(self.model, prompts, completions, pad_id=self._pad, temperature=r.temperature)
                if self.reference is not None:
                    ref_logp, _ = completion_logprobs(self.reference, prompts, completions, pad_id=self._pad, temperature=r.temperature)
        stats: list[LossStats] = []
        order = torch.randperm(len(completions)).tolist()
        size = math.ceil(len(order) / t.minibatches)
        for start in range(0, len(order), size):
            idx = order[start : start + size]
            logp, mask = completion_logprobs(self.model, [prompts[i] for i in idx], [completions[i] for i in idx],
                                             pad_id=self._pad, temperature=r.temperature)
            cols = logp.shape[1]
            old = old_logp[idx, :cols] if old_logp is not None else logp.detach()
            ref = ref_logp[idx, :cols] if ref_logp is not None else None
            loss, st = grpo_loss(logp, old, behaviour_t[idx, :cols], advantages[idx], mask,
                                 clip_eps=t.clip_eps, is_cap=t.is_cap, total_tokens=total_tokens,
                                 ref_logp=ref, kl_coef=t.kl_coef)
            self.optimizer.zero_grad()
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.max_grad_norm)
            self.optimizer.step()
            stats.append(st)
        self.scheduler.step()
        self.model.eval()
        self.version += 1
        mean = lambda name: sum(getattr(s, name) for s in stats) / len(stats)  # noqa: E731
        return {
            "loss": sum(s.loss for s in stats),
            "reward_mean": float(reward_t.mean()),
            "reward_std": float(reward_t.std(unbiased=False)),
            "grad_norm": float(grad_norm),
            "mean_ratio": mean("mean_ratio"),
            "clip_fraction": mean("clip_fraction"),
            "is_weight_mean": mean("mean_is_weight"),
            "is_truncated_fraction": mean("is_truncated_fraction"),
            "mismatch_kl": mean("mismatch_kl"),
            "kl_ref": mean("kl_ref"),
            "tokens": total_tokens,
            "lr": self.scheduler.get_last_lr()[0],
        }

    @property
    def _pad(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id

    def snapshot(self) -> bytes:
        """The current weights as safetensors bytes (what workers install)."""
        from safetensors.torch import save

        # clone() breaks weight tying, so a tied model ships both names (safetensors refuses
        # shared storage) and an engine can never keep a stale head.
        # No per-version metadata: consecutive snapshots keep one byte layout, so deltas apply.
        return save({k: v.detach().to("cpu").contiguous().clone() for k, v in self.model.state_dict().items()})

    @torch.no_grad()
    def evaluate(self, task: Task, prompts: list[Prompt]) -> float:
        """Greedy accuracy on `prompts`."""
        r = self.cfg.rollout
        correct = 0.0
        for start in range(0, len(prompts), 256):
            chunk = prompts[start : start + 256]
            outs = sample(self.model, [self.encode(p.text) for p in chunk], max_new_tokens=r.max_new_tokens,
                          eos_id=self.tokenizer.eos_token_id, pad_id=self._pad, temperature=0.0)
            texts = self.tokenizer.batch_decode([o.tokens for o in outs], skip_special_tokens=True)
            correct += sum(task.reward(p, text) for p, text in zip(chunk, texts))
        return correct / max(1, len(prompts))

    def save_checkpoint(self, directory: Path, extra: dict) -> Path:
        """A resumable checkpoint: an HF model dir + optimizer state + learner state."""
        path = directory / f"step-{self.version:06d}"
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                   path / "optimizer.pt")
        (path / "learner_state.json").write_text(json.dumps({"version": self.version, **extra}, indent=2))
        latest = directory / "latest"
        latest.unlink(missing_ok=True)
        latest.symlink_to(path.name)
        return path

    def load_checkpoint(self, path: Path) -> dict:
        """Resume from a `save_checkpoint` directory (the model was loaded from it already)."""
        state = json.loads((path / "learner_state.json").read_text())
        saved = torch.load(path / "optimizer.pt", weights_only=True)
        self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        self.version = int(state["version"])
        return state
