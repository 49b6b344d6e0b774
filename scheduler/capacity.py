"""The ECHO-2 overlap rule: how much rollout capacity keeps the learner busy, and what
staleness that implies (formulas.md §1, the paper's §3.3 and App. A).

Symbols: `B` rollouts per update, `T` seconds per update (T_train), `I` publication period
(updates), `T_b` learner-visible broadcast time (s), `R` aggregate rollout rate (rollouts/s).

- overlap condition (1): `I·B/R + T_b ≤ I·T`
- capacity requirement (2): `R ≥ R_req = I·B / (I·T − T_b)`, defined only when `I·T > T_b`
- worst case (App. A): `s_max ≤ I − 1 + ⌈(T_b + B/R)/T⌉`; under (1) `s_max ≤ I + ⌈(1 − 1/I)·T_b/T⌉`

Everything here takes plain numbers and is exact up to a small tolerance on ceilings, so a
value that is an integer on paper (e.g. `(T_b + B/R)/T = 2`) is not pushed to 3 by rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scheduler.errors import InfeasibleOverlap, SchedulerError

_EPS = 1e-9  # relative slack for ceilings of quantities that are integers on paper


def _ceil(x: float) -> int:
    return math.ceil(x - _EPS * max(1.0, abs(x)))


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0 or math.isinf(value):
            raise SchedulerError(f"{name} must be a positive finite number, got {value!r}")


def smallest_feasible_period(t_train: float, t_bcast: float) -> int:
    """Smallest `I ≥ 1` with `I·T > T_b` (the overlap can then be met with enough capacity)."""
    _check_positive(t_train=t_train)
    if t_bcast < 0:
        raise SchedulerError(f"t_bcast must be ≥ 0, got {t_bcast!r}")
    period = max(1, math.floor(t_bcast / t_train) + 1)
    while period * t_train <= t_bcast:  # guard the float floor
        period += 1
    return period


def required_rate(batch: int, t_train: float, t_bcast: float, publish_every: int) -> float:
    """`R_req = I·B/(I·T − T_b)` rollouts/s; raises `InfeasibleOverlap` when `I·T ≤ T_b`.

    Invariant: at `R = R_req` the overlap condition holds with equality.
    """
    _check_positive(batch=batch, t_train=t_train, publish_every=publish_every)
    if t_bcast < 0:
        raise SchedulerError(f"t_bcast must be ≥ 0, got {t_bcast!r}")
    slack = publish_every * t_train - t_bcast
    if slack <= 0:
        raise InfeasibleOverlap(publish_every, t_train, t_bcast, smallest_feasible_period(t_train, t_bcast))
    rate = publish_every * batch / slack
    assert math.isclose(publish_every * batch / rate + t_bcast, publish_every * t_train, rel_tol=1e-9)
    return rate


def overlap_holds(batch: int, t_train: float, t_bcast: float, publish_every: int, rate: float) -> bool:
    """Condition (1): `I·B/R + T_b ≤ I·T` (with a relative tolerance of 1e-9)."""
    if rate <= 0:
        return False
    lhs = publish_every * batch / rate + t_bcast
    return lhs <= publish_every * t_train * (1 + _EPS)


def default_publish_every(max_staleness: int) -> int:
    """`I = S − 1` (at least 1), which keeps `s_max ≤ S` whenever the overlap holds and
    `T_b ≤ T` (App. A corollary; with `I = 1` the bound is 1 = S for S = 1 too)."""
    if max_staleness < 1:
        raise SchedulerError(
            f"asynchronous rollouts need a staleness budget S ≥ 1, got S = {max_staleness}; "
            "S = 0 is synchronous training, which the overlap rule does not describe"
        )
    return max(1, max_staleness - 1)


def staleness_bound(batch: int, t_train: float, t_bcast: float, publish_every: int, rate: float) -> int:
    """App. A (7): `s_max ≤ I − 1 + k*`, `k* = ⌈(T_b + B/R)/T⌉` (no new-snapshot rollout
    before `T_b`, rate `R` after). Holds whether or not the overlap condition does."""
    _check_positive(batch=batch, t_train=t_train, publish_every=publish_every, rate=rate)
    k_star = _ceil((t_bcast + batch / rate) / t_train)
    return publish_every - 1 + k_star


def staleness_bound_under_overlap(t_train: float, t_bcast: float, publish_every: int) -> int:
    """App. A (12): `s_max ≤ I + ⌈(1 − 1/I)·T_b/T⌉`, valid when the overlap condition holds.
    Equals `I + 1` at most when `T_b ≤ T`, and `I` when `I = 1`."""
    _check_positive(t_train=t_train, publish_every=publish_every)
    return publish_every + _ceil((1 - 1 / publish_every) * t_bcast / t_train)


def bubble(batch: int, t_train: float, t_bcast: float, publish_every: int, rate: float) -> tuple[float, float]:
    """Predicted learner wait per publication period (s) and bubble ratio (idle / wall).

    The overlap model: a period lasts `max(I·T, I·B/R + T_b)`; the learner computes `I·T`
    of it and waits for the rest. Zero wait exactly when condition (1) holds.
    """
    _check_positive(batch=batch, t_train=t_train, publish_every=publish_every)
    if rate <= 0:
        return math.inf, 1.0
    busy = publish_every * t_train
    wait = max(0.0, publish_every * batch / rate + t_bcast - busy)
    return wait, wait / (busy + wait)


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    """The derived quantities `echo-rl plan` prints, for one (B, T, T_b, I, α)."""

    batch: int
    t_train: float
    t_bcast: float
    publish_every: int
    alpha: float
    r_req: float

    @property
    def target(self) -> float:
        """`α·R_req`: what activation covers."""
        return self.alpha * self.r_req


def plan_capacity(batch: int, t_train: float, t_bcast: float, publish_every: int, alpha: float) -> CapacityPlan:
    """R_req and the activation target; raises `InfeasibleOverlap` like `required_rate`."""
    if not alpha >= 1:
        raise SchedulerError(f"alpha is a safety factor and must be ≥ 1, got {alpha!r}")
    return CapacityPlan(batch, t_train, t_bcast, publish_every, alpha,
                        required_rate(batch, t_train, t_bcast, publish_every))
