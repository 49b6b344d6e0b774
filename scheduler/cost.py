"""Dollar accounting (formulas.md §1): what each learner step costs and what it bought.

    $/step = (T + wait/I) · (learner $/h + Σ_{i∈A} c_i) / 3600  +  Σ_i (d_i·$↓_i + u_i·$↑_i) / I

where the second term is the bandwidth bill: `d_i`/`u_i` the GB worker `i` downloads/uploads
per published version (every worker downloads it; relays upload it again, as the broadcast
plan says) at its market's $/GB, spread over the I steps of a publication period.

where `wait` is the learner's idle time per publication period of `I` steps. `CostMeter` is
fed one step at a time with that step's own wait, which sums to the same total over a
period: Σ_k (T + w_k)·P = (I·T + wait)·P. Bubble ratio = idle / wall time of the learner.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from scheduler.errors import SchedulerError


def dollars_per_step(t_train: float, wait_per_period: float, publish_every: int,
                     learner_price: float, worker_prices: Iterable[float], bandwidth_per_version: float = 0.0) -> float:
    """The formula above: seconds per step times the fleet's $/h, over 3600, plus the
    bandwidth $ of one version (`bandwidth_per_version`) over the I steps it serves."""
    if t_train < 0 or wait_per_period < 0 or publish_every < 1 or learner_price < 0 or bandwidth_per_version < 0:
        raise SchedulerError("t_train, wait, prices and bandwidth must be ≥ 0 and publish_every ≥ 1")
    hourly = learner_price + math.fsum(worker_prices)
    return (t_train + wait_per_period / publish_every) * hourly / 3600.0 + bandwidth_per_version / publish_every


def bandwidth_dollars(traffic: dict[str, tuple[float, float]], rates: dict[str, tuple[float, float]]) -> float:
    """$ of one version's traffic: bytes (down, up) per worker × its ($/GB down, $/GB up)."""
    return math.fsum(d / 1e9 * rates.get(w, (0.0, 0.0))[0] + u / 1e9 * rates.get(w, (0.0, 0.0))[1]
                     for w, (d, u) in traffic.items())


@dataclass(frozen=True, slots=True)
class Budget:
    """`[scheduler] max_total_dollars` (0 = no budget). The run never passes it: it stops
    before a step that could (`exhausted`), and a learner waiting for rollouts stops waiting
    when the wait alone would leave too little for that step (`affordable_wait_s`)."""

    max_total: float = 0.0
    margin: float = 2.0  # a step is assumed to cost up to `margin` × the dearest recent one

    def exhausted(self, spent: float, recent_steps: Iterable[float]) -> str:
        """Why the run must stop now ('' = it may go on)."""
        worst = self.margin * max(recent_steps, default=0.0)
        if self.max_total and spent + worst > self.max_total:
            return (f"budget: ${spent:.4f} spent; the next step (up to ~${worst:.4f}) could pass "
                    f"max_total_dollars = ${self.max_total:g}")
        return ""

    def affordable_wait_s(self, spent: float, recent_steps: Iterable[float], dollars_per_hour: float) -> float:
        """Seconds the learner may still wait for a batch at `dollars_per_hour` and then afford
        its step (inf without a budget)."""
        if not self.max_total or dollars_per_hour <= 0:
            return math.inf
        left = self.max_total - spent - self.margin * max(recent_steps, default=0.0)
        return max(0.0, left / dollars_per_hour * 3600.0)


@dataclass(frozen=True, slots=True)
class StepCost:
    """One step's bill and the running totals after it."""

    step: int
    t_train: float  # s the learner computed
    wait: float  # s the learner waited for admissible rollouts
    learner_price: float  # $/h
    workers_price: float  # Σ c_i over active workers, $/h
    bandwidth: float  # $ of traffic billed with this step
    dollars: float  # this step (time + bandwidth)
    cumulative: float  # $ so far
    wall_s: float  # learner wall time so far
    bubble: float  # idle / wall so far

    def as_dict(self) -> dict:
        return asdict(self)


class CostMeter:
    """Running cost of a run; the learner calls `step` once per update and `record_eval`
    after each evaluation. Invariant: cumulative $ = Σ step $, idle ≤ wall."""

    def __init__(self, learner_price: float):
        if learner_price < 0:
            raise SchedulerError(f"learner_price must be ≥ 0 $/h, got {learner_price!r}")
        self.learner_price = learner_price
        self.steps = 0
        self.dollars = 0.0
        self.bandwidth_dollars = 0.0
        self.wall_s = 0.0
        self.idle_s = 0.0
        self.baseline_eval: float | None = None
        self.latest_eval: float | None = None

    def step(self, t_train: float, wait: float, worker_prices: Iterable[float], bandwidth: float = 0.0) -> StepCost:
        """One step: its time at the fleet's $/h, plus `bandwidth` $ of traffic billed with it."""
        if t_train < 0 or wait < 0 or bandwidth < 0:
            raise SchedulerError(f"t_train, wait and bandwidth must be ≥ 0, got {t_train!r}, {wait!r}, {bandwidth!r}")
        workers = math.fsum(worker_prices)
        wall = t_train + wait
        dollars = wall * (self.learner_price + workers) / 3600.0 + bandwidth
        self.steps += 1
        self.dollars += dollars
        self.bandwidth_dollars += bandwidth
        self.wall_s += wall
        self.idle_s += wait
        assert self.idle_s <= self.wall_s + 1e-9
        return StepCost(self.steps, t_train, wait, self.learner_price, workers, bandwidth, dollars,
                        self.dollars, self.wall_s, self.bubble)

    @property
    def bubble(self) -> float:
        return self.idle_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def dollars_per_step(self) -> float:
        return self.dollars / self.steps if self.steps else 0.0

    def record_eval(self, score: float) -> None:
        """The first score is the baseline; later ones measure improvement."""
        if not math.isfinite(score):
            raise SchedulerError(f"eval score must be finite, got {score!r}")
        if self.baseline_eval is None:
            self.baseline_eval = score
        self.latest_eval = score

    @property
    def dollars_per_improvement(self) -> float | None:
        """Cumulative $ per unit of eval improvement over the baseline; None until it improves."""
        if self.baseline_eval is None or self.latest_eval is None:
            return None
        gain = self.latest_eval - self.baseline_eval
        return self.dollars / gain if gain > 0 else None

    def summary(self) -> dict:
        return {
            "steps": self.steps, "dollars": self.dollars, "dollars_per_step": self.dollars_per_step,
            "bandwidth_dollars": self.bandwidth_dollars,
            "wall_s": self.wall_s, "idle_s": self.idle_s, "bubble": self.bubble,
            "baseline_eval": self.baseline_eval, "latest_eval": self.latest_eval,
            "dollars_per_improvement": self.dollars_per_improvement,
        }
