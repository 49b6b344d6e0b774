"""`echo-rl bench control-plane --hostile` in a seconds-long run: every attack class reaches the
real learner and is refused or contained, and no weight byte leaves without the read right.
Timing against the benign run is the benchmark's to report, not this test's."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from learner.bench.attacks import CLASSES, REFUSED

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~45 s, a benchmark; every attack class has its own test in `make test` (test_untrusted)
def test_a_hostile_share_of_the_fleet_is_refused_and_contained():
    out = subprocess.run([sys.executable, "-m", "learner.bench.control_plane", "--workers", "40", "--hostile", "0.2",
                          "--seconds", "10", "--ramp-s", "1", "--step-rate", "2", "--batch-prompts", "64", "--gen-s", "0.5",
                          "--churn", "0", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    assert r["hostile_workers"] == 8 and r["benign"]["workers"] == 40 and r["hostile"]["workers"] == 32
    attacks, learner = r["hostile"]["attacks"], r["hostile"]["learner"]
    assert not attacks["failures"]
    classes = attacks["classes"]
    assert all(classes[c]["sent"] > 0 for c in CLASSES), {c: v["sent"] for c, v in classes.items()}
    for c in REFUSED:  # refused every time, with a status (a 4xx), never a 5xx or a dropped connection
        assert all(o.isdigit() and 400 <= int(o) < 500 for o in classes[c]["outcomes"]), (c, classes[c]["outcomes"])
    assert not any(o.isdigit() and int(o) >= 500 for v in classes.values() for o in v["outcomes"])
    assert attacks["weight_bytes_without_credential"] == 0
    assert set(classes["bad-credentials"]["outcomes"]) <= {"401", "429"}
    assert classes["long-lease-id"]["longest_reply"] < 1024  # the id is not echoed back
    assert learner["max_leased_by_kind"].get("hostile", 0) <= learner["lease_first_prompts"]
    assert any(f["caught"] for f in attacks["forgers"])
    assert set(classes["rejoin"]["outcomes"]) <= {"403"}  # a caught forger's address may not join again
    assert learner["quarantined_by_kind"].get("sim", 0) + learner["quarantined_by_kind"].get("probe", 0) == 0  # no honest worker caught
    assert not learner["relays_probed"]  # no relay URL made the learner connect anywhere
    # Every safety goal as the benchmark judges it (the timing goals are left to the benchmark).
    checks = r["goals"]["checks"]
    safety = {k: v for k, v in checks.items() if k not in ("p99_within_10pct", "groups_within_10pct", "rss_bounded")}
    assert all(v["ok"] for v in safety.values()), safety


@pytest.mark.slow  # ~50 s, a benchmark
def test_an_interleaved_run_switches_the_attackers_and_judges_pairs_of_windows():
    out = subprocess.run([sys.executable, "-m", "learner.bench.control_plane", "--workers", "40", "--hostile", "0.2",
                          "--seconds", "30", "--interleave", "4", "--guard", "1", "--ramp-s", "1", "--step-rate", "2",
                          "--batch-prompts", "64", "--gen-s", "0.5", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    assert r["pairs"] == 3  # 30 s of 4 s windows: 8 (the last one half), the first pair (the ramp) left out
    assert [attacked for _, attacked in r["windows"]] == [False, True, True, False] * 2  # switched B H H B ...
    assert set(r["other_guards"]) == {"0.0", "2.0"}  # judged again without a guard and with twice it
    assert r["hostile_workers"] == 8 and r["run"]["workers"] == 32
    for route in ("heartbeat", "lease", "trajectories"):
        assert r["pooled_p99"][route]["samples"] > 0 and r["pooled_p99"][route]["paired"]
    checks = r["goals"]["checks"]
    assert all(v["ok"] for k, v in checks.items() if k != "p99_within_10pct"), checks
    assert r["run"]["attacks"]["classes"]["forged-rewards"]["sent"] > 0  # the attackers ran, paused or not


@pytest.mark.parametrize("argv, says", [
    (["--interleave", "30"], "give --hostile too"),
    (["--hostile", "0.05", "--interleave", "30", "--pairs", "3"], "leave out --pairs"),
    (["--hostile", "0.05", "--interleave", "30", "--guard", "30"], "shorter than a window"),
    (["--hostile", "0.05", "--interleave", "30", "--seconds", "120"], "at least 180"),
])
def test_interleave_settings_that_cannot_work_are_refused_with_what_to_do(argv, says):
    out = subprocess.run([sys.executable, "-m", "learner.bench.control_plane", *argv], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and says in out.stderr, out.stderr
