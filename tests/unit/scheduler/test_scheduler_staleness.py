"""Closed-form staleness (formulas.md §2) on hand-computed cases, and the length model."""

from __future__ import annotations

import math

import numpy as np
import pytest

from scheduler import staleness as st
from scheduler.errors import SchedulerError


def test_r_star() -> None:
    assert st.r_star(1) == pytest.approx(0.5)
    assert st.r_star(2) == pytest.approx((3 - 1 - math.sqrt(3)) / 4)
    assert st.r_star(2) == pytest.approx(0.067, abs=5e-4)
    assert st.r_star(4) < st.r_star(2) < st.r_star(1)


def test_hand_computed_points() -> None:
    # the example: C = 64, B = 128, q = 1, ρ = 0.8, M_tail = 1.5
    p = st.predict(0.8, 64 / 128, 1.0, 1.5)
    assert (p.pqs, p.iqs, p.total) == pytest.approx((0.75, 0.8, 1.55))
    assert p.regime == "rollout-bound"
    # train-bound: PQS = 2·1·(1/2)/… ; IQS = (2q − 1)/(2ρ) + 1/2
    p = st.predict(1.5, 1.0, 2.0, 2.0)
    assert p.pqs == pytest.approx(2.0 / 1.5)
    assert p.iqs == pytest.approx(3 / 3 + 0.5)
    assert p.regime == "train-bound"


def test_iqs_branches_meet_at_rho_one_for_q_one() -> None:
    assert st.iqs(1.0, 1.0) == 1.0
    assert st.iqs(1.0 + 1e-9, 1.0) == pytest.approx(1.0)
    assert st.iqs(1.0 + 1e-9, 2.0) == pytest.approx(2.0)  # q > 1: the queue fills, a jump


def test_t_eff_ratio_minimum_and_matching_point() -> None:
    for r in (0.1, 1.0, 3.0):
        assert st.t_eff_ratio(1.0, r) == pytest.approx(1.0)
        for rho in (0.5, 0.9, 1.1, 2.0):
            assert st.t_eff_ratio(rho, r) > 1.0
            if rho > 1:
                lo = st.matching_rollout_bound_rho(rho, r)
                assert lo < 1
                assert st.t_eff_ratio(lo, r) == pytest.approx(st.t_eff_ratio(rho, r))


@pytest.mark.parametrize("q", [1.0, 1.5, 2.0, 4.0])
def test_r_star_separates_where_train_bound_can_win(q: float) -> None:
    """Below r*(q) some train-bound point is less stale than the rollout-bound point with the
    same step time (PQS is equal there, so compare IQS); above r*(q) none is."""
    rhos = np.linspace(1.0001, 60, 20000)

    def best_gap(r: float) -> float:
        return min(st.iqs(x, q) - st.iqs(st.matching_rollout_bound_rho(x, r), q) for x in rhos)

    assert best_gap(st.r_star(q) * 0.9) < 0
    assert best_gap(st.r_star(q) * 1.1) > 0


def _monte_carlo(sigma: float, n: int, cap: float = 8.0) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    lengths = np.minimum(cap, np.exp(sigma * rng.standard_normal((100_000, n)) - sigma * sigma / 2))
    return float(lengths.mean()), float(lengths.max(axis=1).mean() / lengths.mean())


@pytest.mark.parametrize(("sigma", "n"), [(0.3, 8), (0.6, 16), (1.0, 4), (1.5, 16)])
def test_length_model_matches_monte_carlo(sigma: float, n: int) -> None:
    mean, m_tail = _monte_carlo(sigma, n)
    assert st.length_mean(1.0, sigma) == pytest.approx(mean, rel=3e-3)
    assert st.tail_multiplier(sigma, n) == pytest.approx(m_tail, rel=3e-3)


def test_tail_multiplier_limits_and_inverse() -> None:
    assert st.tail_multiplier(0.0, 16) == 1.0
    assert st.tail_multiplier(0.8, 1) == 1.0
    for m in (1.2, 1.5, 2.5):
        sigma = st.sigma_for_tail_multiplier(m, 16)
        assert st.tail_multiplier(sigma, 16) == pytest.approx(m, rel=1e-4)
    with pytest.raises(SchedulerError, match="out of reach"):
        st.sigma_for_tail_multiplier(50.0, 4)


def test_errors() -> None:
    with pytest.raises(SchedulerError):
        st.iqs(1.5, 0.5)
    with pytest.raises(SchedulerError):
        st.pqs(0.0, 0.5, 1.0)
    with pytest.raises(SchedulerError):
        st.pqs(1.0, 0.5, 0.9)
