"""What a step costs and what the fleet delivered are the learner's numbers, not the workers' words:
a worker declaring $10,000/h, 10^7 rollouts/s and 10^6-second installs moves none of them."""

import time
from types import SimpleNamespace

import pytest

from learner.accounting import Accounting
from learner.metrics import LearnerMetrics
from scheduler.cost import CostMeter


def worker(wid: str, accepted: int, install_s: float) -> SimpleNamespace:
    now = time.monotonic()
    return SimpleNamespace(id=wid, fleet_key=wid, joined=now - 100, groups_accepted=accepted, capacity_per_s=1.0,
                           price_per_hour=10_000.0, rollouts_per_s=1e7,
                           installs=[(v, now - 1, now - 1, install_s) for v in range(3)])


def test_claimed_prices_rates_and_install_times_are_not_believed():
    honest = [worker("h1", accepted=5, install_s=0.5), worker("h2", accepted=3, install_s=0.7)]
    liars = [worker(f"s{i}", accepted=0, install_s=1e6) for i in range(3)]  # more identities than honest ones
    stats = SimpleNamespace(accepted=0)
    registry = SimpleNamespace(active=lambda now: honest + liars, workers={w.id: w for w in honest + liars},
                               buffer=SimpleNamespace(buffer=SimpleNamespace(stats=stats)))
    acct = Accounting(CostMeter(3.6), 1.0, registry=registry, publisher=SimpleNamespace(wire_bytes={}),
                      metrics=LearnerMetrics(), group_size=4)
    first = acct.step(wait=0.0, train=1.0)
    stats.accepted = 10  # 10 groups of 4 accepted since
    time.sleep(0.05)
    out = acct.step(wait=0.0, train=1.0)
    assert first["dollars_step"] == out["dollars_step"] == 0.001  # the learner's $3.60/h for 1 s, no worker's claim
    assert 0 < out["delivered"] <= 40 / 0.05  # what the buffer accepted, not 5 × 10^7
    assert out["install_s"] == 0.6  # the median of the two proven workers' own medians


def test_a_resumed_runs_summary_says_which_counts_are_the_whole_runs():
    """After kill -9 and --resume, the summary read '40 in 25.7 s' with 240 groups: the steps
    were the run's 40 but the wall time and groups only the resumed process's 30."""
    from rich.console import Console

    from learner.status import StatusDisplay

    summary = {"eval_accuracy_start": 0.19, "eval_accuracy_end": 0.14, "eval_version_end": 46, "steps": 40,
               "wall_s": 25.7, "learner_idle_ratio": 0.1, "groups_trained": 240, "recycled": 0, "dropped_overflow": 0,
               "rejected": {}, "leases_reissued": 0, "sampled_mean_length": 2.4, "trained_mean_length": 2.4,
               "cost": {"dollars": 0.01, "dollars_per_step": 0.0003}, "workers": [], "run_dir": "runs/x",
               "resumed_after_update": 10, "resume_reissued": 93}
    display = StatusDisplay(40, enabled=False)
    display.console = Console(record=True, width=400)
    display.summary(summary)
    text = display.console.export_text()
    assert "40, of which 30 after resuming at update 10 in 25.7 s" in text
    # The resume's line said 93 prompts re-issued, the summary 0 (a new user, 2026-12-07): both counted now
    assert "0 (leases lost or refused), 0 (groups dropped), 93 (in flight or rolled back at the resume)" in text
    display.console = Console(record=True, width=400)
    display.summary({**summary, "resumed_after_update": None})
    text = display.console.export_text()
    assert "40 in 25.7 s" in text and "eval accuracy " in text
    display.console = Console(record=True, width=400)  # a multi-turn task is evaluated by its mean return
    display.summary({**summary, "eval_metric": "mean return", "groups_replayed": 60})
    text = display.console.export_text()  # ...and with replay, a group's replays are counted beside it
    assert "eval mean return " in text and "240 (+60 replays) / 0 / 0" in text
    assert "quarantined" not in text
    display.console = Console(record=True, width=400)  # a quarantine is in the table, not only in the log above it
    display.summary({**summary, "quarantined": [{"id": "w5", "name": "[bold]cpu-b-1", "why": "its tokens ..."}]})
    text = display.console.export_text()
    assert "quarantined" in text and "[bold]cpu-b-1 (w5): its tokens ..." in text


def test_the_run_log_is_strict_json_when_r_req_is_infinite(tmp_path):
    """At S = 0 (or I = S + 1) R_req is infinite, and every record carried `"r_req": Infinity`,
    which strict parsers refuse (JavaScript's JSON.parse failed on 28 lines of a new user's run)."""
    import json
    import math

    import numpy as np

    from learner.metrics import RunLog

    log = RunLog(tmp_path / "metrics.jsonl")
    log.write({"step": 1, "r_req": math.inf, "loss": np.float32(0.5), "nan": float("nan"), "n": np.int64(3),
               "nested": {"x": [-math.inf, 1.0]}, "ok": True})
    log.close()

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    record = json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=refuse)
    assert record == {"step": 1, "r_req": None, "loss": 0.5, "nan": None, "n": 3, "nested": {"x": [None, 1.0]}, "ok": True}


def test_versions_never_received_are_given_up_on():
    """A proven worker that heartbeats but never reports another install held every later version
    in `published_at`, walked against every worker's installs each step, for the whole run."""
    from learner.accounting import UNMEASURED_KEEP

    wedged = worker("wedged", accepted=5, install_s=0.5)
    registry = SimpleNamespace(active=lambda now: [wedged], workers={"wedged": wedged},
                               buffer=SimpleNamespace(buffer=SimpleNamespace(stats=SimpleNamespace(accepted=0))))
    acct = Accounting(CostMeter(3.6), 1.0, registry=registry, publisher=SimpleNamespace(wire_bytes={}),
                      metrics=LearnerMetrics())
    for v in range(3, 1003):
        acct.published(v)
        acct.broadcast_times()
    assert len(acct.published_at) == UNMEASURED_KEEP and min(acct.published_at) == 1003 - UNMEASURED_KEEP


def test_a_big_fleets_plans_are_logged_as_their_summary_and_billed_whole():
    """A 1,000-worker plan's chains, parents and per-worker links were ~50 KB of every step
    record: half a gigabyte of run log over a week. A plan of more than 64 members is logged as
    its summary (the bandwidth bill reads the whole plan before); a small one is logged whole."""
    import json

    from learner.accounting import PLAN_LOG_MEMBERS

    def plan(n: int) -> dict:
        ids = [f"w{i}" for i in range(n)]
        return {"kind": "chains", "predicted_s": 1.0, "bytes": 1 << 20, "shares": [1.0], "chains": [ids],
                "parents": [list(range(-1, n - 1))], "pull": [], "links_mbit": {w: [100.0, 20.0] for w in ids}}

    registry = SimpleNamespace(active=lambda now: [], workers={},
                               buffer=SimpleNamespace(buffer=SimpleNamespace(stats=SimpleNamespace(accepted=0))))
    records = {}
    for n in (PLAN_LOG_MEMBERS, 1000):
        wire = {"raw": 1 << 20, "chunk": 1 << 16, "full": 1 << 20, "delta": None, "plans": {"v1": plan(n)}}
        acct = Accounting(CostMeter(3.6), 1.0, registry=registry,
                          publisher=SimpleNamespace(wire_bytes={1: wire}), metrics=LearnerMetrics(), group_size=4)
        records[n] = acct.step(wait=0.0, train=1.0)
    small, big = records[PLAN_LOG_MEMBERS]["snapshot_bytes"]["plans"]["v1"], records[1000]["snapshot_bytes"]["plans"]["v1"]
    assert len(small["chains"][0]) == PLAN_LOG_MEMBERS and "links_mbit" in small
    assert big["members"] == 1000 and big["trees"] == 1 and not {"chains", "parents", "links_mbit"} & set(big)
    assert big["predicted_s"] == 1.0 and len(json.dumps(records[1000])) < 2000


def test_step_statistics_keep_six_significant_digits_not_six_decimals():
    """An 8B run's learning rate of 5e-7 read 1e-6 in the run log, and a cosine floor of 3.81e-5
    read 3.8e-5 (a resumed run's last rate looked wrong by 0.4%)."""
    from learner.record import logged

    assert logged(5e-7) == 5e-7 and logged(3.81414961939e-05) == 3.81415e-05
    assert logged(0.123456789) == 0.123457 and logged(float("inf")) == float("inf")


def test_a_worker_still_starting_its_engine_does_not_measure_the_broadcast():
    """A worker joined, then loaded vLLM for 12 s while v1 was published: its first install came
    12 s after v1, read as T_bcast, and the scheduler called the run infeasible at S = 5 (a new
    user's vLLM demo, 2026-12-07). Only workers with an install before the publication measure it."""
    now = time.monotonic()
    running = worker("running", accepted=5, install_s=0.5)
    running.installs = [(0, now - 10, now - 10, 0.5), (1, now - 0.9, now - 0.9, 0.5)]
    starting = worker("starting", accepted=5, install_s=0.5)
    starting.installs = [(1, now + 2.0, now + 2.0, 0.5)]  # its engine came up after v1 was published
    registry = SimpleNamespace(active=lambda now: [running, starting], workers={"running": running, "starting": starting},
                               buffer=SimpleNamespace(buffer=SimpleNamespace(stats=SimpleNamespace(accepted=0))))
    acct = Accounting(CostMeter(3.6), 1.0, registry=registry, publisher=SimpleNamespace(wire_bytes={}),
                      metrics=LearnerMetrics())
    acct.published_at[1] = now - 1.0
    assert acct.broadcast_times() == {1: pytest.approx(0.1)}  # the running worker's 0.1 s, not the starting one's 3 s
