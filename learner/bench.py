"""`echo-rl bench overlap`: the overlap capacity rule on the real system.

Runs the real learner with N local workers, each throttled to `r` rollouts/s, for several
staleness budgets S (publication period I = S − 1), and compares the learner's measured bubble
(idle / wall, after warm-up) with the prediction of the overlap model

    wait per period = max(0, I·B/R + T_bcast − I·T_train),  bubble = wait / (I·T_train + wait)

evaluated with this run's own medians of T_train and T_bcast and R = N·r. The predicted
threshold is the smallest N with N·r ≥ R_req = I·B / (I·T_train − T_bcast). Expected shape
(ECHO-2 Fig. 3c): the bubble falls to near zero at the predicted pool size, and the threshold
moves left as S grows.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from scheduler.capacity import bubble, required_rate
from scheduler.errors import SchedulerError


def run_once(workers: int, staleness: int, rate: float, steps: int, args, workdir: Path) -> dict:
    overrides = [
        "--run.steps", str(steps), "--run.eval_every", "0", "--run.checkpoint_every", "0",
        "--run.dir", str(workdir), "--run.name", f"n{workers}-s{staleness}",
        "--workers.spawn", str(workers),
        "--workers.overrides", json.dumps(["--worker.max_rollouts_per_s", str(rate), "--worker.prompts_per_lease", "2"]),
        "--buffer.max_staleness", str(staleness), "--trainer.batch_prompts", str(args.groups),
        "--rollout.group_size", str(args.group_size), "--trainer.minibatches", str(args.minibatches),
        "--trainer.schedule", "constant", "--scheduler.pool", '""', "--scheduler.provider", "static",
    ]
    out = subprocess.run([sys.executable, "-m", "learner.main", "--config", args.config, "--json", *overrides],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"learner run failed (N={workers}, S={staleness}):\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{") and '"loss"' in line]
    steady = records[args.warmup:]
    wait, train = sum(r["wait_s"] for r in steady), sum(r["train_s"] for r in steady)
    t_train = statistics.median(r["train_s"] for r in steady)
    bcasts = [r["t_bcast"] for r in records if "t_bcast" in r]
    t_bcast = statistics.median(bcasts) if bcasts else 0.0
    publish_every = max(1, staleness - 1)
    batch = args.groups * args.group_size
    try:
        r_req = required_rate(batch, t_train, t_bcast, publish_every)
    except SchedulerError:
        r_req = math.inf
    _, predicted = bubble(batch, t_train, t_bcast, publish_every, workers * rate)
    return {"S": staleness, "I": publish_every, "N": workers, "R": workers * rate, "t_train": t_train,
            "t_bcast": t_bcast, "r_req": r_req, "threshold": math.ceil(r_req / rate) if math.isfinite(r_req) else None,
            "bubble_measured": wait / (wait + train), "bubble_predicted": predicted}


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="echo-rl bench overlap", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/demo.toml", help="learner config (the demo's model and task)")
    p.add_argument("--workers", default="1,2,3,4", help="pool sizes N to sweep (default 1,2,3,4)")
    p.add_argument("--staleness", default="2,4", help="staleness budgets S to sweep; I = S − 1 (default 2,4)")
    p.add_argument("--rate", type=float, default=250.0, help="throttle r of each worker, rollouts/s (default 250)")
    p.add_argument("--steps", type=int, default=60, help="learner steps per run (default 60)")
    p.add_argument("--warmup", type=int, default=15, help="steps excluded from the bubble (default 15)")
    p.add_argument("--groups", type=int, default=8, help="G prompts per step (default 8)")
    p.add_argument("--group-size", type=int, default=8, help="n samples per prompt (default 8)")
    p.add_argument("--minibatches", type=int, default=4, help="optimizer steps per batch: sets T_train (default 4)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for s in map(int, args.staleness.split(",")):
            for n in map(int, args.workers.split(",")):
                rows.append(run_once(n, s, args.rate, args.steps, args, Path(tmp)))
                if not args.json:
                    print(_row(rows[-1]), flush=True)
    if args.json:
        print(json.dumps(rows))
    else:
        print(f"\nbubble = learner idle / wall after {args.warmup} warm-up steps; predicted from this run's own "
              "median T_train and T_bcast with R = N·r; threshold = smallest N with N·r ≥ R_req")
    return 0


def _row(r: dict) -> str:
    req = f"{r['r_req']:7.0f}" if math.isfinite(r["r_req"]) else "    inf"
    thr = r["threshold"] if r["threshold"] is not None else "-"
    return (f"S={r['S']} I={r['I']}  N={r['N']}  R={r['R']:6.0f}/s  T_train={r['t_train']:.3f}s  "
            f"T_bcast={r['t_bcast']:.3f}s  R_req={req}/s  threshold N*={thr}  "
            f"bubble measured {100 * r['bubble_measured']:5.1f}%  predicted {100 * r['bubble_predicted']:5.1f}%")
