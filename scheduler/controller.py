"""The closed-loop provisioning controller (formulas.md §1 (4), the paper's §3.5 and B.2.1).

It keeps `R_eff = Σ_{i active} a_i·r̂_i` at or above the target `α·R_req`:

- `a_i` from heartbeats: a worker that has not beaten for `heartbeat_timeout_s`, or that
  said `alive=False`, is unavailable;
- `r̂_i` an EWMA of the worker's reported delivered (rewarded) rollouts/s. Until a worker has
  been active for `warmup_s` (it is downloading the snapshot and starting its engine) it
  counts at its declared prior rate and its reports are not folded in;
- below target for `window_s` → activate the cheapest available workers (unit cost
  `c_i/r̂_i`) until the target is covered; losing an active worker, or having none, acts at
  once (that deficit is a fact, not noise), and so does a worker joining while the last
  activation fell short (self-joined workers arriving seconds apart: the first was activated,
  the rest idled a whole window, 60 s by default, while the fleet ran short);
- never more than `max_price_per_hour` (the budget, for the workers) active: activation skips
  a machine that would pass it, and prices that rose past it release the dearest first;
- above `(1 + release_margin)·target` for `window_s` → release the active worker with the
  highest unit cost whose removal leaves `R_eff ≥ (1 + release_margin/2)·target`, one per
  window (gradual, and never back into the activation zone: no flapping). On the way down the
  target is the highest of the last `release_lookback_s` (three windows by default), as
  Kubernetes' autoscaler stabilises a scale-down: a target that swings (a noisy useful share, a
  step slowed by the workers sharing its CPU) released, in the demo, a machine it activated
  again 15 s later, four times in two minutes.

The controller is pure: it is fed plain numbers (`join`, `observe`, `tick`) and returns
`Decision`s; the learner adapter turns them into messages and owns the clock. Invariant
(asserted): every active worker is registered and available after each `tick`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Literal

from scheduler.errors import SchedulerError

#: The target `tick` is given when no capacity can meet the capacity rule (every worker is activated)
INFEASIBLE = 1e12


@dataclass(frozen=True, slots=True)
class ControllerParams:
    """Tuning knobs; defaults suit heartbeats every few seconds and steps of a minute."""

    alpha: float = 1.2  # safety factor: target = alpha · R_req
    window_s: float = 60.0  # a deviation must last this long before the controller acts
    release_margin: float = 0.3  # release only above (1 + margin)·target
    heartbeat_timeout_s: float = 10.0  # no beat for this long → unavailable
    ewma: float = 0.2  # weight of each new throughput report in r̂
    warmup_s: float = 30.0  # a freshly activated worker counts at its prior this long
    max_price_per_hour: float = math.inf  # Σ c_i of the active workers never exceeds it (the budget)
    release_lookback_s: float | None = None  # releases judge the highest target this far back (None: 3·window_s)

    def __post_init__(self) -> None:
        if not self.alpha >= 1:
            raise SchedulerError(f"alpha must be ≥ 1, got {self.alpha!r}")
        if self.window_s < 0 or self.warmup_s < 0 or not self.heartbeat_timeout_s > 0:
            raise SchedulerError("window_s and warmup_s must be ≥ 0 and heartbeat_timeout_s > 0")
        if self.release_margin < 0:
            raise SchedulerError(f"release_margin must be ≥ 0, got {self.release_margin!r}")
        if not self.max_price_per_hour > 0:
            raise SchedulerError(f"max_price_per_hour must be > 0, got {self.max_price_per_hour!r}")
        if self.release_lookback_s is not None and not self.release_lookback_s >= 0:
            raise SchedulerError(f"release_lookback_s must be ≥ 0, got {self.release_lookback_s!r}")
        if not 0 < self.ewma <= 1:
            raise SchedulerError(f"ewma must be in (0, 1], got {self.ewma!r}")


@dataclass(frozen=True, slots=True)
class Decision:
    action: Literal["activate", "release"]
    worker_id: str
    reason: str


@dataclass(slots=True)
class _Worker:
    id: str
    price: float  # $/h
    rate: float  # r̂: EWMA of reports, or the prior until the first report counts
    last_beat: float
    alive: bool = True
    active: bool = False
    active_since: float = -math.inf

    @property
    def unit_cost(self) -> float:
        return self.price / self.rate if self.rate > 0 else math.inf


@dataclass(frozen=True, slots=True)
class ControllerStatus:
    now: float
    r_req: float
    target: float
    r_eff: float
    active: tuple[str, ...]
    available: int  # registered and alive, active or not
    active_price: float  # Σ c_i over active workers ($/h)
    shortfall: float  # rollouts/s the pool could not cover at the last activation (0 if none)


class Controller:
    """Decides which workers to activate or release; see the module docstring."""

    def __init__(self, params: ControllerParams | None = None):
        self.p = params or ControllerParams()
        self._workers: dict[str, _Worker] = {}
        self._below_since: float | None = None
        self._above_since: float | None = None
        self._urgent = False
        self._shortfall = 0.0
        self._last: ControllerStatus | None = None
        self._targets: deque[tuple[float, float]] = deque()  # (time, target), decreasing targets: a sliding maximum

    # --- inputs ----------------------------------------------------------------------------

    def join(self, now: float, worker_id: str, price: float, expected_rate: float) -> None:
        """A worker is available (idle) at `price` $/h; `expected_rate` rollouts/s is its prior."""
        if not (expected_rate > 0 and price >= 0):
            raise SchedulerError(f"worker {worker_id!r}: expected_rate must be > 0 and price ≥ 0")
        old = self._workers.get(worker_id)
        if old is not None and old.active:
            old.alive, old.last_beat, old.price = True, now, price
            return
        self._workers[worker_id] = _Worker(worker_id, price, expected_rate, now)
        if self._shortfall > 0:  # it meets a deficit already acted on (not noise): at the next tick
            self._urgent = True

    def observe(self, now: float, worker_id: str, alive: bool, rollouts_per_s: float | None = None,
                price: float | None = None) -> None:
        """A heartbeat: availability, delivered rewarded rollouts/s since the last beat, price."""
        w = self._workers.get(worker_id)
        if w is None:
            raise SchedulerError(f"heartbeat from unknown worker {worker_id!r}: call join() first")
        if price is not None:
            w.price = price
        if not alive:
            if w.active:
                self._urgent = True  # a known loss of capacity: replace it at the next tick
            w.alive = False
            return
        w.alive = True
        w.last_beat = now
        if (rollouts_per_s is not None and w.active and now - w.active_since >= self.p.warmup_s
                and rollouts_per_s >= 0):
            w.rate += self.p.ewma * (rollouts_per_s - w.rate)

    def set_price(self, worker_id: str, price: float) -> None:
        """The worker's $/h changed (its bandwidth bill moved with the step time or snapshot size)."""
        w = self._workers.get(worker_id)
        if w is not None and price >= 0:
            w.price = price

    def release_all(self, reason: str) -> list[Decision]:
        """Release every active worker (the run stops: its budget is spent)."""
        out = [Decision("release", w.id, reason) for w in self._workers.values() if w.active]
        for w in self._workers.values():
            w.active = False
        return out

    def forget(self, worker_id: str) -> None:
        """The worker left the pool for good (no decision is emitted for it)."""
        w = self._workers.pop(worker_id, None)
        if w is not None and w.active:
            self._urgent = True

    # --- the decision ----------------------------------------------------------------------

    def tick(self, now: float, r_req: float) -> list[Decision]:
        """Re-evaluate at time `now` against the current `R_req` (rollouts/s)."""
        if not (r_req >= 0 and math.isfinite(r_req)):
            raise SchedulerError(f"r_req must be a finite rate ≥ 0, got {r_req!r}")
        p = self.p
        target = p.alpha * r_req
        peak = self._peak(now, target)
        decisions: list[Decision] = []
        for w in self._workers.values():
            if w.alive and now - w.last_beat > p.heartbeat_timeout_s:
                w.alive = False
            if w.active and not w.alive:
                w.active = False
                self._urgent = True
                decisions.append(Decision("release", w.id, f"unavailable: no heartbeat for {now - w.last_beat:.0f} s"))
        decisions += self._within_budget()
        r_eff = self.r_eff
        active = [w for w in self._workers.values() if w.active]

        if r_eff < target:
            self._above_since = None
            if self._below_since is None:
                self._below_since = now
            if self._urgent or not active or now - self._below_since >= p.window_s:
                decisions += self._activate(now, target - r_eff, target)
                self._below_since = None
            self._urgent = False
        elif r_eff > (1 + p.release_margin) * peak and active:
            self._below_since = None
            self._shortfall = 0.0
            self._urgent = False
            if self._above_since is None:
                self._above_since = now
            if now - self._above_since >= p.window_s:
                decisions += self._release_one(r_eff, peak, target)
                self._above_since = None
        else:
            self._below_since = self._above_since = None
            self._urgent = False
            self._shortfall = 0.0

        assert all(w.alive for w in self._workers.values() if w.active)
        assert math.fsum(w.price for w in self._workers.values() if w.active) <= self.p.max_price_per_hour + 1e-9
        self._last = self._status(now, r_req, target)
        return decisions

    def _peak(self, now: float, target: float) -> float:
        """The highest target of the last `release_lookback_s`, this one's included."""
        lookback = 3 * self.p.window_s if self.p.release_lookback_s is None else self.p.release_lookback_s
        kept = self._targets
        while kept and kept[-1][1] <= target:
            kept.pop()
        kept.append((now, target))
        while kept[0][0] < now - lookback:
            kept.popleft()
        return kept[0][1]

    def _within_budget(self) -> list[Decision]:
        """Prices rose past `max_price_per_hour`: release the dearest by unit cost until under it."""
        out: list[Decision] = []
        cap = self.p.max_price_per_hour
        for w in sorted((w for w in self._workers.values() if w.active), key=lambda w: (-w.unit_cost, w.id)):
            spent = math.fsum(x.price for x in self._workers.values() if x.active)
            if spent <= cap:
                break
            w.active = False
            out.append(Decision("release", w.id, f"budget: active workers cost ${spent:.3f}/h > max ${cap:.3f}/h"))
        return out

    def _activate(self, now: float, deficit: float, target: float) -> list[Decision]:
        idle = sorted((w for w in self._workers.values() if w.alive and not w.active),
                      key=lambda w: (w.unit_cost, -w.rate, w.id))
        out: list[Decision] = []
        added = 0.0
        spent = math.fsum(w.price for w in self._workers.values() if w.active)
        for w in idle:
            if added >= deficit:
                break
            if spent + w.price > self.p.max_price_per_hour:
                continue  # the budget: a dearer machine never, a cheaper one may still fit
            spent += w.price
            w.active, w.active_since = True, now
            added += w.rate
            out.append(Decision("activate", w.id, "no capacity meets the rule: every worker" if target >= INFEASIBLE
                                else f"R_eff below target {target:.3g}/s by {deficit:.3g}/s"))
        self._shortfall = max(0.0, deficit - added)
        return out

    def _release_one(self, r_eff: float, peak: float, target: float) -> list[Decision]:
        floor = (1 + self.p.release_margin / 2) * peak
        judged = f"target {target:.3g}/s" if peak <= target else f"the recent highest target {peak:.3g}/s"
        for w in sorted((w for w in self._workers.values() if w.active), key=lambda w: (-w.unit_cost, w.id)):
            if r_eff - w.rate >= floor:
                w.active = False
                return [Decision("release", w.id, f"R_eff {r_eff:.3g}/s above {judged} by the margin")]
        return []

    # --- outputs -----------------------------------------------------------------------------

    @property
    def r_eff(self) -> float:
        """`Σ_{i active} a_i·r̂_i` now (rollouts/s)."""
        return math.fsum(w.rate for w in self._workers.values() if w.active and w.alive)

    @property
    def active(self) -> list[str]:
        return sorted(w.id for w in self._workers.values() if w.active)

    def rate_estimate(self, worker_id: str) -> float:
        return self._workers[worker_id].rate

    def _status(self, now: float, r_req: float, target: float) -> ControllerStatus:
        act = [w for w in self._workers.values() if w.active]
        return ControllerStatus(
            now=now, r_req=r_req, target=target, r_eff=self.r_eff, active=tuple(sorted(w.id for w in act)),
            available=sum(w.alive for w in self._workers.values()),
            active_price=math.fsum(w.price for w in act), shortfall=self._shortfall,
        )

    def status(self) -> ControllerStatus | None:
        """What the last `tick` saw (no side effects); None before the first tick."""
        return self._last
