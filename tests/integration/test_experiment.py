"""`echo-rl experiment staleness`: the analysis of a run log, the arms, and the whole harness in
its seconds-long smoke mode (a real learner and real workers on loopback)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from learner.bench.experiment import Arm, Prices, RunResult, analyse, cli, parse_arms, summarise, table


def _write_log(run_dir: Path, accuracies: dict[int, float], steps: int = 6, uses=None) -> Path:
    run_dir.mkdir(parents=True)
    lines = [{"event": "eval", "step": 0, "eval_accuracy": accuracies.get(0, 0.1)}]
    for k in range(1, steps + 1):
        rec = {"step": k, "time": 1000.0 + 2.0 * k, "loss": 0.0, "tokens": 100 * k, "is_weight_mean": 1.0,
               "is_truncated_fraction": 0.1 if k == steps else 0.0, "mismatch_kl": 0.0, "staleness": [0, 1],
               "recycled": k, "dropped_overflow": 0, "idle_ratio": 0.5, "reward_mean": 0.1 * k}
        if uses:
            rec.update(uses=uses, replayed=sum(u > 1 for u in uses))
        lines.append(rec)
        if k in accuracies:
            lines.append({"event": "eval", "step": k, "eval_accuracy": accuracies[k]})
    (run_dir / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    return run_dir


def test_analyse_reads_target_wall_time_rollouts_and_weights_from_the_run_log(tmp_path):
    run = _write_log(tmp_path / "a", {2: 0.4, 4: 0.7, 6: 0.65})
    r = analyse(run, "sync", 0, target=0.6, group_size=4)
    assert r.steps == 6 and r.wall_s == 10.0  # from the first update (t = 1002) to the last (t = 1012)
    assert r.evals == [(0, 0.0, 0.1), (2, 2.0, 0.4), (4, 6.0, 0.7), (6, 10.0, 0.65)]
    assert (r.steps_to_target, r.wall_to_target) == (4, 6.0)
    assert r.final_accuracy == pytest.approx((0.4 + 0.7 + 0.65) / 3)  # the last three evals
    assert r.rollouts_to_target == (4 * 2 + 4) * 4  # 4 steps of 2 fresh groups + 4 dropped groups, n = 4
    assert r.truncated_share == pytest.approx(0.1 * 600 / 2100)  # token-weighted: only the last step truncated
    assert r.mean_staleness == 0.5 and r.max_staleness == 1 and r.step_period_s == 2.0
    assert r.wasted_share == pytest.approx(6 / (12 + 6)) and r.reward_last == pytest.approx(0.35)
    assert analyse(run, "sync", 0, target=0.9, group_size=4).steps_to_target is None  # never reached
    # In a longer run, final accuracy is the mean of the evals in the last 50 updates only.
    long = analyse(_write_log(tmp_path / "long", {40: 0.1, 60: 0.2, 80: 0.6, 100: 0.7, 120: 0.8}, steps=120),
                   "sync", 0, target=None, group_size=4)
    assert long.final_accuracy == pytest.approx(0.7)


def test_replay_counts_and_fresh_rollouts_come_from_the_per_step_uses(tmp_path):
    r = analyse(_write_log(tmp_path / "b", {6: 0.5}, uses=[1, 2]), "S1-I1-replay2", 0, target=0.5, group_size=4)
    assert r.reuse_counts == {"1": 6, "2": 6} and r.replayed_share == 0.5
    assert r.rollouts_to_target == (6 * 1 + 6) * 4  # the replayed group of each step generated nothing


def test_summary_prices_dollars_to_target_and_the_centralized_configuration():
    runs = [RunResult("sync", s, "", True, steps=10, final_accuracy=0.8 + s / 100, steps_to_target=8,
                      wall_to_target=100.0, rollouts_to_target=800, reward_last=0.5) for s in range(2)]
    runs += [RunResult("S2-I1", s, "", True, steps=10, final_accuracy=0.8, steps_to_target=10, wall_to_target=50.0,
                       mean_staleness=1.5, max_staleness=2, truncated_share=0.01, reward_last=0.4 + s / 10)
             for s in range(2)]
    prices = Prices(learner=3.6, worker=0.36, workers=4)
    rows = {r["arm"]: r for r in summarise(runs, [Arm(0, 1), Arm(2, 1)], prices, target=0.7)}
    assert rows["sync"]["dollars_to_target"] == pytest.approx(100 * (3.6 + 4 * 0.36) / 3600)
    assert rows["centralized (sync)"]["dollars_to_target"] == pytest.approx(100 * 5 * 3.6 / 3600)
    assert rows["S2-I1"]["speedup_vs_sync"] == 2.0 and rows["S2-I1"]["dollars_to_target"] == pytest.approx(0.07)
    assert rows["sync"]["final_accuracy"] == pytest.approx(0.805) and rows["sync"]["final_vs_sync"] == 0
    assert rows["sync"]["final_vs_sync_se"] is None and rows["centralized (sync)"]["reward_vs_sync_se"] is None
    assert rows["S2-I1"]["final_vs_sync"] == pytest.approx(0.8 / 0.805 - 1)
    assert rows["S2-I1"]["reward_vs_sync"] == pytest.approx(-0.1) and rows["S2-I1"]["reward_last_sd"] > 0
    text = table(list(rows.values()))
    assert text.count("\n") == 2 + 2 and "| S2-I1 | 2 | 0.000 | 10 ± 0 | 50.0 ± 0.0 | 2.00x |" in text
    assert "| -1% ± 1 |" in text and "| 0.450 ± 0.071 | -10% ± 10 |" in text  # ± the standard error of the gap
    assert rows["S2-I1"]["reward_vs_sync_se"] == pytest.approx(0.0707 / 2**0.5 / 0.5, rel=1e-3)


def test_a_finished_sweep_is_analysed_again_from_its_run_directories(tmp_path, capsys):
    for name, acc in (("sync-seed0-20260101-000000", 0.7), ("sync-seed1-20260101-000100", 0.5),
                      ("S1-I1-seed0-20260101-000200", 0.6)):
        run = _write_log(tmp_path / "runs" / name, {2: 0.4, 4: acc, 6: acc})
        (run / "summary.json").write_text("{}")
    _write_log(tmp_path / "runs" / "S2-I1-seed0-20260101-000300", {2: 0.4})  # cut short: no summary, left out
    (tmp_path / "base.toml").write_text("[rollout]\ngroup_size = 4\n[workers]\nspawn = 2\n"
                                        "overrides = ['--worker.price_per_hour', '0.5']\n")
    assert cli(["staleness", "--results", str(tmp_path), "--target", "0.5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["arm"]: r for r in report["rows"]}
    assert list(rows) == ["sync", "S1-I1", "centralized (sync)"] and report["seeds"] == 2
    assert (rows["sync"]["runs"], rows["sync"]["reached"], rows["sync"]["steps_to_target"]) == (2, 2, 4)
    assert report["prices"]["worker"] == 0.5 and report["prices"]["workers"] == 2
    assert cli(["staleness", "--results", str(tmp_path / "nowhere")]) == 2
    assert "base.toml" in capsys.readouterr().err


def test_arms_follow_the_publication_rule_and_refuse_what_cannot_work():
    arms = parse_arms([0, 1, 2, 4], [1, 2], None, 0.5)
    assert [a.name for a in arms] == ["sync", "S1-I1", "S1-I1-replay2-pos0.5", "S2-I1", "S2-I1-replay2-pos0.5",
                                      "S4-I3", "S4-I3-replay2-pos0.5"]  # no replay within S = 0
    assert [a.name for a in parse_arms([3], [1], 2, 0.0)] == ["S3-I2"]
    with pytest.raises(ValueError, match="use 1 \\(no replay\\)"):
        parse_arms([1], [0], None, 0.0)
    with pytest.raises(ValueError, match="publish-every 3 > S = 2"):
        parse_arms([2], [1], 3, 0.0)


@pytest.mark.slow  # ~35 s, a benchmark (`make test-slow` runs it); its analysis is tested above without runs
def test_smoke_runs_the_real_learner_and_workers_synchronously_and_with_replay(tmp_path, capsys):
    """`make test`: the harness end to end in seconds. S = 0 trains only groups of the current
    version (the synchronous baseline, no deadlock); S = 2 with reuse 2 replays groups. The model
    does not exist yet, as in a fresh clone: the harness builds it first."""
    model = tmp_path / "model"
    code = cli(["staleness", "--smoke", "--workers", "2", "--out", str(tmp_path), "--target", "0.0", "--json",
                "--model.path", str(model)])
    out = capsys.readouterr()
    assert code == 0, (out.err[-3000:], out.out[-3000:])  # the out has each failed run's log path
    report = json.loads(out.out)
    assert all(r["ok"] for r in report["runs"]), [r["error"] for r in report["runs"]]
    assert (model / "config.json").exists() and f"built {model}" in out.err
    runs = {r["arm"]: r for r in report["runs"]}
    assert set(runs) == {"sync", "S2-I1-replay2"} and all(r["ok"] and r["steps"] == 6 for r in runs.values())
    sync, replay = runs["sync"], runs["S2-I1-replay2"]
    assert sync["max_staleness"] == 0 and sync["replayed_share"] == 0 and sync["reuse_counts"] == {"1": 24}
    assert replay["max_staleness"] <= 2 and replay["replayed_share"] > 0 and "2" in replay["reuse_counts"]
    replay_summary = json.loads((Path(replay["run_dir"]) / "summary.json").read_text())
    assert replay_summary["groups_replayed"] > 0 and replay_summary["groups_trained"] + replay_summary["groups_replayed"] == 24
    assert [e[0] for e in sync["evals"]] == [0, 3, 6] and sync["final_accuracy"] is not None
    # Every trained group of the synchronous run was generated by the version it trained (the run log).
    steps = [json.loads(line) for line in (Path(sync["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert all(s == 0 for rec in steps if "loss" in rec for s in rec["staleness"])
    rows = {r["arm"]: r for r in report["rows"]}
    assert rows["centralized (sync)"]["price_per_hour"] > rows["sync"]["price_per_hour"]
    assert (tmp_path / "results.json").exists() and (tmp_path / "table.md").read_text().startswith("| arm |")
    assert (tmp_path / "staleness.png").stat().st_size > 10_000
