"""Min-cost activation (formulas.md §1 (3)): choose workers whose rates cover a target.

    min Σ_{i∈A} c_i   s.t.   Σ_{i∈A} r_i ≥ target

- `greedy`: the paper's rule — sort by unit cost `u_i = c_i/r_i` and activate until the
  cumulative rate reaches the target. Fast, online, and can overpay (it never looks back).
- `exact`: the 0/1 covering ILP, solved by CBC through pulp. Identical candidates (same rate
  and price, e.g. the 8 entries of "8 × rtx4090") become one integer variable `0..count`,
  which removes symmetric branches and keeps big homogeneous pools fast.

Both return an `Activation` whose invariants are asserted: it covers the target and its cost
is the sum of its members' prices. `exact` is never costlier than `greedy` when it reports
optimality; `compare` measures the gap.
"""

from __future__ import annotations

import math
import re
import time
import warnings
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from scheduler.errors import InsufficientCapacity, SchedulerError

_TOL = 1e-9


@dataclass(frozen=True, slots=True)
class Candidate:
    """One worker that could be activated: `rate` rollouts/s at `price` $/h."""

    id: str
    rate: float
    price: float

    def __post_init__(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise SchedulerError(f"candidate {self.id!r}: rate must be > 0 rollouts/s, got {self.rate!r}")
        if not (self.price >= 0 and math.isfinite(self.price)):
            raise SchedulerError(f"candidate {self.id!r}: price must be ≥ 0 $/h, got {self.price!r}")

    @property
    def unit_cost(self) -> float:
        """`c_i / r_i`: dollars per hour per rollout/s."""
        return self.price / self.rate


@dataclass(frozen=True, slots=True)
class Activation:
    """A chosen set of workers. Invariant: `capacity ≥ target` (up to 1e-9 relative)."""

    method: Literal["greedy", "exact"]
    chosen: tuple[Candidate, ...]
    target: float
    solve_s: float = 0.0
    optimal: bool = True  # False when the ILP hit its time limit with a feasible incumbent
    cost: float = field(init=False)
    capacity: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cost", math.fsum(c.price for c in self.chosen))
        object.__setattr__(self, "capacity", math.fsum(c.rate for c in self.chosen))
        assert self.capacity >= self.target * (1 - _TOL) - _TOL, "activation must cover its target"

    @property
    def ids(self) -> list[str]:
        return [c.id for c in self.chosen]


def _check(candidates: Sequence[Candidate], target: float) -> None:
    if not (target >= 0 and math.isfinite(target)):
        raise SchedulerError(f"target must be a finite rate ≥ 0 rollouts/s, got {target!r}")
    ids = [c.id for c in candidates]
    if len(set(ids)) != len(ids):
        raise SchedulerError("candidate ids must be unique")
    available = math.fsum(c.rate for c in candidates)
    if available < target * (1 - _TOL) - _TOL:
        raise InsufficientCapacity(target, available)


def natural_key(text: str) -> tuple:
    """Sort key that orders 'rtx3090-2' before 'rtx3090-10'."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", text) if p)


def unit_cost_order(candidates: Iterable[Candidate]) -> list[Candidate]:
    """Cheapest per unit of rate first; ties by higher rate (fewer machines), then id."""
    return sorted(candidates, key=lambda c: (c.unit_cost, -c.rate, natural_key(c.id)))


def greedy(candidates: Sequence[Candidate], target: float) -> Activation:
    """The paper's online rule: activate by increasing unit cost until the target is covered."""
    t0 = time.perf_counter()
    _check(candidates, target)
    chosen: list[Candidate] = []
    total = 0.0
    for cand in unit_cost_order(candidates):
        if total >= target * (1 - _TOL):
            break
        chosen.append(cand)
        total += cand.rate
    return Activation("greedy", tuple(chosen), target, time.perf_counter() - t0)


def exact(candidates: Sequence[Candidate], target: float, time_limit_s: float | None = 60.0) -> Activation:
    """Min-cost covering as an ILP (pulp + CBC, silent). Optimal unless the time limit hit,
    in which case the best feasible incumbent is returned with `optimal=False`."""
    import pulp  # lazy: importing pulp costs ~0.2 s and only this function needs it

    t0 = time.perf_counter()
    _check(candidates, target)
    if target <= 0:
        return Activation("exact", (), target, time.perf_counter() - t0)
    # Identical (rate, price) candidates are interchangeable: one integer variable per kind.
    kinds: dict[tuple[float, float], list[Candidate]] = defaultdict(list)
    for cand in candidates:
        kinds[(cand.rate, cand.price)].append(cand)
    groups = list(kinds.values())
    with warnings.catch_warnings():
        # pulp 3.x deprecates the pulp 2.8 API (LpVariable, PULP_CBC_CMD) that both still run;
        # PULP_CBC_CMD is the one that ships a CBC binary with the wheel.
        warnings.simplefilter("ignore", DeprecationWarning)
        prob = pulp.LpProblem("activation", pulp.LpMinimize)
        xs = [
            pulp.LpVariable(f"x{k}", lowBound=0, upBound=len(g), cat="Integer" if len(g) > 1 else "Binary")
            for k, g in enumerate(groups)
        ]
        prob += pulp.lpSum(g[0].price * x for g, x in zip(groups, xs))
        # The covering constraint has a tiny slack so a set that reaches the target exactly in
        # real arithmetic is not cut off by the float sum.
        prob += pulp.lpSum(g[0].rate * x for g, x in zip(groups, xs)) >= target * (1 - _TOL)
        prob.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s))
    status = pulp.LpStatus[prob.status]
    if status != "Optimal":
        raise SchedulerError(f"the activation ILP ended with status {status!r}; try greedy() instead")
    chosen: list[Candidate] = []
    for g, x in zip(groups, xs):
        chosen.extend(sorted(g, key=lambda c: natural_key(c.id))[: round(x.value() or 0)])
    # pulp reports "Optimal" for a time-limited solve with an incumbent; CBC's solution
    # status tells the difference (1 = proven optimal).
    optimal = getattr(prob, "sol_status", pulp.LpSolutionOptimal) == pulp.LpSolutionOptimal
    return Activation("exact", tuple(unit_cost_order(chosen)), target, time.perf_counter() - t0, optimal)


@dataclass(frozen=True, slots=True)
class Comparison:
    greedy: Activation
    exact: Activation

    @property
    def gap(self) -> float:
        """Greedy's extra cost over the exact optimum, in $/h (≥ 0 when exact is optimal)."""
        return self.greedy.cost - self.exact.cost

    @property
    def gap_rel(self) -> float:
        return self.gap / self.exact.cost if self.exact.cost > 0 else 0.0


def compare(candidates: Sequence[Candidate], target: float, time_limit_s: float | None = 60.0) -> Comparison:
    """Both methods on the same pool. Invariant: an optimal exact never costs more than greedy."""
    result = Comparison(greedy(candidates, target), exact(candidates, target, time_limit_s))
    if result.exact.optimal:
        assert result.exact.cost <= result.greedy.cost * (1 + 1e-7) + 1e-9, "ILP optimum above greedy"
    return result
