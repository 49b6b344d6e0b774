"""`echo-rl experiment staleness`: does asynchrony pay? The real learner and workers, measured end
to end for the synchronous baseline (`S = 0`) and bounded staleness `S = 1..4`, each with and
without the replay buffer, over several seeds.

Every arm is one `echo-learner` process with local worker processes on loopback; only
`[buffer] max_staleness`, `[publish] every`, `[buffer] reuse` and the seed differ between arms.
Workers are throttled (`[worker] max_rollouts_per_s`) so the fleet, not the tiny learner, sets
the pace, as rented GPUs generating long responses would. Runs are interleaved (seed 0 of every
arm, then seed 1, ...) so drift in machine load spreads over arms, and each run holds an
exclusive lock (`/tmp/echo-measure.lock`) so it never overlaps another timing measurement.

From each run's `metrics.jsonl`: eval accuracy against steps and wall time (from the first
update, so worker start-up is left out), steps, seconds, rollouts generated and dollars to a
target accuracy, final accuracy, staleness, importance-weight statistics and replay counts.
Dollars are wall time × (learner $/h + workers × worker $/h); the centralized configuration
prices the same synchronous runs as if every generating machine cost the learner's $/h (ECHO-2
§5: rollouts co-located on data-center GPUs).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from echo.config import ConfigError, dump_toml

ROOT = Path(__file__).resolve().parents[2]  # the tree whose code runs (a frozen copy, for long sweeps)
LOCK = Path("/tmp/echo-measure.lock")
DEFAULT_CONFIG = "configs/experiments/staleness.toml"
FINAL_WINDOW = 50  # final accuracy and reward: means over a run's last this many updates


@dataclass(frozen=True)
class Arm:
    """One configuration of the comparison."""

    staleness: int  # S; 0 = synchronous
    publish_every: int  # I
    reuse: int = 1  # [buffer] reuse; 1 = no replay
    positive_bias: float = 0.0

    @property
    def name(self) -> str:
        base = "sync" if self.staleness == 0 else f"S{self.staleness}-I{self.publish_every}"
        if self.reuse > 1:
            base += f"-replay{self.reuse}" + (f"-pos{self.positive_bias:g}" if self.positive_bias else "")
        return base

    def overrides(self) -> list[str]:
        return ["--buffer.max_staleness", str(self.staleness), "--publish.every", str(self.publish_every),
                "--buffer.reuse", str(self.reuse), "--buffer.positive_bias", str(self.positive_bias)]


@dataclass
class RunResult:
    arm: str
    seed: int
    run_dir: str
    ok: bool
    error: str = ""
    steps: int = 0
    wall_s: float = 0.0  # first update to last update
    evals: list[tuple[int, float, float]] = field(default_factory=list)  # (step, wall s, accuracy)
    final_accuracy: float | None = None
    steps_to_target: int | None = None
    wall_to_target: float | None = None
    rollouts_to_target: int | None = None  # generated (trained once, dropped or refused alike)
    mean_staleness: float = 0.0
    max_staleness: int = 0
    is_weight_mean: float = 0.0
    truncated_share: float = 0.0  # share of response tokens whose π/μ exceeded the cap δ
    mismatch_kl: float = 0.0
    replayed_share: float = 0.0  # of trained group-uses, the share that were replays
    reuse_counts: dict[str, int] = field(default_factory=dict)  # uses at training -> count
    rollouts: int = 0  # generated over the whole run
    wasted_share: float = 0.0  # of generated groups, the share dropped (staler than S, or queue overflow)
    reward_last: float = 0.0  # mean training reward of the last FINAL_WINDOW updates (less noisy than evals)
    step_period_s: float = 0.0  # median wall time per update
    learner_idle: float = 0.0


# --- one run -------------------------------------------------------------------------------------


@contextlib.contextmanager
def measuring_lock(path: Path | None = LOCK):
    """Exclusive while one training run is timed: measurements on this machine never overlap.
    None: no lock (the smoke mode times nothing worth protecting, and must not queue behind a
    benchmark)."""
    if path is None:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_arm(arm: Arm, seed: int, config: Path, out: Path, extra: list[str], timeout_s: float,
            lock: Path | None = LOCK) -> Path:
    """Run one learner (it spawns its workers) to completion; return its run directory."""
    name = f"{arm.name}-seed{seed}"
    cmd = [sys.executable, "-m", "learner.main", "--config", str(config), "--json", "--run.dir", str(out),
           "--run.name", name, "--run.seed", str(seed), *arm.overrides(), *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "PYTHONUNBUFFERED": "1"}
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"{name}.log"
    with measuring_lock(lock), open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.terminate()  # the learner stops its workers on SIGTERM
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise RuntimeError(f"{name} ran past {timeout_s:.0f} s; see {log}") from None
    dirs = sorted(out.glob(f"{name}-*/metrics.jsonl"))
    if code != 0 or not dirs:
        raise RuntimeError(f"{name} exited with code {code}; see {log}")
    return dirs[-1].parent


def analyse(run_dir: Path, arm: str, seed: int, target: float | None, group_size: int) -> RunResult:
    """The numbers of one run, from its run log."""
    steps, evals = [], {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            steps.append(rec)
        if rec.get("event") == "eval":
            evals[rec["step"]] = rec["eval_accuracy"]
    r = RunResult(arm, seed, str(run_dir), ok=bool(steps))
    if not steps:
        r.error = "no training steps logged"
        return r
    t0 = steps[0]["time"]
    wall = {s["step"]: s["time"] - t0 for s in steps}
    wall[0] = 0.0
    r.steps, r.wall_s = steps[-1]["step"], round(steps[-1]["time"] - t0, 2)
    r.evals = [(k, round(wall.get(k, math.nan), 2), acc) for k, acc in sorted(evals.items())]
    # The evals of the last FINAL_WINDOW updates averaged: one eval of a policy still moving is noisy.
    last = [acc for k, _, acc in r.evals if k > 0 and k > r.steps - FINAL_WINDOW] or [acc for _, _, acc in r.evals[-1:]]
    r.final_accuracy = statistics.fmean(last or [math.nan])
    tokens = sum(s["tokens"] for s in steps)
    r.is_weight_mean = sum(s["is_weight_mean"] * s["tokens"] for s in steps) / tokens
    r.truncated_share = sum(s["is_truncated_fraction"] * s["tokens"] for s in steps) / tokens
    r.mismatch_kl = sum(s["mismatch_kl"] * s["tokens"] for s in steps) / tokens
    ages = [a for s in steps for a in s["staleness"]]
    r.mean_staleness, r.max_staleness = sum(ages) / len(ages), max(ages)
    uses = [u for s in steps for u in s.get("uses", [1] * len(s["staleness"]))]
    r.reuse_counts = {str(k): uses.count(k) for k in sorted(set(uses))}
    r.replayed_share = sum(u > 1 for u in uses) / len(uses)
    periods = sorted(b["time"] - a["time"] for a, b in zip(steps, steps[1:]))
    r.step_period_s = round(periods[len(periods) // 2], 4) if periods else 0.0
    r.learner_idle = steps[-1]["idle_ratio"]

    def generated(upto: dict) -> int:
        """Rollouts generated until `upto`: fresh groups trained + groups dropped after acceptance."""
        fresh = sum(len(s["staleness"]) - s.get("replayed", 0) for s in steps if s["step"] <= upto["step"])
        return (fresh + upto["recycled"] + upto["dropped_overflow"]) * group_size

    r.rollouts = generated(steps[-1])
    r.wasted_share = (steps[-1]["recycled"] + steps[-1]["dropped_overflow"]) * group_size / max(1, r.rollouts)
    r.reward_last = statistics.fmean(s["reward_mean"] for s in steps[-FINAL_WINDOW:])
    if target is not None:
        hit = next((k for k, _, acc in r.evals if acc >= target and k > 0), None)
        if hit is not None:
            rec = next(s for s in steps if s["step"] == hit)
            r.steps_to_target, r.wall_to_target = hit, round(wall[hit], 2)
            r.rollouts_to_target = generated(rec)
    return r


def retarget(r: RunResult, target: float, group_size: int) -> RunResult:
    """`analyse` again with the sweep's target (known only once the synchronous runs are in)."""
    return analyse(Path(r.run_dir), r.arm, r.seed, target, group_size) if r.ok else r


# --- the sweep -----------------------------------------------------------------------------------


@dataclass
class Prices:
    learner: float  # $/h
    worker: float  # $/h of one generating machine
    workers: int

    def per_second(self, worker_price: float | None = None) -> float:
        return (self.learner + self.workers * (self.worker if worker_price is None else worker_price)) / 3600


def _spread(values: list[float]) -> tuple[float | None, float | None]:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarise(results: list[RunResult], arms: list[Arm], prices: Prices, target: float) -> list[dict[str, Any]]:
    """One row per arm (and the centralized pricing of the synchronous runs)."""
    rows = []
    sync = [r for r in results if r.arm == "sync" and r.ok]
    sync_wall = _spread([r.wall_to_target for r in sync])[0]
    sync_acc, sync_reward = _spread([r.final_accuracy for r in sync]), _spread([r.reward_last for r in sync])

    def relative(values: list[float], base: tuple[float | None, float | None], arm: str) -> tuple[float | None, float | None]:
        """(mean / sync mean - 1, its standard error): how far from sync, and how well that is known."""
        (m, sd), (b, b_sd) = _spread(values), base
        if m is None or not b:
            return None, None
        if arm == "sync" or len(values) < 2 or len(sync) < 2:
            return m / b - 1, None  # sync against itself has no gap to know
        return m / b - 1, math.sqrt(sd**2 / len(values) + b_sd**2 / len(sync)) / b
    for label, arm_name, price in [(a.name, a.name, None) for a in arms] + [("centralized (sync)", "sync", prices.learner)]:
        runs = [r for r in results if r.arm == arm_name and r.ok]
        if not runs:
            continue
        reached = [r for r in runs if r.steps_to_target is not None]
        steps_m, steps_sd = _spread([r.steps_to_target for r in reached])
        wall_m, wall_sd = _spread([r.wall_to_target for r in reached])
        acc_m, acc_sd = _spread([r.final_accuracy for r in runs])
        dollars = [r.wall_to_target * prices.per_second(price) for r in reached]
        final_gap, final_se = relative([r.final_accuracy for r in runs], sync_acc, arm_name)
        reward_gap, reward_se = relative([r.reward_last for r in runs], sync_reward, arm_name)
        rollouts_m, _ = _spread([r.rollouts_to_target for r in reached])
        rows.append({
            "arm": label, "runs": len(runs), "reached": len(reached), "target": target,
            "steps_to_target": steps_m, "steps_to_target_sd": steps_sd,
            "wall_to_target_s": wall_m, "wall_to_target_sd": wall_sd,
            "speedup_vs_sync": (sync_wall / wall_m) if sync_wall and wall_m else None,
            "final_accuracy": acc_m, "final_accuracy_sd": acc_sd,
            "final_accuracy_min": min(r.final_accuracy for r in runs if r.final_accuracy is not None),
            "final_accuracy_max": max(r.final_accuracy for r in runs if r.final_accuracy is not None),
            "dollars_to_target": statistics.fmean(dollars) if dollars else None,
            "rollouts_to_target": rollouts_m,
            "mean_staleness": statistics.fmean(r.mean_staleness for r in runs),
            "max_staleness": max(r.max_staleness for r in runs),
            "truncated_share": statistics.fmean(r.truncated_share for r in runs),
            "is_weight_mean": statistics.fmean(r.is_weight_mean for r in runs),
            "replayed_share": statistics.fmean(r.replayed_share for r in runs),
            "wasted_share": statistics.fmean(r.wasted_share for r in runs),
            "final_vs_sync": final_gap, "final_vs_sync_se": final_se,
            "reward_last": statistics.fmean(r.reward_last for r in runs),
            "reward_last_sd": _spread([r.reward_last for r in runs])[1],
            "reward_vs_sync": reward_gap, "reward_vs_sync_se": reward_se,
            "step_period_s": statistics.fmean(r.step_period_s for r in runs),
            "price_per_hour": round(3600 * prices.per_second(price), 4),
        })
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The README table (markdown)."""
    def f(v, fmt, sd=None, sd_fmt=None):
        if v is None:
            return "–"
        return format(v, fmt) + (f" ± {format(sd, sd_fmt or fmt)}" if sd is not None else "")

    def vs(v, se):
        return "–" if v is None else f"{100 * v:+.0f}%" + (f" ± {100 * se:.0f}" if se is not None else "")

    head = ("| arm | seeds | s per update | steps to target | wall to target (s) | speed-up | final accuracy (mean ± sd, min–max) "
            "| vs sync (± se) | $ to target | rollouts to target | mean staleness | truncated weights | replayed | dropped "
            f"| reward, last {FINAL_WINDOW} | vs sync (± se) |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        reached = f" ({r['reached']}/{r['runs']})" if r["reached"] < r["runs"] else ""
        lines.append(
            f"| {r['arm']} | {r['runs']} | {r['step_period_s']:.3f} | {f(r['steps_to_target'], '.0f', r['steps_to_target_sd'])}{reached} "
            f"| {f(r['wall_to_target_s'], '.1f', r['wall_to_target_sd'])} | {f(r['speedup_vs_sync'], '.2f')}{'x' if r['speedup_vs_sync'] else ''} "
            f"| {f(r['final_accuracy'], '.3f', r['final_accuracy_sd'])} ({r['final_accuracy_min']:.3f}–{r['final_accuracy_max']:.3f}) "
            f"| {vs(r['final_vs_sync'], r['final_vs_sync_se'])} "
            f"| {f(r['dollars_to_target'], '.4f')} | {f(r['rollouts_to_target'], '.0f')} "
            f"| {r['mean_staleness']:.2f} (max {r['max_staleness']}) | {100 * r['truncated_share']:.2f}% "
            f"| {100 * r['replayed_share']:.0f}% | {100 * r['wasted_share']:.0f}% "
            f"| {f(r['reward_last'], '.3f', r['reward_last_sd'])} | {vs(r['reward_vs_sync'], r['reward_vs_sync_se'])} |")
    return "\n".join(lines)


def parse_arms(staleness: list[int], replay: list[int], publish_every: int | None, positive_bias: float) -> list[Arm]:
    arms = []
    for s in staleness:
        if s < 0:
            raise ValueError(f"--staleness {s}: S is a number of versions, 0 (synchronous) or more")
        for k in replay:
            if k < 1:
                raise ValueError(f"--replay {k}: a group is trained at least once; use 1 (no replay) or more")
            if k > 1 and s == 0:
                continue  # nothing can be replayed within S = 0 (a trained group is stale at the next version)
            i = 1 if s == 0 else (publish_every or max(1, s - 1))
            if s and i > s:
                raise ValueError(f"--publish-every {i} > S = {s}: every rollout would be staler than S")
            arms.append(Arm(s, i, k, positive_bias if k > 1 else 0.0))
    return arms


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="echo-rl experiment",
        description="Measure synchronous vs bounded-staleness training (and the replay buffer) end to end: "
                    "the real learner and throttled local workers, several seeds per arm.",
        epilog="Any other --section.key VALUE overrides the base config for every arm, e.g. --trainer.lr 1.5e-4 "
               "or --buffer.queue_factor 1. Results: OUT/table.md, OUT/results.json, OUT/staleness.png.")
    parser.add_argument("name", choices=["staleness"], help="the experiment (only 'staleness')")
    parser.add_argument("--config", type=Path, default=Path(DEFAULT_CONFIG), help=f"base learner config (default {DEFAULT_CONFIG})")
    parser.add_argument("--staleness", default="0,1,2,3,4", help="S values, 0 = synchronous (default 0,1,2,3,4)")
    parser.add_argument("--replay", default="1,2", help="[buffer] reuse values, 1 = no replay (default 1,2)")
    parser.add_argument("--positive-bias", type=float, default=0.0, help="δ of positive-biased replay (default 0)")
    parser.add_argument("--publish-every", type=int, help="I for every S >= 1 (default max(1, S - 1))")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per arm (default 3)")
    parser.add_argument("--first-seed", type=int, default=0, help="seeds are FIRST.. FIRST+SEEDS-1 (default 0): "
                        "add seeds to an earlier sweep by giving its --out")
    parser.add_argument("--steps", type=int, help="learner updates per run (default: the config's)")
    parser.add_argument("--target", type=float, help="target eval accuracy (default: 0.9 x the synchronous mean final accuracy)")
    parser.add_argument("--workers", type=int, help="local workers per run (default: the config's [workers] spawn)")
    parser.add_argument("--out", type=Path, help="results directory (default runs/experiment-staleness-TIME)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take (default 900)")
    parser.add_argument("--smoke", action="store_true", help="seconds-long check of the harness: 6 steps, 1 seed, sync and "
                        "S = 2 with replay (takes no measurement lock)")
    parser.add_argument("--results", type=Path, metavar="DIR",
                        help="run nothing: analyse every run of an earlier sweep directory again (all its seeds, "
                             "also those added with --first-seed, or of a sweep cut short), e.g. with another --target")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args, extra = parser.parse_known_args(argv)
    if args.results:
        return _reanalyse(args.results, args.target, args.json)
    try:
        ints = lambda text, flag: [int(x) for x in text.split(",") if x.strip()]  # noqa: E731
        staleness, replay = ints(args.staleness, "--staleness"), ints(args.replay, "--replay")
        arms = parse_arms(staleness, replay, args.publish_every, args.positive_bias)
    except ValueError as e:
        parser.error(str(e))
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    if args.smoke:
        arms = [Arm(0, 1), Arm(2, 1, 2, args.positive_bias)]  # S = 2: a group trained one version stale is replayable
        args.seeds, args.steps = 1, args.steps or 6
        extra = ["--run.eval_every", "3", "--eval.limit", "40", "--rollout.group_size", "4",
                 "--trainer.batch_prompts", "4", *extra]
    from learner.config import load_learner_config  # here: `--help` stays instant

    config = args.config if args.config.is_absolute() else ROOT / args.config
    overrides = [*extra] + (["--run.steps", str(args.steps)] if args.steps else []) + (
        ["--workers.spawn", str(args.workers)] if args.workers else [])
    try:
        cfg = load_learner_config(config, overrides)
    except ConfigError as e:
        print(f"echo-rl experiment: {e}", file=sys.stderr)
        return 2
    if cfg.workers.spawn < 1:
        parser.error("the experiment needs local workers: set [workers] spawn or --workers N")
    model = cfg.model.path if cfg.model.path.is_absolute() else ROOT / cfg.model.path
    if not (model / "config.json").exists():  # a fresh clone: build the demo model, as `make model` does
        from learner.tinymodel import cli as build_model

        with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):  # stdout keeps only the JSON
            if build_model(["--config", str(config), "--out", str(model)]) != 0:
                return 2
    out = (args.out or ROOT / "runs" / f"experiment-staleness-{datetime.now():%Y%m%d-%H%M%S}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    resolved = out / "base.toml"
    resolved.write_text(dump_toml(cfg))  # every run starts from exactly this
    prices = Prices(cfg.scheduler.learner_price_per_hour, _worker_price(cfg.workers.overrides), cfg.workers.spawn)
    per_run = 60 + cfg.run.steps * 2.0  # generous: a run that stalls fails instead of hanging the sweep
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, flush=True))
    say(f"experiment staleness: {len(arms)} arms x {args.seeds} seeds, {cfg.run.steps} steps each, "
        f"{cfg.workers.spawn} workers; results in {out}")

    results: list[RunResult] = []
    G, n = cfg.trainer.batch_prompts, cfg.rollout.group_size
    for seed in range(args.first_seed, args.first_seed + args.seeds):  # interleaved: seed 0 of every arm, then seed 1, ...
        for arm in arms:
            t = time.monotonic()
            try:
                run_dir = run_arm(arm, seed, resolved, out / "runs", [], min(args.timeout, per_run),
                                  lock=None if args.smoke else LOCK)
                r = analyse(run_dir, arm.name, seed, args.target, n)
            except RuntimeError as e:
                r = RunResult(arm.name, seed, "", ok=False, error=str(e))
            results.append(r)
            say(f"  {arm.name:<18} seed {seed}: " + (
                f"final {r.final_accuracy}, {r.steps} steps in {r.wall_s:.0f} s, staleness {r.mean_staleness:.2f} "
                f"(max {r.max_staleness}), {time.monotonic() - t:.0f} s" if r.ok else f"FAILED: {r.error}"))
    sync_final = _spread([r.final_accuracy for r in results if r.arm == "sync" and r.ok])[0]
    target = args.target if args.target is not None else round(0.9 * sync_final, 4) if sync_final else None
    if target is None:
        print("echo-rl experiment: no synchronous run finished, so there is no default target; pass --target", file=sys.stderr)
        return 1
    results = [retarget(r, target, n) for r in results]
    report = {"experiment": "staleness", "config": str(args.config), "out": str(out), "steps": cfg.run.steps,
              "seeds": args.seeds, "batch_rollouts": G * n, "group_size": n, "workers": cfg.workers.spawn,
              "command": "echo-rl experiment " + " ".join(argv)}
    return _finish(report, results, arms, prices, target, out, args.json)


def _finish(report: dict[str, Any], results: list[RunResult], arms: list[Arm], prices: Prices, target: float,
            out: Path, as_json: bool) -> int:
    """Summarise, write results.json, table.md and the PNG, print."""
    rows = summarise(results, arms, prices, target)
    report.update(target=target, prices=asdict(prices), rows=rows, runs=[asdict(r) for r in results])
    (out / "results.json").write_text(json.dumps(report, indent=2))
    text = table(rows)
    (out / "table.md").write_text(text + "\n")
    with contextlib.suppress(ImportError):
        from echo.report import plot_experiment

        plot_experiment(report, out / "staleness.png")
    failed = [r for r in results if not r.ok]
    if as_json:
        print(json.dumps(report))
    else:
        print(f"\ntarget eval accuracy {target:.3f}; {report['steps']} steps; prices: learner ${prices.learner}/h, "
              f"{prices.workers} workers x ${prices.worker}/h (centralized: x ${prices.learner}/h)\n")
        print(text)
        print(f"\nwrote {out / 'results.json'}, {out / 'table.md'}, {out / 'staleness.png'}")
        for r in failed:
            print(f"FAILED {r.arm} seed {r.seed}: {r.error}", file=sys.stderr)
    return 1 if failed else 0


def _reanalyse(out: Path, target: float | None, as_json: bool) -> int:
    """Every run under `out/runs` (named ARM-seedN-TIME by `run_arm`), priced from `out/base.toml`."""
    import re

    from learner.config import load_learner_config

    try:
        cfg = load_learner_config(out / "base.toml")
    except ConfigError as e:
        print(f"echo-rl experiment: {e}; pass the directory of a sweep (it holds base.toml and runs/)", file=sys.stderr)
        return 2
    n = cfg.rollout.group_size
    found = []
    for log in sorted((out / "runs").glob("*-seed*-*/metrics.jsonl")):
        m = re.fullmatch(r"(.+)-seed(\d+)-\d{8}-\d{6}", log.parent.name)
        if m and (log.parent / "summary.json").exists():  # a finished run
            found.append((m[1], int(m[2]), log.parent))
    if not found:
        print(f"echo-rl experiment: no finished runs under {out / 'runs'}", file=sys.stderr)
        return 2
    results = [analyse(d, arm, seed, target, n) for arm, seed, d in found]
    if target is None:
        sync_final = _spread([r.final_accuracy for r in results if r.arm == "sync"])[0]
        if sync_final is None:
            print("echo-rl experiment: no synchronous run to set the default target by; pass --target", file=sys.stderr)
            return 2
        target = round(0.9 * sync_final, 4)
        results = [retarget(r, target, n) for r in results]
    order = {name: i for i, name in enumerate(["sync"] + [f"S{s}" for s in range(1, 100)])}
    names = sorted(dict.fromkeys(r.arm for r in results), key=lambda a: (order.get(a.split("-")[0], 999), a))
    seeds = sorted({r.seed for r in results})
    prices = Prices(cfg.scheduler.learner_price_per_hour, _worker_price(cfg.workers.overrides), cfg.workers.spawn)
    report = {"experiment": "staleness", "out": str(out), "steps": cfg.run.steps, "seeds": len(seeds),
              "batch_rollouts": cfg.batch_rollouts, "group_size": n, "workers": cfg.workers.spawn,
              "command": f"echo-rl experiment staleness --results {out}" + (f" --target {target}" if target else "")}
    return _finish(report, results, [_Named(name) for name in names], prices, target, out, as_json)


@dataclass(frozen=True)
class _Named:
    name: str


def _worker_price(overrides: list[str]) -> float:
    """The $/h the spawned workers declare (`--worker.price_per_hour` in `[workers] overrides`)."""
    for i, arg in enumerate(overrides):
        if arg.startswith("--worker.price_per_hour"):
            return float(arg.partition("=")[2] or overrides[i + 1])
    return 0.0
