"""`echo-rl report RUN_DIR`: plots of a run from its metrics.jsonl (reward, eval accuracy,
staleness, queue and learner idle time), written as PNG next to the log."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load_run(run_dir: Path) -> tuple[list[dict], list[dict]]:
    steps, evals = [], []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            steps.append(rec)
        if "eval_accuracy" in rec:
            evals.append(rec)
    return steps, evals


def plot(run_dir: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, evals = load_run(run_dir)
    x = [r["step"] for r in steps]
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    ax = axes[0]
    ax.plot(x, [r["reward_mean"] for r in steps], lw=0.8, alpha=0.6, label="batch reward")
    ax.plot([r["step"] for r in evals], [r["eval_accuracy"] for r in evals], "o-", label="greedy eval accuracy")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(0, 1)
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
    twin.plot(x, [100 * r["idle_ratio"] for r in steps], color="tab:red", lw=0.8, label="learner idle % (cumulative)")
    twin.set_ylabel("idle %")
    handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], loc="upper right")
    ax.set_xlabel("learner step")
    fig.suptitle(f"echo run {run_dir.name}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="echo-rl report", description="Plot a run directory's metrics.jsonl to PNG.")
    parser.add_argument("run_dir", type=Path, help="a run directory written by echo-learner")
    parser.add_argument("--out", type=Path, help="output PNG (default: RUN_DIR/report.png)")
    parser.add_argument("--json", action="store_true", help="print the output path as JSON")
    args = parser.parse_args(argv)
    if not (args.run_dir / "metrics.jsonl").exists():
        parser.error(f"{args.run_dir} has no metrics.jsonl; pass a run directory written by echo-learner")
    out = plot(args.run_dir, args.out or args.run_dir / "report.png")
    print(json.dumps({"report": str(out)}) if args.json else f"wrote {out}")
    return 0
