"""`echo-rl plan`: runs on the shipped pools, --json parses, config keys and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scheduler.plan import cli
from scheduler import capacity as cap

REPO = Path(__file__).resolve().parents[3]
POOLS = sorted((REPO / "configs" / "pools").glob("*.toml"))


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, dict]:
    code = cli(argv + ["--json"])
    return code, json.loads(capsys.readouterr().out)


def test_default_plan_prints_the_essentials(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli([]) == 0
    out = capsys.readouterr().out
    for needle in ("R_req", "greedy", "exact", "s_max", "PQS", "IQS", "simulator", "ρ = R·T/B", "bubble", "/step"):
        assert needle in out, needle


@pytest.mark.parametrize("pool", POOLS, ids=lambda p: p.name)
def test_plan_json_on_every_shipped_pool(capsys: pytest.CaptureFixture[str], pool: Path) -> None:
    argv = ["--pool", str(pool), "--sim-steps", "200"]
    if pool.name == "demo-local.toml":
        argv += ["--batch", "64", "--group-size", "8", "--t-train", "20", "--t-bcast", "2", "-S", "2"]
    code, plan = run_json(capsys, argv)
    assert code == 0
    inp, act = plan["inputs"], plan["activation"]
    B, T, Tb, I = inp["batch"], inp["t_train"], inp["t_bcast"], inp["publish_every"]
    req = cap.requirement("overlapped", batch=B, t_train=T, t_bcast=Tb, publish_every=I,
                          max_staleness=inp["max_staleness"])
    assert plan["capacity"]["r_req"] == pytest.approx(req.r_req) and plan["capacity"]["rule"] == "overlapped"
    assert act["exact"]["cost_per_hour"] <= act["greedy"]["cost_per_hour"] + 1e-9
    assert act["gap_per_hour"] == pytest.approx(act["greedy"]["cost_per_hour"] - act["exact"]["cost_per_hour"])
    for name in ("greedy", "exact"):
        assert act[name]["rate"] >= plan["capacity"]["target"] - 1e-9
    pipe = plan["pipeline"]
    assert pipe["rho"] == pytest.approx(pipe["rate"] * T / B)
    assert pipe["bubble"] == 0
    cf = plan["staleness"]["closed_form"]
    assert cf["total"] == pytest.approx(cf["pqs"] + cf["iqs"])
    sim = plan["staleness"]["simulator"]
    assert sim["max_staleness"] <= inp["max_staleness"]
    assert plan["cost"]["dollars_per_step"] == pytest.approx(T * plan["cost"]["dollars_per_hour"] / 3600)
    assert isinstance(plan["warnings"], list)


def test_infeasible_overlap_exits_2_with_smallest_period(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_json(capsys, ["-I", "1", "--t-train", "100", "--t-bcast", "250", "--rule", "paper"])
    assert code == 2
    assert out["smallest_feasible_period"] == 3
    assert "I ≥ 3, which needs a staleness budget S ≥ 4 (now S = 3)" in out["error"]
    # The overlapped rule hides the same broadcast within S = 3: (3 − 1 + 1)·100 s > 250 s.
    code, plan = run_json(capsys, ["-I", "1", "--t-train", "100", "--t-bcast", "250", "--sim-steps", "100"])
    assert code == 0 and plan["capacity"]["binding"] == "admissibility"
    # ...but not at S = 2, and the advice names S and I together.
    code, out = run_json(capsys, ["-I", "2", "-S", "2", "--t-train", "100", "--t-bcast", "250"])
    assert code == 2 and out["condition"] == "admissibility" and out["smallest_feasible_staleness"] == 4
    assert "S = 2, I = 2" in out["error"] and "I ≤ 1" not in out["error"]


def test_a_given_fleet_is_predicted_even_when_it_falls_short(capsys: pytest.CaptureFixture[str]) -> None:
    """`--active`: the machines someone already chose, checked against the rule."""
    pool = REPO / "configs" / "pools" / "demo-local.toml"
    base = ["--pool", str(pool), "--batch", "64", "--group-size", "8", "--t-train", "0.025", "--t-bcast", "0.01",
            "-S", "2", "--sim-steps", "200"]
    code, plan = run_json(capsys, base + ["--active", "cpu-cheap=1"])
    assert code == 0 and plan["activation"]["used"] == "given"
    given = plan["activation"]["given"]
    assert given["count"] == 1 and given["rate"] == pytest.approx(plan["pipeline"]["rate"])
    assert plan["pipeline"]["bubble"] > 0.5 and any("below R_req" in w for w in plan["warnings"])
    code, enough = run_json(capsys, base + ["--active", "cpu-cheap=1,cpu-mid=1,cpu-fast=1,cpu-pricey=1"])
    assert code == 0 and enough["pipeline"]["bubble"] < plan["pipeline"]["bubble"]
    assert enough["staleness"]["simulator"]["bubble"] < plan["staleness"]["simulator"]["bubble"]
    code, out = run_json(capsys, base + ["--active", "h100=2"])
    assert code == 2 and "not in pool" in out["error"]


def test_not_enough_capacity_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    # The whole demo pool declares 3,500 rollouts/s; B = 512 every 0.1 s needs more.
    code, out = run_json(capsys, ["--pool", str(REPO / "configs/pools/demo-local.toml"), "--t-train", "0.1",
                                  "--t-bcast", "0.01", "--no-simulate"])
    assert code == 2 and "not enough rollout capacity" in out["error"]


def test_config_file_then_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "learner.toml"
    cfg.write_text(
        '[run]\nname = "x"\n'  # tables plan does not read are ignored
        "[trainer]\nbatch_prompts = 8\nlr = 1e-5\n"
        "[rollout]\ngroup_size = 8\n"
        '[buffer]\nmax_staleness = 4\nqueue_factor = 2.0\ntype = "queue-drop"\n'
        "[publish]\nevery = 2\n"
        f'[scheduler]\npool = "{REPO / "configs/pools/demo-local.toml"}"\nalpha = 1.5\n'
        "t_train_s = 30.0\nt_bcast_s = 3.0\nlearner_price_per_hour = 0.5\n"
    )
    code, plan = run_json(capsys, ["--config", str(cfg), "--no-simulate"])
    assert code == 0
    inp = plan["inputs"]
    assert (inp["batch"], inp["group_size"], inp["max_staleness"], inp["publish_every"]) == (64, 8, 4, 2)
    assert (inp["alpha"], inp["t_train"], inp["queue_factor"], inp["pool"]) == (1.5, 30.0, 2.0, "demo-local")
    assert "simulator" not in plan["staleness"]
    code, plan = run_json(capsys, ["--config", str(cfg), "--no-simulate", "--alpha", "1.1", "-I", "3"])
    assert code == 0 and plan["inputs"]["alpha"] == 1.1 and plan["inputs"]["publish_every"] == 3


def test_what_a_config_leaves_out_is_planned_as_the_learner_runs_it(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A learner config without [buffer] queue_factor was planned at plan's q = 1 (and S = 3,
    B = 512) where the learner runs q = 2, S = 2, B = 64."""
    from learner.config import LearnerConfig
    from scheduler.plan import LEARNER_DEFAULTS

    learner = LearnerConfig()
    assert LEARNER_DEFAULTS == {
        ("trainer", "batch_prompts"): learner.trainer.batch_prompts, ("rollout", "group_size"): learner.rollout.group_size,
        ("buffer", "max_staleness"): learner.buffer.max_staleness, ("buffer", "queue_factor"): learner.buffer.queue_factor,
        ("buffer", "type"): learner.buffer.type, ("buffer", "backpressure"): learner.buffer.backpressure}
    cfg = tmp_path / "learner.toml"
    cfg.write_text(f'[scheduler]\npool = "{REPO / "configs/pools/demo-local.toml"}"\nt_train_s = 30.0\nt_bcast_s = 3.0\n')
    code, plan = run_json(capsys, ["--config", str(cfg), "--no-simulate"])
    inp = plan["inputs"]
    assert code == 0 and (inp["batch"], inp["group_size"], inp["max_staleness"], inp["queue_factor"]) == (
        learner.trainer.batch_prompts * learner.rollout.group_size, learner.rollout.group_size,
        learner.buffer.max_staleness, learner.buffer.queue_factor)


def test_a_mean_above_the_worst_case_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    """A new user's plan printed a mean staleness of 4.07 under a worst case of 3 without a word."""
    assert cli(["--pool", str(REPO / "configs/pools/consumer-gpus-8b.toml"), "--batch", "256", "-S", "4", "-I", "2",
                "--t-train", "60", "--t-bcast", "30", "--no-simulate"]) == 0
    out = capsys.readouterr().out
    assert "no queue" in out and "the mean is above the worst case because the two models differ" in out
    assert "bandwidth not counted: give a version's size" in out


def test_a_bubble_the_simulator_finds_and_the_rule_does_not_is_said_with_what_helps(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A new user's plan headlined "bubble 0.0%" (the capacity rule: rates alone) and ended with the
    simulator's 41.9% without a word on which to trust (2026-12-07): a rollout on a 64-slot GPU
    takes ~36 s, a group its longest of 16, three train steps, so at S = 2 most arrive too stale.
    The warning says so, and its suggestion holds in the simulator."""
    pool = ["--pool", str(REPO / "configs/pools/consumer-gpus.toml"), "--batch", "128", "--t-train", "30",
            "--t-bcast", "10"]
    code, plan = run_json(capsys, pool + ["-S", "2"])
    assert code == 0 and plan["pipeline"]["bubble"] == 0.0 and plan["staleness"]["simulator"]["bubble"] > 0.3
    warning = next(w for w in plan["warnings"] if w.startswith("the simulator's bubble"))
    assert "3.0 train steps" in warning and "more capacity does not shorten a rollout" in warning
    suggested = warning.split("try ")[1].split(")")[0].split()
    assert suggested == ["-S", "7", "-I", "1"]
    code, better = run_json(capsys, pool + suggested)
    assert better["staleness"]["simulator"]["bubble"] < 0.1
    assert not any(w.startswith("the simulator's bubble") for w in better["warnings"])


def test_config_errors_name_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[scheduler]\nalfa = 1.2\n")
    code, out = run_json(capsys, ["--config", str(cfg)])
    assert code == 2 and "alfa" in out["error"]
    cfg.write_text("[trainer]\nbatch_prompts = 'many'\n")
    code, out = run_json(capsys, ["--config", str(cfg)])
    assert code == 2 and "batch_prompts" in out["error"]
    code, out = run_json(capsys, ["--batch", "100", "--group-size", "16"])
    assert code == 2 and "multiple" in out["error"]


@pytest.mark.parametrize("text, named", [
    ('[buffer]\nqueue_factor = "x"\n', "queue_factor"), ("[buffer]\nqueue_factor = 0.5\n", "queue_factor"),
    ('[buffer]\ntype = "ring"\n', "type"), ('[buffer]\nbackpressure = "no"\n', "backpressure"),
    ("buffer = 3\n", "[buffer] must be a table"), ('rollout = "big"\n', "[rollout] must be a table")])
def test_malformed_buffer_values_are_named_not_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           text: str, named: str) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    code, out = run_json(capsys, ["--config", str(cfg)])
    assert code == 2 and named in out["error"] and str(cfg) in out["error"]


def test_staleness_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["staleness", "--concurrency", "64", "--batch", "128", "--queue-factor", "1", "--utilization", "0.8",
            "--tailness-multiplier", "1.5"]
    assert cli(argv) == 0
    assert "1.550" in capsys.readouterr().out
    code, out = run_json(capsys, argv + ["--simulate", "--steps", "600"])
    assert code == 0
    cf = out["closed_form"]
    assert (cf["pqs"], cf["iqs"], cf["total"]) == pytest.approx((0.75, 0.8, 1.55))
    assert out["simulator"]["total"] == pytest.approx(cf["total"], abs=0.1)


def test_sweep_writes_pngs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_json(capsys, ["sweep", "--out", str(tmp_path), "--no-simulate"])
    assert code == 0
    for f in out["files"]:
        assert Path(f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(out["pool"]["series"]) == {"S=2", "S=3", "S=4", "S=5"}


@pytest.mark.slow
def test_sweep_with_simulator(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_json(capsys, ["sweep", "--out", str(tmp_path)])
    assert code == 0 and out["frontier"]["simulated"] and out["pool"]["simulated"]


def test_help_works(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["staleness", "--help"], ["sweep", "--help"]):
        with pytest.raises(SystemExit) as e:
            cli(argv)
        assert e.value.code == 0
    assert "staleness" in capsys.readouterr().out
