"""The hostile bench's p99 verdict (learner.bench.tails): pooled runs, a two-stage bootstrap
interval, and a verdict only where the interval decides it."""

import functools

import numpy as np
import pytest

from learner.bench import tails


def runs(n: int, scale: float, seed: int, per_run: int = 3000, seconds: float = 60.0, burst: float = 1.0):
    """`n` runs of log-normal latencies; `burst`: one run in three has its tail that much longer."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        lat = scale * rng.lognormal(0.0, 0.8, per_run) * (burst if k % 3 == 0 else 1.0)
        out.append((sorted(rng.uniform(0, seconds, per_run)), lat.tolist()))
    return out


def test_the_same_latency_is_met_and_twice_it_missed():
    same = tails.ratio(runs(4, 1.0, 1), runs(4, 1.0, 2))
    assert same["low"] < 1.0 < same["high"] and tails.verdict(same, 1.10) == "met"
    assert 0.95 < same["ratio"] < 1.05
    double = tails.ratio(runs(4, 1.0, 1), runs(4, 2.0, 2))
    assert 1.9 < double["ratio"] < 2.1 and tails.verdict(double, 1.10) == "missed"


def test_runs_that_differ_widen_the_interval_until_nothing_is_settled():
    """Both arms alike, but one run in three with a tail twice as long (a run's own luck): the
    ratio's interval must hold 1 and be too wide to call, where windows alone would be narrow."""
    calm = tails.ratio(runs(3, 1.0, 1), runs(3, 1.0, 2))
    lumpy = tails.ratio(runs(3, 1.0, 1, burst=2.0), runs(3, 1.0, 2, burst=2.0))
    assert lumpy["low"] < 1.0 < lumpy["high"]
    assert lumpy["high"] - lumpy["low"] > 2 * (calm["high"] - calm["low"])
    assert tails.verdict(lumpy, 1.10) == "not settled"


def test_too_few_requests_are_not_judged():
    r = tails.ratio(runs(2, 1.0, 1, per_run=300), runs(2, 3.0, 2, per_run=300))
    assert r["samples"] == 600 and tails.verdict(r, 1.10) == "too few samples"
    assert tails.verdict(tails.ratio([], runs(1, 1.0, 1)), 1.10) == "too few samples"


def test_the_runs_are_counterbalanced_so_a_drifting_machine_favours_neither_arm():
    """Benign and hostile alike on a machine slowing 10% per run: B H B H puts every hostile run
    after its benign one and reads the drift as the attack's cost; B H H B ... does not."""
    turns = tails.hostile_turns(4)
    assert turns == [False, True, True, False, False, True, True, False]
    rng = np.random.default_rng(0)
    sitting = [runs(1, 1.0 + 0.1 * slot, int(rng.integers(1 << 30)), per_run=20000)[0] for slot in range(8)]
    ratio = functools.partial(tails.ratio, reps=10)  # the point estimate is what is asked here
    counterbalanced = ratio([r for r, h in zip(sitting, turns) if not h], [r for r, h in zip(sitting, turns) if h])
    alternated = ratio(sitting[0::2], sitting[1::2])
    assert alternated["ratio"] > 1.04  # the drift of one slot, read as the attack's
    assert abs(counterbalanced["ratio"] - 1.0) < (alternated["ratio"] - 1.0) / 2
    benign = [r for r, h in zip(sitting, turns) if not h]  # slots 0, 3, 4, 7
    a, b = tails.halves(benign)
    assert [sitting.index(r) for r in a] == [0, 7] and [sitting.index(r) for r in b] == [3, 4]  # both at 3.5 on average


def drifting_sitting(pairs: int, effect: float, seed: int, drift: float = 0.15):
    """`pairs` benign/hostile pairs on a machine whose speed moves between pairs (log-sd `drift`)
    and hardly within one (log-sd 0.03): the hostile arm `effect` times slower."""
    rng = np.random.default_rng(seed)
    benign, hostile = [], []
    for _ in range(pairs):
        machine = rng.lognormal(0.0, drift)
        for arm, f in ((benign, 1.0), (hostile, effect)):
            arm.append(runs(1, machine * f * rng.lognormal(0.0, 0.03), int(rng.integers(1 << 30)), per_run=4000,
                            seconds=120.0)[0])
    return benign, hostile


def test_pairs_drawn_together_cancel_a_machine_that_drifts_between_them():
    """The pairs' shared machine is not the attack's: drawn pair by pair, the interval holds the
    truth and is half as wide as each arm's runs drawn on their own, enough to call it."""
    benign, hostile = drifting_sitting(8, 1.0, seed=3)
    paired = tails.ratio(benign, hostile, paired=True, reps=400)
    apart = tails.ratio(benign, hostile, reps=400)
    assert paired["ratio"] == apart["ratio"]  # the same pooled requests: only the interval differs
    assert paired["low"] < 1.0 < paired["high"] and apart["low"] < 1.0 < apart["high"]
    assert paired["high"] - paired["low"] < 0.6 * (apart["high"] - apart["low"])
    assert tails.verdict(paired, 1.10) == "met" and tails.verdict(apart, 1.10) == "not settled"
    slower = tails.ratio(*drifting_sitting(8, 1.25, seed=4), paired=True, reps=400)
    assert slower["low"] < 1.25 < slower["high"] and tails.verdict(slower, 1.10) == "missed"


def test_pairs_need_both_runs():
    benign, hostile = drifting_sitting(3, 1.0, seed=5)
    with pytest.raises(ValueError, match="as many runs"):
        tails.ratio(benign, hostile[:2], paired=True)
    hostile[1] = ([], [])  # a run whose probes answered nothing: its pair goes, not the pairing
    r = tails.ratio(benign, hostile, paired=True, reps=50)
    assert r["samples"] == 8000 and r["paired"]


def test_the_bench_judges_by_pairs_and_keeps_the_unpaired_interval_beside():
    from learner.bench.control_plane import pool_tails

    benign, hostile = drifting_sitting(4, 1.0, seed=6)
    probes = lambda run: {"at": {"heartbeat": run[0]}, "latency": {"heartbeat": run[1]}}  # noqa: E731
    out = {"routes": {"heartbeat": {}}, "goals": {"checks": {}}}
    pool_tails(out, [(probes(b), probes(h)) for b, h in zip(benign, hostile)])
    r = out["pooled_p99"]["heartbeat"]
    assert r["paired"] and not r["unpaired"]["paired"] and r["benign_a_vs_b"]["paired"]
    assert r["verdict"] == tails.verdict(r, 1.10)
    assert r["high"] - r["low"] < r["unpaired"]["high"] - r["unpaired"]["low"]
    assert "over the pairs" in out["goals"]["checks"]["p99_within_10pct"]["detail"]


def test_an_interleaved_run_is_cut_into_pairs_of_windows_less_the_ramp_and_each_guard():
    from learner.bench.control_plane import interleaved

    t0, every, guard = 1000.0, 10.0, 2.0
    attacked = tails.hostile_turns(4)  # B H H B B H H B
    windows = [(t0 + 0.3 + every * k, a) for k, a in enumerate(attacked)]  # the switches, a little after the start
    at = [0.1 + 0.5 * k for k in range(170)]  # a request every 0.5 s for 85 s
    # Its latency says which window it ended in and whether that one was attacked: 1 ms benign, 2 ms attacked
    lat = [(2e-3 if attacked[min(int((a - 0.3) // every), 7)] else 1e-3) if a >= 0.3 else 1e-3 for a in at]
    probes = {"t0": t0, "at": {"heartbeat": at}, "latency": {"heartbeat": lat}}
    pairs = interleaved(probes, windows, 80.3, guard)
    assert len(pairs) == 3  # windows 0 and 1 (the ramp) left out
    for benign, hostile in pairs:  # each pair is (benign, attacked), whichever came first
        assert set(benign["latency"]["heartbeat"]) == {1e-3} and set(hostile["latency"]["heartbeat"]) == {2e-3}
        for run in (benign, hostile):  # times from the window's start, the guard's requests left out
            assert min(run["at"]["heartbeat"]) >= guard and max(run["at"]["heartbeat"]) < every
            assert len(run["at"]["heartbeat"]) == 16  # (10 - 2) s at two requests a second
    # The last window ends with the run (76.3 s: window 7, benign, from 70.3 s), not at a switch that never came
    benign, hostile = interleaved(probes, windows, 76.3, guard)[-1]
    assert len(benign["at"]["heartbeat"]) == 8 and len(hostile["at"]["heartbeat"]) == 16


def test_an_interleaved_run_needs_its_switches_to_alternate_in_each_pair():
    from learner.bench.control_plane import interleaved

    windows = [(0.0, False), (10.0, True), (20.0, True), (30.0, True)]
    with pytest.raises(ValueError, match="one benign and one attacked"):
        interleaved({"t0": 0.0, "at": {"heartbeat": [25.0]}, "latency": {"heartbeat": [1e-3]}}, windows, 40.0, 1.0)
