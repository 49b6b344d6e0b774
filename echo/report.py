"""`echo-rl report RUN_DIR`: plots of a run from its metrics.jsonl (reward, eval accuracy,
staleness, queue and learner idle time), written as PNG next to the log."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load_run(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """A run's step records and eval records, by step. A resumed run writes the steps after its
    checkpoint again, after a `resume` event naming the checkpoint's step: what came after that
    step before the event is dropped (the plot went back in x where both were drawn), and the
    last record of a step stands. A line a kill cut short is skipped."""
    steps: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    for rec in _records(run_dir):
        if rec.get("event") == "resume":  # the killed process's records past its checkpoint are redone
            steps = {k: v for k, v in steps.items() if k <= rec["step"]}
            evals = {k: v for k, v in evals.items() if k <= rec["step"]}
            continue
        if "loss" in rec:
            steps[rec["step"]] = rec
        if isinstance(rec.get("eval_accuracy"), (int, float)):
            evals[rec["step"]] = rec
    return [steps[k] for k in sorted(steps)], [evals[k] for k in sorted(evals)]


def resumes(run_dir: Path) -> list[int]:
    """The steps a run was resumed after (each process's cumulative numbers start again there)."""
    return [rec["step"] for rec in _records(run_dir) if rec.get("event") == "resume"]


def _records(run_dir: Path):
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            yield rec


def eval_metric(run_dir: Path, evals: list[dict] = ()) -> str:
    """What the run's evals measure: "accuracy", or "mean return" for an episodic task. The summary
    says, and each eval event: a run killed or stopped early has no summary (a new user's poker
    run's plot read "accuracy" for returns in big blinds)."""
    try:
        return str(json.loads((run_dir / "summary.json").read_text()).get("eval_metric", "accuracy"))
    except (OSError, ValueError):
        return next((str(e["metric"]) for e in evals if e.get("metric")), "accuracy")


def plot(run_dir: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, evals = load_run(run_dir)
    x = [r["step"] for r in steps]
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    ax = axes[0]
    metric = eval_metric(run_dir, evals)
    rewards, scores = [r["reward_mean"] for r in steps], [r["eval_accuracy"] for r in evals]
    ax.plot(x, rewards, lw=0.8, alpha=0.6, label="batch reward")
    ax.plot([r["step"] for r in evals], scores, "o-", label=f"greedy eval {metric}")
    ax.set_ylabel(f"reward / {metric}")
    if all(v is not None and 0 <= v <= 1 for v in rewards + scores):
        ax.set_ylim(0, 1)  # else (poker's returns in big blinds, below 0) the data's own range
    ax.legend(loc="lower right")
    ax = axes[1]
    ax.plot(x, [r["avg_staleness"] for r in steps], lw=0.8, label="avg staleness")
    ax.plot(x, [r["max_staleness"] for r in steps], lw=0.8, label="max staleness")
    ax.set_ylabel("versions behind")
    ax.legend(loc="upper right")
    ax = axes[2]
    ax.plot(x, [r["queue_size"] for r in steps], lw=0.8, label="queue (groups)")
    ax.set_ylabel("groups")
    twin = ax.twinx()
    twin.plot(x, [100 * r["idle_ratio"] for r in steps], color="tab:red", lw=0.8,
              label="learner idle % (cumulative since the start or a resume)")
    twin.set_ylabel("idle %")
    for i, step in enumerate(resumes(run_dir)):
        for a in axes:
            a.axvline(step, color="grey", ls=":", lw=1, label="resumed here" if a is ax and not i else None)
    handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], loc="upper right")
    ax.set_xlabel("learner step")
    fig.suptitle(f"echo run {run_dir.name}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_experiment(report: dict, out: Path) -> Path:
    """`echo-rl experiment staleness`: greedy eval accuracy (rolling mean of 5 evals) against learner
    steps and against wall time, and the training reward (25-step rolling mean) against steps; one
    line per arm, the mean over its seeds (replay arms dashed), the target dotted."""
    import statistics

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time, reward) = plt.subplots(1, 3, figsize=(17, 5))
    arms = list(dict.fromkeys(r["arm"] for r in report["runs"] if r["ok"]))
    bases = list(dict.fromkeys(a.split("-replay")[0] for a in arms))
    colors = {b: ("black" if b == "sync" else plt.cm.tab10(i)) for i, b in enumerate(bases)}
    for arm in arms:
        runs = [r for r in report["runs"] if r["arm"] == arm and r["ok"]]
        style = dict(color=colors[arm.split("-replay")[0]], ls="--" if "replay" in arm else "-", lw=1.4)
        steps = sorted({e[0] for r in runs for e in r["evals"]})
        points = [[e for r in runs for e in r["evals"] if e[0] == k] for k in steps]
        points = [es for es in points if len(es) == len(runs)]  # evals every seed has
        acc = _rolling([statistics.fmean(e[2] for e in es) for es in points], 5)  # one eval of a moving policy is noisy
        by_step.plot([es[0][0] for es in points], acc, marker=".", label=arm, **style)
        by_time.plot([statistics.fmean(e[1] for e in es) for es in points], acc, marker=".", label=arm, **style)
        curves = [_rolling([s["reward_mean"] for s in load_run(Path(r["run_dir"]))[0]], 25) for r in runs
                  if (Path(r["run_dir"]) / "metrics.jsonl").exists()]
        if curves:
            n = min(map(len, curves))
            reward.plot(range(1, n + 1), [statistics.fmean(c[i] for c in curves) for i in range(n)], label=arm, **style)
    for ax in (by_step, by_time):
        ax.axhline(report["target"], color="red", ls=":", lw=1, label="target")
    for ax in (by_step, by_time, reward):
        ax.grid(alpha=0.3)
    by_step.set_xlabel("learner step")
    by_time.set_xlabel("wall time from the first update (s)")
    reward.set_xlabel("learner step")
    by_step.set_ylabel("greedy eval accuracy\n(rolling mean of 5 evals, mean over seeds)")
    reward.set_ylabel("training reward\n(25-step rolling mean, mean over seeds)")
    by_time.legend(loc="lower right", fontsize=8)
    fig.suptitle("synchronous vs bounded staleness (dashed: with replay)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _rolling(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="echo-rl report", description="Plot a run directory's metrics.jsonl to PNG.")
    parser.add_argument("run_dir", type=Path, help="a run directory written by echo-learner")
    parser.add_argument("--out", type=Path, help="output PNG (default: RUN_DIR/report.png)")
    parser.add_argument("--json", action="store_true", help="print the output path as JSON")
    args = parser.parse_args(argv)
    if not (args.run_dir / "metrics.jsonl").exists():
        parser.error(f"{args.run_dir} has no metrics.jsonl; pass a run directory written by echo-learner")
    if not load_run(args.run_dir)[0]:  # a run that stopped (or failed) before its first update
        print(f"echo-rl report: {args.run_dir / 'metrics.jsonl'} has no training step yet: nothing to plot "
              "(the learner printed why it stopped)", file=sys.stderr)
        return 1
    out = plot(args.run_dir, args.out or args.run_dir / "report.png")
    print(json.dumps({"report": str(out)}) if args.json else f"wrote {out}")
    return 0
