"""GRPO with token-level truncated importance weights (AIPO-style), as plain tensor math.

Per response token `t` of sample `i`:

    r_t   = π_θ(y_t) / π_old(y_t)                 PPO ratio against the policy at step start
    w_t   = min(π_old(y_t) / μ(y_t), δ)           truncated IS weight against the behaviour
                                                  policy μ that generated the token (detached)
    obj_t = w_t · min(r_t·Â_i, clip(r_t, 1−ε, 1+ε)·Â_i)
    loss  = −Σ obj_t·mask_t / N_tokens  (+ β · Σ KL_t·mask_t / N_tokens)

`N_tokens` is the number of response tokens (mask 1) of the optimizer step's slice of the batch
on all ranks (AIPO's normaliser), so the losses of micro-batches and ranks add up to the loss of
the slice, and a step's gradient does not depend on how the slice was split. With one optimizer step per batch
`π_old = π_θ` numerically, `r_t = 1`, and the gradient is the IS-weighted policy gradient.

A token outside π_old's top-p nucleus has log π_old = −inf: π gives it no mass, so its
weight is 0 and it carries no gradient; it is counted (`outside_nucleus`) and left out of
the ratio and `mismatch_kl` statistics, where it would be infinite.

The KL term needs a finite log π_θ as well: after the first optimizer step of a batch a sampled
token can leave π_θ's own nucleus (log π_θ = −inf), and k3 = exp(ref − log π_θ) − … would be
inf − inf = NaN, poisoning every weight. Such tokens are left out of the KL and counted
(`kl_excluded`).
"""

from __future__ import annotations

import math
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
    """Token sums, so that micro-batches and ranks add up (sum the tensors `grpo_loss` returns,
    all-reduce once across ranks); the means the run log shows are properties."""

    tokens: float = 0.0  # response tokens with a finite π_old
    outside: float = 0.0  # response tokens outside π_old's top-p nucleus
    loss: float = 0.0  # already divided by the batch's token count: sums to the batch loss
    ratio: float = 0.0
    clipped: float = 0.0
    is_weight: float = 0.0
    truncated: float = 0.0
    mismatch: float = 0.0  # Σ log μ − log π_old: engine mismatch + staleness drift
    kl_ref: float = 0.0  # already divided by the batch's token count
    kl_excluded: float = 0.0  # response tokens left out of the KL: outside π_θ's or the reference's nucleus

    @classmethod
    def from_vector(cls, values) -> LossStats:
        values = values.tolist() if isinstance(values, torch.Tensor) else values
        return cls(*map(float, values))

    def _mean(self, total: float) -> float:
        return total / self.tokens if self.tokens else 0.0

    @property
    def mean_ratio(self) -> float:
        return self._mean(self.ratio)

    @property
    def clip_fraction(self) -> float:
        return self._mean(self.clipped)

    @property
    def mean_is_weight(self) -> float:
        return self._mean(self.is_weight)

    @property
    def is_truncated_fraction(self) -> float:
        return self._mean(self.truncated)

    @property
    def mismatch_kl(self) -> float:
        return self._mean(self.mismatch)

    @property
    def outside_nucleus_fraction(self) -> float:
        return self.outside / max(1.0, self.tokens + self.outside)


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    clip_eps: float,
    is_cap: float,
    total_tokens: int | float,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    reinforce: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token tensors of one shape (`[samples, tokens]` with `mask` 1 on response tokens, or
    flat `[tokens]` without a mask); `advantages` per sample (`[samples]`) or per token.

    `reinforce`: the AsymRE objective (the replay paper, App. D): `Â · log π_θ`, no importance
    weight and no clipping (its advantages carry the shifted baseline; see the trainer).

    Returns the loss and its statistics as a tensor of `LossStats` sums, left on the device
    so a step of many micro-batches synchronises once (`LossStats.from_vector`)."""
    mask = torch.ones_like(logp) if mask is None else mask.to(logp.dtype)
    adv = advantages.unsqueeze(-1) if advantages.dim() < logp.dim() else advantages
    valid = mask * torch.isfinite(old_logp).to(mask.dtype)  # π_old gives the token mass
    safe_old = torch.where(valid > 0, old_logp, torch.zeros_like(old_logp)).detach()
    safe_logp = torch.where(valid > 0, logp, safe_old)
    ratio = torch.exp(safe_logp - safe_old)
    # The importance weight π_old/μ, capped, taken in log space and only where a token counts: a
    # worker's μ is its word, and exp(π_old − μ) of μ = −1000 on a masked (environment) token was
    # inf there, inf · 0 a NaN, and the whole step's loss NaN (the step skipped, for one group).
    log_w = torch.where(valid > 0, safe_old - behaviour_logp, torch.zeros_like(safe_old)).detach()
    over_cap = log_w > math.log(is_cap)
    is_weight = torch.exp(log_w.clamp(max=math.log(is_cap))) * valid
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv
    objective = is_weight * torch.minimum(unclipped, clipped)
    if reinforce:
        objective = adv * safe_logp
    loss = -(objective * valid).sum() / total_tokens

    kl_ref = torch.zeros((), dtype=logp.dtype, device=logp.device)
    kl_excluded = torch.zeros((), dtype=logp.dtype, device=logp.device)
    if ref_logp is not None and kl_coef > 0:
        ref_valid = valid * (torch.isfinite(ref_logp) & torch.isfinite(logp)).to(valid.dtype)
        kl_logp = torch.where(ref_valid > 0, logp, torch.zeros_like(logp))
        delta = torch.where(ref_valid > 0, ref_logp.detach() - kl_logp, torch.zeros_like(kl_logp))
        kl = torch.exp(delta) - delta - 1.0  # k3 estimator: unbiased, non-negative
        kl_ref = (kl * ref_valid).sum() / total_tokens
        kl_excluded = (valid - ref_valid).sum()
        loss = loss + kl_coef * kl_ref

    with torch.no_grad():
        # AsymRE clips nothing: its clip fraction is 0, not the share of ratios outside the band (0.11 was read)
        clipped_share = torch.zeros_like(valid) if reinforce else ((ratio - 1).abs() > clip_eps).to(valid.dtype)
        sums = torch.stack([
            valid.sum(), (mask - valid).sum(), loss.detach(), (ratio * valid).sum(),
            (clipped_share * valid).sum(), (is_weight * valid).sum(),
            (over_cap.to(valid.dtype) * valid).sum(), (-log_w * valid).sum(),
            kl_ref.detach(), kl_excluded.detach(),
        ])
    return loss, sums
