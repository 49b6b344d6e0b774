"""`echo-rl report` reads what runs write: a resumed run's repeated steps, a torn last line, an
episodic task's negative returns (a new user's poker and resume runs, 2026-11-28)."""

from __future__ import annotations

import json

from echo.report import eval_metric, load_run, plot


def _step(step: int, version: int, reward: float) -> dict:
    return {"step": step, "version": version, "loss": 0.1, "reward_mean": reward, "avg_staleness": 1.0,
            "max_staleness": 2, "queue_size": 3, "idle_ratio": 0.1}


def test_a_resumed_runs_repeated_steps_count_once_and_a_torn_line_is_skipped(tmp_path):
    lines = [_step(s, s, -2.5) for s in range(1, 19)]  # killed at step 18, checkpoint at 10
    lines.append({"event": "eval", "step": 10, "version": 10, "eval_accuracy": -1.7})
    lines += [_step(s, s + 7, -2.4) for s in range(11, 21)]  # resumed: 11-18 again, at newer versions
    text = "\n".join(json.dumps(r) for r in lines) + '\n{"step": 21, "loss"'  # a kill cut the last line
    (tmp_path / "metrics.jsonl").write_text(text)
    (tmp_path / "summary.json").write_text(json.dumps({"eval_metric": "mean return"}))
    steps, evals = load_run(tmp_path)
    assert [r["step"] for r in steps] == list(range(1, 21))
    assert [r["version"] for r in steps if r["step"] in (10, 11, 18)] == [10, 18, 25]  # the resumed run's
    assert [(e["step"], e["eval_accuracy"]) for e in evals] == [(10, -1.7)]
    assert eval_metric(tmp_path) == "mean return" and eval_metric(tmp_path / "nowhere") == "accuracy"
    assert plot(tmp_path, tmp_path / "report.png").stat().st_size > 0


def test_a_run_without_a_step_is_named_not_drawn_empty(tmp_path, capsys):
    """A run that stopped before its first update (a busy port) wrote an empty report.png and
    said 'wrote ...'."""
    from echo.report import cli

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"event": "start", "step": 0}) + "\n")
    assert cli([str(tmp_path)]) == 1
    assert "no training step yet" in capsys.readouterr().err and not (tmp_path / "report.png").exists()
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_step(1, 1, 0.5)) + "\n")
    assert cli([str(tmp_path)]) == 0 and (tmp_path / "report.png").exists()


def test_a_resume_event_drops_what_the_killed_process_logged_past_its_checkpoint(tmp_path):
    """The resumed run redoes steps 11-14 (and the eval at 12) after its `resume` event: the killed
    process's 13 and 14, not redone this time (the run ended at 12), must not stand either."""
    lines = [_step(s, s, 0.1) for s in range(1, 15)]
    lines.append({"event": "eval", "step": 12, "version": 12, "eval_accuracy": 0.9})
    lines.append({"event": "resume", "step": 10, "version": 14, "checkpoint": "step-000010"})
    lines += [_step(s, s + 4, 0.2) for s in (11, 12)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    steps, evals = load_run(tmp_path)
    assert [(r["step"], r["reward_mean"]) for r in steps][-3:] == [(10, 0.1), (11, 0.2), (12, 0.2)]
    assert evals == []


def test_a_run_without_a_summary_is_labelled_by_its_eval_events_and_its_resume_marked(tmp_path):
    """A poker run stopped before its summary: its plot read "accuracy" for returns in big blinds,
    and its cumulative idle curve jumped at the resume with nothing to say why."""
    lines = [_step(s, s, -0.5) for s in range(1, 9)]
    lines.append({"event": "eval", "step": 8, "version": 8, "metric": "mean return", "eval_accuracy": -0.54})
    lines.append({"event": "resume", "step": 8, "version": 10, "checkpoint": "step-000008"})
    lines += [_step(s, s + 2, -0.4) for s in (9, 10)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    from echo.report import resumes

    steps, evals = load_run(tmp_path)
    assert eval_metric(tmp_path, evals) == "mean return" and eval_metric(tmp_path) == "accuracy"
    assert resumes(tmp_path) == [8]
    assert plot(tmp_path, tmp_path / "report.png").stat().st_size > 0
