"""Greedy and exact (ILP) activation on hand-made pools, checked against brute force."""

from __future__ import annotations

import itertools
import random

import pytest

from scheduler.activation import Candidate, compare, exact, greedy, unit_cost_order
from scheduler.errors import InsufficientCapacity, SchedulerError


def c(id_: str, rate: float, price: float) -> Candidate:
    return Candidate(id_, rate, price)


def test_greedy_takes_unit_cost_order_and_stops_when_covered() -> None:
    pool = [c("slow-cheap", 1.0, 0.05), c("fast", 4.0, 0.36), c("mid", 2.0, 0.16), c("pricey", 3.0, 0.60)]
    assert [x.id for x in unit_cost_order(pool)] == ["slow-cheap", "mid", "fast", "pricey"]
    a = greedy(pool, 3.0)
    assert a.ids == ["slow-cheap", "mid"]
    assert a.capacity == 3.0 and a.cost == pytest.approx(0.21)
    assert greedy(pool, 3.5).ids == ["slow-cheap", "mid", "fast"]


def test_exact_beats_greedy_where_greedy_overpays() -> None:
    # Greedy takes the better unit cost first (9/s for $8.10), then must add the 10/s machine.
    pool = [c("big", 10.0, 10.0), c("almost", 9.0, 8.1)]
    g, e = greedy(pool, 10.0), exact(pool, 10.0)
    assert g.ids == ["almost", "big"] and g.cost == pytest.approx(18.1)
    assert e.ids == ["big"] and e.cost == pytest.approx(10.0)
    assert e.optimal
    cmp = compare(pool, 10.0)
    assert cmp.gap == pytest.approx(8.1)
    assert cmp.gap_rel == pytest.approx(0.81)


def test_exact_combination_and_identical_machines() -> None:
    # 8 identical cards become one integer variable; the optimum mixes kinds.
    pool = [c(f"rtx4090-{k}", 3.0, 0.35) for k in range(8)] + [c(f"rtx4080-{k}", 2.0, 0.22) for k in range(6)]
    e = exact(pool, 7.0)
    assert e.cost == pytest.approx(0.79)  # 2 × 4080 + 1 × 4090
    assert sorted(e.ids) == ["rtx4080-0", "rtx4080-1", "rtx4090-0"]
    assert greedy(pool, 7.0).cost == pytest.approx(0.88)  # 4 × 4080


def test_exact_matches_brute_force_on_random_pools() -> None:
    rng = random.Random(3)
    for trial in range(25):
        pool = [c(f"w{k}", round(rng.uniform(0.5, 4), 2), round(rng.uniform(0.1, 1.0), 3)) for k in range(9)]
        total = sum(x.rate for x in pool)
        target = rng.uniform(0.1, 0.9) * total
        best = min(sum(x.price for x in s) for r in range(len(pool) + 1)
                   for s in itertools.combinations(pool, r) if sum(x.rate for x in s) >= target)
        e = exact(pool, target)
        assert e.cost == pytest.approx(best, abs=1e-9), trial
        assert e.capacity >= target
        assert greedy(pool, target).cost >= best - 1e-9


def test_not_enough_capacity() -> None:
    pool = [c("a", 1.0, 0.1), c("b", 2.0, 0.1)]
    for method in (greedy, exact):
        with pytest.raises(InsufficientCapacity) as e:
            method(pool, 3.5)
        assert e.value.available == pytest.approx(3.0)
        assert "Add workers" in str(e.value)
    assert greedy(pool, 3.0).ids == ["b", "a"]  # exactly enough is enough


def test_zero_target_and_bad_candidates() -> None:
    assert greedy([c("a", 1.0, 0.1)], 0.0).ids == []
    assert exact([c("a", 1.0, 0.1)], 0.0).ids == []
    with pytest.raises(SchedulerError):
        Candidate("x", 0.0, 1.0)
    with pytest.raises(SchedulerError):
        Candidate("x", 1.0, -1.0)
    with pytest.raises(SchedulerError, match="unique"):
        greedy([c("a", 1.0, 0.1), c("a", 2.0, 0.1)], 1.0)
