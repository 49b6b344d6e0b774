"""Closed-form mean staleness of fully asynchronous RL with a queue-drop buffer
(formulas.md §2, the staleness blog).

Inputs are dimensionless: utilization `ρ = Θ_R/Θ_T` (< 1 rollout-bound, > 1 train-bound),
concurrency over batch `C/B`, queue factor `q = Q/B`, and the group tailness multiplier
`M_tail = E[max(L_1..L_n)]/μ`.

- `PQS = M_tail · (C/B) · min(1, 1/ρ)`                       (pre-queue)
- `IQS = ρ` if `ρ ≤ 1`, else `(2q − 1)/(2ρ) + 1/2`             (in-queue)
- mean staleness `S̄ = PQS + IQS`
- fixed GPU budget, `r = θ_T/θ_R`: `T_eff(ρ)/T_eff(1) = (1 + rρ)/((1 + r)·min(1, ρ))`
- a train-bound point beats the rollout-bound one with the same `T_eff` only if
  `r < r*(q) = (3q/2 − 1 − √((q − 1)(2q − 1)))/q²`

It also holds the length model the simulator draws from — a capped lognormal
`L = min(cap·μ₀, μ₀·exp(σz − σ²/2))` — with its exact mean and `M_tail`, so a simulated
`ρ` and the closed form's `M_tail` describe the same distribution.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from scheduler.errors import SchedulerError


def _positive(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise SchedulerError(f"{name} must be a positive finite number, got {value!r}")


def pqs(rho: float, c_over_b: float, m_tail: float) -> float:
    """Pre-queue staleness: group generation time over the effective train period."""
    _positive("rho", rho)
    _positive("C/B", c_over_b)
    if m_tail < 1:
        raise SchedulerError(f"the tailness multiplier E[max]/mean is ≥ 1, got {m_tail!r}")
    return m_tail * c_over_b * min(1.0, 1.0 / rho)


def iqs(rho: float, q: float) -> float:
    """In-queue staleness of queue-drop; the `ρ > 1` branch includes the +1/2 smooth-arrival term."""
    _positive("rho", rho)
    if q < 1:
        raise SchedulerError(f"the queue factor q = Q/B must be ≥ 1 (the queue holds a batch), got {q!r}")
    return rho if rho <= 1 else (2 * q - 1) / (2 * rho) + 0.5


@dataclass(frozen=True, slots=True)
class StalenessPrediction:
    rho: float
    c_over_b: float
    q: float
    m_tail: float
    pqs: float
    iqs: float

    @property
    def total(self) -> float:
        return self.pqs + self.iqs

    @property
    def regime(self) -> str:
        return "rollout-bound" if self.rho < 1 else "train-bound" if self.rho > 1 else "balanced"

    def as_dict(self) -> dict[str, float | str]:
        return {**asdict(self), "total": self.total, "regime": self.regime}


def predict(rho: float, c_over_b: float, q: float = 1.0, m_tail: float = 1.0) -> StalenessPrediction:
    """PQS, IQS and their sum for one operating point."""
    return StalenessPrediction(rho, c_over_b, q, m_tail, pqs(rho, c_over_b, m_tail), iqs(rho, q))


def t_eff_ratio(rho: float, r: float) -> float:
    """`T_eff(ρ)/T_eff(1)` under a fixed GPU budget with `r = θ_T/θ_R`; minimal (= 1) at ρ = 1."""
    _positive("rho", rho)
    _positive("r", r)
    return (1 + r * rho) / ((1 + r) * min(1.0, rho))


def matching_rollout_bound_rho(rho: float, r: float) -> float:
    """For a train-bound `ρ > 1`, the `ρ' < 1` with the same `T_eff` under a fixed budget:
    `(1 + rρ')/ρ' = 1 + rρ`, so `ρ' = 1/(1 + r(ρ − 1))`."""
    if rho <= 1:
        raise SchedulerError(f"rho must be > 1 (train-bound), got {rho!r}")
    _positive("r", r)
    return 1.0 / (1.0 + r * (rho - 1.0))


def r_star(q: float) -> float:
    """`r*(q)`: below it a train-bound split can beat the rollout-bound one (r*(1) = 1/2)."""
    if q < 1:
        raise SchedulerError(f"q must be ≥ 1, got {q!r}")
    return (1.5 * q - 1 - math.sqrt((q - 1) * (2 * q - 1))) / (q * q)


# --- the length model shared with the simulator ---------------------------------------------

def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def length_mean(mu0: float, sigma: float, cap: float = 8.0) -> float:
    """`E[min(cap·μ₀, μ₀·exp(σz − σ²/2))]` (rounding to whole tokens ignored: μ₀ ≫ 1)."""
    _positive("mu0", mu0)
    if sigma < 0:
        raise SchedulerError(f"sigma must be ≥ 0, got {sigma!r}")
    if sigma == 0:
        return mu0 * min(1.0, cap)
    a = math.log(cap) / sigma
    # E[X; X < c] + c·P(X ≥ c) for the lognormal X with E[X] = μ₀.
    return mu0 * (_phi(a - sigma / 2) + cap * (1 - _phi(a + sigma / 2)))


def tail_multiplier(sigma: float, n: int, cap: float = 8.0, points: int = 4000) -> float:
    """`M_tail = E[max(L_1..L_n)]/E[L]` for the capped lognormal, by quadrature.

    `E[max] = ∫₀^cap (1 − F(x)ⁿ) dx` in units of μ₀; Simpson's rule in `log x`, where the
    integrand is smooth, with the (negligible) part below `e^{-12}μ₀` dropped.
    """
    if n < 1:
        raise SchedulerError(f"group size must be ≥ 1, got {n!r}")
    if sigma < 0:
        raise SchedulerError(f"sigma must be ≥ 0, got {sigma!r}")
    if sigma == 0 or n == 1:
        return 1.0
    lo, hi = -12.0 * max(1.0, sigma), math.log(cap)
    points += points % 2
    h = (hi - lo) / points
    s2 = sigma * sigma / 2
    total = 0.0
    for k in range(points + 1):
        y = lo + k * h  # x = e^y, dx = e^y dy
        f = 1.0 - _phi((y + s2) / sigma) ** n
        w = 1 if k in (0, points) else 4 if k % 2 else 2
        total += w * f * math.exp(y)
    e_max = total * h / 3
    return e_max / (length_mean(1.0, sigma, cap))


def sigma_for_tail_multiplier(m_tail: float, n: int, cap: float = 8.0) -> float:
    """Inverse of `tail_multiplier` in σ (bisection; `M_tail` grows with σ)."""
    if m_tail < 1:
        raise SchedulerError(f"the tailness multiplier is ≥ 1, got {m_tail!r}")
    if m_tail == 1 or n == 1:
        return 0.0
    lo, hi = 0.0, 3.0
    top = tail_multiplier(hi, n, cap)
    if m_tail > top:
        raise SchedulerError(
            f"a tailness multiplier of {m_tail:g} is out of reach for groups of {n} with lengths "
            f"capped at {cap:g}× the median scale (at most {top:.3g}); lower it or raise the cap"
        )
    for _ in range(50):
        mid = (lo + hi) / 2
        if tail_multiplier(mid, n, cap, points=800) < m_tail:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
