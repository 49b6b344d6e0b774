"""Smoke tests of the benchmarks with tiny sizes (the numbers come from running them in full)."""

from __future__ import annotations

import json

import pytest

from scheduler.bench.planning import cli


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    assert cli(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_activation_bench(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(capsys, ["activation", "--sizes", "40", "--trials", "2", "--small-target", "5"])
    assert len(out["runs"]) == 4
    for run in out["runs"]:
        assert run["optimal"] and 0 <= run["gap"] <= run["gap_bound"] + 1e-9


def test_staleness_bench(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(capsys, ["staleness", "--steps", "120", "--batch", "64", "--group-size", "8"])
    assert len(out["points"]) == 42
    assert set(out["worst_abs_diff"]) == {"away", "near ρ=1", "deterministic"}


def test_speed_bench(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(capsys, ["speed", "--rollouts", "20000"])
    assert all(c["rollouts"] >= 20000 * 0.5 and c["rollouts_per_s"] > 0 for c in out["cases"])


def test_usage() -> None:
    assert cli(["--help"]) == 0
    assert cli(["nope"]) == 2
