"""Capacity rule, staleness bound and bubble model (formulas.md §1) on hand-computed cases."""

from __future__ import annotations

import itertools
import math

import pytest

from scheduler import capacity as cap
from scheduler.errors import InfeasibleOverlap, SchedulerError


def test_required_rate_hand_case() -> None:
    # I·B/(I·T − T_b) = 2·512/(240 − 60)
    assert cap.required_rate(512, 120.0, 60.0, 2) == pytest.approx(1024 / 180)
    # no broadcast delay: exactly one batch per step
    assert cap.required_rate(64, 8.0, 0.0, 1) == pytest.approx(8.0)


def test_overlap_holds_exactly_at_r_req_and_not_below() -> None:
    r = cap.required_rate(512, 120.0, 60.0, 2)
    assert cap.overlap_holds(512, 120.0, 60.0, 2, r)
    assert not cap.overlap_holds(512, 120.0, 60.0, 2, r * 0.999)
    assert cap.bubble(512, 120.0, 60.0, 2, r) == (0.0, 0.0)


@pytest.mark.parametrize(("period", "t_train", "t_bcast", "smallest"), [
    (1, 120.0, 150.0, 2),
    (1, 120.0, 120.0, 2),   # I·T = T_b is infeasible too (R would be infinite)
    (2, 120.0, 240.0, 3),
    (3, 10.0, 95.0, 10),
])
def test_infeasible_reports_smallest_feasible_period(period: int, t_train: float, t_bcast: float, smallest: int) -> None:
    with pytest.raises(InfeasibleOverlap) as e:
        cap.required_rate(100, t_train, t_bcast, period)
    assert e.value.smallest_feasible_period == smallest
    assert f"I ≥ {smallest}, which needs a staleness budget S ≥ {smallest + 1}" in str(e.value)
    # and that period really is feasible while the one below is not
    assert cap.required_rate(100, t_train, t_bcast, smallest) > 0
    with pytest.raises(InfeasibleOverlap):
        cap.required_rate(100, t_train, t_bcast, smallest - 1)


def test_bad_inputs_are_typed_errors() -> None:
    with pytest.raises(SchedulerError):
        cap.required_rate(0, 1.0, 0.0, 1)
    with pytest.raises(SchedulerError):
        cap.required_rate(10, 1.0, -1.0, 1)
    with pytest.raises(SchedulerError):
        cap.plan_capacity(10, 1.0, 0.0, 1, alpha=0.9)


def test_default_publish_every() -> None:
    assert cap.default_publish_every(3) == 2
    assert cap.default_publish_every(2) == 1
    assert cap.default_publish_every(1) == 1
    with pytest.raises(SchedulerError, match="S ≥ 1"):
        cap.default_publish_every(0)


def test_staleness_bound_hand_cases() -> None:
    # k* = ⌈(60 + 512/7)/120⌉ = ⌈1.11⌉ = 2 → I − 1 + 2 = 3
    assert cap.staleness_bound(512, 120.0, 60.0, 2, 7.0) == 3
    # (T_b + B/R)/T is exactly 2: the ceiling must not round up to 3
    assert cap.staleness_bound(100, 10.0, 10.0, 1, 10.0) == 2
    assert cap.staleness_bound(100, 0.1, 0.1, 1, 1000.0) == 2  # same, with floats that do not add exactly
    # I = S − 1 and T_b ≤ T under overlap → s_max ≤ S
    assert cap.staleness_bound_under_overlap(120.0, 60.0, 2) == 3
    assert cap.staleness_bound_under_overlap(120.0, 500.0, 1) == 1  # I = 1: the broadcast term vanishes


def test_overlap_tightened_bound_dominates_on_a_grid() -> None:
    """App. A: whenever (1) holds, I − 1 + k* ≤ I + ⌈(1 − 1/I)·T_b/T⌉, and ≤ I + 1 if T_b ≤ T."""
    for B, T, Tb, I, slack in itertools.product((64, 512), (1.0, 7.5, 120.0), (0.0, 0.3, 5.0, 100.0, 400.0),
                                               (1, 2, 3, 5), (1.0, 1.2, 3.0)):
        if I * T <= Tb:
            continue
        R = slack * cap.required_rate(B, T, Tb, I)
        assert cap.overlap_holds(B, T, Tb, I, R)
        bound = cap.staleness_bound(B, T, Tb, I, R)
        assert bound <= cap.staleness_bound_under_overlap(T, Tb, I)
        if Tb <= T:
            assert bound <= I + 1


def test_bubble_below_capacity() -> None:
    B, T, Tb, I = 512, 120.0, 60.0, 2
    r = cap.required_rate(B, T, Tb, I) / 2
    wait, ratio = cap.bubble(B, T, Tb, I, r)
    assert wait == pytest.approx(I * B / r + Tb - I * T)
    assert ratio == pytest.approx(wait / (I * T + wait))
    assert 0 < ratio < 1
    assert cap.bubble(B, T, Tb, I, 0.0) == (math.inf, 1.0)


def test_overlapped_rule_takes_the_larger_of_throughput_and_admissibility() -> None:
    # B = 64, T = 0.08 s, I = 1, S = 2, learner-visible T_b = 0.13 s, installs 0.01 s: the paper's rule
    # gives up (I·T ≤ T_b), but training continues on older snapshots during the broadcast.
    with pytest.raises(InfeasibleOverlap):
        cap.requirement("paper", batch=64, t_train=0.08, t_bcast=0.13, publish_every=1, max_staleness=2)
    req = cap.requirement("overlapped", batch=64, t_train=0.08, t_bcast=0.13, publish_every=1, max_staleness=2,
                          install_s=0.01)
    assert req.conditions["throughput"] == pytest.approx(64 / 0.07)
    assert req.conditions["admissibility"] == pytest.approx(64 / (2 * 0.08 - 0.13))
    assert req.r_req == max(req.conditions.values()) and req.binding == "admissibility"
    # At R = R_req the App. A bound reaches S exactly: I − 1 + ⌈(T_b + B/R)/T⌉ = S.
    assert cap.staleness_bound(64, 0.08, 0.13, 1, req.r_req) == 2
    # With room to spare the throughput condition binds, as in the paper's rule with T_b = τ.
    easy = cap.requirement("overlapped", batch=64, t_train=1.0, t_bcast=0.2, publish_every=2, max_staleness=4,
                           install_s=0.1)
    assert easy.binding == "throughput" and easy.r_req == pytest.approx(2 * 64 / (2 - 0.1))


@pytest.mark.parametrize("I,S,t_bcast,needs", [
    (3, 4, 0.2, ["S = 4, I = 3", "I ≤ 2", "S ≥ 5", "T_bcast < 0.16 s"]),
    (5, 5, 0.1, ["S = 5, I = 5", "I ≤ 4", "S ≥ 6"]),  # T_b ≥ T: I = S leaves one step for the broadcast
    (2, 2, 0.3, ["S ≥ 5"]),
    (6, 5, 0.0, ["S = 5, I = 6", "I ≤ 5"]),  # I > S: every rollout would be dropped (the demo's old advice)
    (3, 1, 0.2, ["S = 1, I = 3", "S ≥ 5", "= -1·0.08 s"]),  # no broadcast is fast enough: none advised
])
def test_overlapped_infeasibility_names_i_s_and_the_broadcast_time(I, S, t_bcast, needs) -> None:
    with pytest.raises(InfeasibleOverlap) as e:
        cap.requirement("overlapped", batch=64, t_train=0.08, t_bcast=t_bcast, publish_every=I, max_staleness=S)
    assert e.value.condition == "admissibility"
    for text in needs:
        assert text in str(e.value), str(e.value)
    assert ("T_bcast <" in str(e.value)) == (S - I + 1 > 0)  # "T_bcast < 0 s" was advised at S - I + 1 <= 0
    if e.value.largest_feasible_period:  # the advice is right: that I works at this S
        cap.requirement("overlapped", batch=64, t_train=0.08, t_bcast=t_bcast,
                        publish_every=e.value.largest_feasible_period, max_staleness=S)
    cap.requirement("overlapped", batch=64, t_train=0.08, t_bcast=t_bcast, publish_every=I,
                    max_staleness=e.value.smallest_feasible_staleness)


def test_without_a_staleness_filter_only_throughput_binds() -> None:
    """`--buffer.staleness_filter false` (pure queue-drop) drops nothing for age, yet the scheduler
    called I = 8 at S = 5 infeasible, "dropped whatever the capacity", and rented the whole pool."""
    with pytest.raises(InfeasibleOverlap):
        cap.requirement("overlapped", batch=64, t_train=0.08, t_bcast=0.3, publish_every=8, max_staleness=5)
    req = cap.requirement("overlapped", batch=64, t_train=0.08, t_bcast=0.3, publish_every=8, max_staleness=None,
                          install_s=0.01)
    assert req.conditions == {"throughput": pytest.approx(8 * 64 / (8 * 0.08 - 0.01))}
    assert req.binding == "throughput"
    with pytest.raises(InfeasibleOverlap, match=r"publish less often or make installs faster"):
        cap.requirement("overlapped", batch=64, t_train=0.08, t_bcast=0.3, publish_every=1, max_staleness=None,
                        install_s=0.5)
