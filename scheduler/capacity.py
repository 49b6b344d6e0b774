"""How much rollout capacity keeps the learner busy, and what staleness that implies
(formulas.md §1, the paper's §3.3 and App. A).

Symbols: `B` rollouts per update, `T` seconds per update (T_train), `I` publication period
(updates), `S` staleness budget, `T_b` learner-visible broadcast time (s: publication until
workers can generate with the snapshot, install included), `τ` install downtime (s), `R`
aggregate rollout capacity (rollouts/s).

Two rules (`requirement(rule, ...)`):

- `"paper"`: ECHO-2's sufficient condition, as if nothing generated while a snapshot is in
  flight were usable. Overlap (1): `I·B/R + T_b ≤ I·T`; capacity (2): `R ≥ I·B/(I·T − T_b)`,
  defined only when `I·T > T_b`.
- `"overlapped"` (default): this system, where the learner keeps training on older snapshots'
  rollouts while a new one travels, so the broadcast only has to be hidden within the
  staleness budget. Throughput: `R·(I·T − τ) ≥ I·B`; admissibility:
  `I − 1 + ⌈(T_b + B/R)/T⌉ ≤ S` ⟺ `R ≥ B/((S − I + 1)·T − T_b)`; dissemination: one version
  per period, `M_wire/r_bcast ≤ I·T`. `R_req` is the larger of the first two; feasible iff
  `T_b < (S − I + 1)·T` (so `I ≤ S`), `τ < I·T` and the dissemination holds.
  `echo-rl bench overlap` measured the knee of the bubble against both (README).

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


def required_rate(batch: int, t_train: float, t_bcast: float, publish_every: int,
                  max_staleness: int | None = None) -> float:
    """The paper's rule: `R_req = I·B/(I·T − T_b)` rollouts/s; raises `InfeasibleOverlap` when
    `I·T ≤ T_b`, naming the smallest feasible `I` and the `S` it needs.

    Invariant: at `R = R_req` the overlap condition holds with equality.
    """
    _check_positive(batch=batch, t_train=t_train, publish_every=publish_every)
    if t_bcast < 0:
        raise SchedulerError(f"t_bcast must be ≥ 0, got {t_bcast!r}")
    slack = publish_every * t_train - t_bcast
    if slack <= 0:
        smallest = smallest_feasible_period(t_train, t_bcast)
        budget = f" (now S = {max_staleness})" if max_staleness is not None else ""
        raise InfeasibleOverlap(
            f"overlap is infeasible (paper's rule): I·T_train = {publish_every}·{t_train:.3g} s = "
            f"{publish_every * t_train:.3g} s does not exceed T_bcast = {t_bcast:.3g} s, so the learner waits "
            f"whatever the rollout capacity. Publish less often (I ≥ {smallest}, which needs a staleness budget "
            f"S ≥ {smallest + 1}{budget}) or make the broadcast faster (< {publish_every * t_train:.3g} s)",
            condition="overlap", publish_every=publish_every, max_staleness=max_staleness, t_train=t_train,
            t_bcast=t_bcast, smallest_feasible_period=smallest, smallest_feasible_staleness=smallest + 1)
    rate = publish_every * batch / slack
    assert math.isclose(publish_every * batch / rate + t_bcast, publish_every * t_train, rel_tol=1e-9)
    return rate


@dataclass(frozen=True, slots=True)
class Requirement:
    """`R_req` under one rule, with the rate each condition asks for and which one binds."""

    rule: str
    r_req: float
    conditions: dict[str, float]
    binding: str


RULES = ("overlapped", "paper")


def _upper_first(text: str) -> str:
    return text[:1].upper() + text[1:]


def requirement(rule: str, *, batch: int, t_train: float, t_bcast: float, publish_every: int,
                max_staleness: int | None, install_s: float = 0.0, transfer_s: float | None = None) -> Requirement:
    """`R_req` under `rule` (see the module docstring); `InfeasibleOverlap` when no capacity can
    do, with what to change. `t_bcast` is learner-visible (reception + install); `transfer_s`
    the time one version takes on the wire (`M_wire/r_bcast`; None: not checked).
    `max_staleness` None: nothing is dropped for staleness (the buffer's filter is off), so the
    overlapped rule has no admissibility condition."""
    if rule == "paper":
        r = required_rate(batch, t_train, t_bcast, publish_every, max_staleness)
        return Requirement(rule, r, {"overlap": r}, "overlap")
    if rule != "overlapped":
        raise SchedulerError(f"unknown capacity rule {rule!r}; choose one of {', '.join(RULES)}")
    _check_positive(batch=batch, t_train=t_train, publish_every=publish_every)
    if t_bcast < 0 or install_s < 0:
        raise SchedulerError(f"t_bcast and install_s must be ≥ 0, got {t_bcast!r}, {install_s!r}")
    B, T, Tb, I, S = batch, t_train, t_bcast, publish_every, max_staleness
    common = dict(publish_every=I, max_staleness=S, t_train=T, t_bcast=Tb)
    # The time a snapshot's rollouts have to reach the learner within S (unbounded without a filter)
    window = math.inf if S is None else (S - I + 1) * T - Tb
    if window <= 0:
        largest = next((i for i in range(min(S, I - 1), 0, -1) if (S - i + 1) * T > Tb), None)
        smallest_s = I - 1 + math.floor(Tb / T * (1 + _EPS)) + 1
        fixes = [f"publish more often (I ≤ {largest})"] if largest else []
        fixes += [f"allow more staleness (S ≥ {smallest_s})"]
        if S - I + 1 > 0:  # else no broadcast is fast enough: the newest snapshot alone is too stale by then
            fixes += [f"make the broadcast faster (T_bcast < {(S - I + 1) * T:.3g} s)"]
        why = (f"a snapshot takes T_bcast = {Tb:.3g} s to reach the workers, but its rollouts must be trained within "
               f"(S − I + 1)·T_train = {S - I + 1}·{T:.3g} s = {(S - I + 1) * T:.3g} s to stay within S"
               if S - I + 1 > 0 else
               f"with a snapshot every I = {I} updates its rollouts would have to be trained within (S − I + 1)·T_train "
               f"= {S - I + 1}·{T:.3g} s of its publication to stay within S, however fast the broadcast")
        raise InfeasibleOverlap(
            f"infeasible at S = {S}, I = {I}: {why}, so they would be dropped whatever the capacity. "
            + _upper_first(", ".join(fixes[:-1]) + ", or " + fixes[-1] if len(fixes) > 1 else fixes[0]),
            condition="admissibility", largest_feasible_period=largest, smallest_feasible_staleness=smallest_s,
            **common)
    busy = I * T - install_s
    if busy <= 0:
        raise InfeasibleOverlap(
            f"infeasible at I = {I}: installing a snapshot takes τ = {install_s:.3g} s, a whole publication period "
            f"(I·T_train = {I * T:.3g} s); publish less often" + (f" (within S = {S})" if S is not None else "")
            + " or make installs faster",
            condition="throughput", **common)
    if transfer_s is not None and transfer_s > I * T:
        raise InfeasibleOverlap(
            f"infeasible at I = {I}: one version takes {transfer_s:.3g} s on the wire, longer than a publication "
            f"period (I·T_train = {I * T:.3g} s), so versions pile up; publish less often"
            + (f" (within S = {S})" if S is not None else "") + " or make the broadcast faster (deltas, more chains)",
            condition="dissemination", **common)
    conditions = {"throughput": I * B / busy}
    if S is not None:
        conditions["admissibility"] = B / window
    binding = max(conditions, key=conditions.get)
    return Requirement(rule, conditions[binding], conditions, binding)


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
