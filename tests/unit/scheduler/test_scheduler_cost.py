"""Cost accounting (formulas.md §1) on hand-computed numbers."""

from __future__ import annotations

import pytest

from scheduler.cost import CostMeter, dollars_per_step
from scheduler.errors import SchedulerError


def test_dollars_per_step_formula() -> None:
    # (T + wait/I)·(learner + Σc)/3600 = (100 + 20/2)·(3.06 + 0.55)/3600
    assert dollars_per_step(100.0, 20.0, 2, 3.06, [0.35, 0.20]) == pytest.approx(110 * 3.61 / 3600)
    assert dollars_per_step(3600.0, 0.0, 1, 1.0, []) == pytest.approx(1.0)


def test_meter_per_step_sums_to_the_period_formula() -> None:
    meter = CostMeter(learner_price=3.06)
    prices = [0.35, 0.20]
    meter.step(100.0, 0.0, prices)
    last = meter.step(100.0, 20.0, prices)  # all the period's wait fell in its second step
    assert last.step == 2 and last.wait == 20.0
    assert meter.dollars == pytest.approx(2 * dollars_per_step(100.0, 20.0, 2, 3.06, prices))
    assert last.cumulative == pytest.approx(meter.dollars)
    assert meter.bubble == pytest.approx(20 / 220)
    assert meter.dollars_per_step == pytest.approx(meter.dollars / 2)
    assert last.workers_price == pytest.approx(0.55)


def test_dollars_per_eval_improvement() -> None:
    meter = CostMeter(learner_price=36.0)  # 1 cent per second
    assert meter.dollars_per_improvement is None
    meter.record_eval(0.20)
    meter.step(100.0, 0.0, [])
    assert meter.dollars_per_improvement is None  # no improvement yet
    meter.record_eval(0.30)
    assert meter.dollars_per_improvement == pytest.approx(1.0 / 0.10)
    meter.record_eval(0.15)
    assert meter.dollars_per_improvement is None
    assert meter.summary()["baseline_eval"] == 0.20


def test_errors() -> None:
    with pytest.raises(SchedulerError):
        CostMeter(-1.0)
    with pytest.raises(SchedulerError):
        CostMeter(1.0).step(-1.0, 0.0, [])
    with pytest.raises(SchedulerError):
        dollars_per_step(1.0, 0.0, 0, 1.0, [])
