"""GRPO with token-level truncated importance weights (AIPO-style), as plain tensor math.

Per response token `t` of sample `i`:

    r_t   = π_θ(y_t) / π_old(y_t)                 PPO ratio against the policy at step start
    w_t   = min(π_old(y_t) / μ(y_t), δ)           truncated IS weight against the behaviour
                                                  policy μ that generated the token (detached)
    obj_t = w_t · min(r_t·Â_i, clip(r_t, 1−ε, 1+ε)·Â_i)
    loss  = −Σ obj_t·mask_t / N_tokens  (+ β · Σ KL_t·mask_t / N_tokens)

`N_tokens` is the number of response tokens of the whole batch (AIPO's normaliser), so the
losses of several minibatches add up to the loss of the batch. With one optimizer step per
batch `π_old = π_θ` numerically, `r_t = 1`, and the gradient is the IS-weighted policy gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`(s_i − mean(s)) / (std(s) + ε)` over each row (one row = the `n` samples of a prompt).

    Uses the population std (unbiased=False): a group of identical rewards gets zero advantage.
    """
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)


@dataclass
class LossStats:
    loss: float
    mean_ratio: float
    clip_fraction: float
    mean_is_weight: float
    is_truncated_fraction: float
    mismatch_kl: float  # E_μ[log μ − log π_old] over tokens: engine mismatch + staleness drift
    kl_ref: float


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float,
    is_cap: float,
    total_tokens: int | float,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, LossStats]:
    """All tensors `[samples, tokens]` except `advantages` `[samples]`; `mask` is 1 on response tokens."""
    mask = mask.to(logp.dtype)
    adv = advantages.unsqueeze(-1)
    ratio = torch.exp(logp - old_logp.detach())
    is_weight = torch.exp(old_logp - behaviour_logp).detach().clamp(max=is_cap)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv
    objective = is_weight * torch.minimum(unclipped, clipped)
    loss = -(objective * mask).sum() / total_tokens

    kl_ref = torch.zeros((), dtype=logp.dtype)
    if ref_logp is not None and kl_coef > 0:
        delta = ref_logp.detach() - logp
        kl = torch.exp(delta) - delta - 1.0  # k3 estimator: unbiased, non-negative
        kl_ref = (kl * mask).sum() / total_tokens
        loss = loss + kl_coef * kl_ref

    with torch.no_grad():
        n = mask.sum().clamp(min=1.0)
        raw_w = torch.exp(old_logp - behaviour_logp)
        stats = LossStats(
            loss=float(loss),
            mean_ratio=float((ratio * mask).sum() / n),
            clip_fraction=float((((ratio - 1).abs() > clip_eps).to(mask.dtype) * mask).sum() / n),
            mean_is_weight=float((is_weight * mask).sum() / n),
            is_truncated_fraction=float(((raw_w > is_cap).to(mask.dtype) * mask).sum() / n),
            mismatch_kl=float(((behaviour_logp - old_logp) * mask).sum() / n),
            kl_ref=float(kl_ref),
        )
    return loss, stats
