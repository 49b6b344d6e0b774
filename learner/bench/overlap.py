"""`echo-rl bench overlap`: the capacity rules against the real system's bubble.

Runs the real learner with N local workers, each throttled to `r` rollouts/s, for several
staleness budgets S (publication period I = S − 1), and measures the learner's bubble (idle /
wall, after warm-up). The *knee* is the smallest N whose bubble is below 10%. Each capacity
rule predicts a knee, the smallest N with N·r ≥ R_req, from this run's own medians of
T_train, T_bcast (publication until 90% of the workers received the version) and the install
time τ:

    paper       R_req = I·B / (I·T − T_b)                       (T_b = T_bcast + τ; ECHO-2)
    overlapped  R_req = max(I·B/(I·T − τ), B/((S − I + 1)·T − T_b))   (training goes on
                                                                  during the broadcast)

The measured knee is the referee (formulas.md §1). Expected shape (ECHO-2 Fig. 3c): the bubble
falls to near zero past the knee, and the knee moves left as S grows.
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

from scheduler.capacity import RULES, requirement
from scheduler.errors import InfeasibleOverlap


def run_once(workers: int, staleness: int, rate: float, steps: int, args, workdir: Path) -> dict:
    overrides = [
        "--run.steps", str(steps), "--run.eval_every", "0", "--run.checkpoint_every", "0",
        "--run.dir", str(workdir), "--run.name", f"n{workers}-s{staleness}",
        "--workers.spawn", str(workers),
        "--workers.overrides", json.dumps(["--worker.max_rollouts_per_s", str(rate), "--worker.prompts_per_lease", "2"]),
        "--buffer.max_staleness", str(staleness), "--trainer.batch_prompts", str(args.groups),
        "--rollout.group_size", str(args.group_size), "--trainer.minibatches", str(args.minibatches),
        "--trainer.schedule", "constant", "--scheduler.pool", '""', "--scheduler.provider", "static",
        "--eval.limit", "16",
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
    installs = [r["install_s"] for r in steady if "install_s" in r]
    install = statistics.median(installs) if installs else 0.0
    publish_every = max(1, staleness - 1)
    batch = args.groups * args.group_size
    r_req = {}
    for rule in RULES:
        try:
            r_req[rule] = requirement(rule, batch=batch, t_train=t_train, t_bcast=t_bcast + install,
                                      publish_every=publish_every, max_staleness=staleness, install_s=install).r_req
        except InfeasibleOverlap:
            r_req[rule] = math.inf
    return {"S": staleness, "I": publish_every, "N": workers, "R": workers * rate, "t_train": t_train,
            "t_bcast": t_bcast, "install_s": install, "r_req": r_req, "bubble_measured": wait / (wait + train)}


def knees(rows: list[dict], rate: float, threshold: float = 0.10) -> list[dict]:
    """Per S: the measured knee (smallest N with bubble < threshold) and each rule's (smallest N
    with N·r ≥ its R_req, from the medians of every run at that S)."""
    out = []
    for S in sorted({r["S"] for r in rows}):
        runs = sorted((r for r in rows if r["S"] == S), key=lambda r: r["N"])
        measured = next((r["N"] for r in runs if r["bubble_measured"] < threshold), None)
        predicted = {}
        for rule in RULES:
            req = statistics.median(r["r_req"][rule] for r in runs)
            predicted[rule] = math.ceil(req / rate - 1e-9) if math.isfinite(req) else None
        out.append({"S": S, "I": runs[0]["I"], "measured": measured, "largest_n": runs[-1]["N"], **predicted})
    return out


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="echo-rl bench overlap", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/demo.toml", help="learner config (the demo's model and task)")
    p.add_argument("--workers", default="1,2,3,4,5", help="pool sizes N to sweep (default 1,2,3,4,5)")
    p.add_argument("--staleness", default="2,3,4", help="staleness budgets S to sweep; I = S − 1 (default 2,3,4)")
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
    summary = knees(rows, args.rate)
    if args.json:
        print(json.dumps({"runs": rows, "knees": summary}, default=lambda x: None))
        return 0
    print(f"\nbubble = learner idle / wall after {args.warmup} warm-up steps; knee = smallest N with bubble < 10%; "
          "a rule's knee = smallest N with N·r ≥ its R_req (medians over the runs at that S)")
    print(f"{'S':>3} {'I':>3} {'measured knee':>14} {'overlapped rule':>16} {'paper rule':>11}")
    for k in summary:
        measured = f"N = {k['measured']}" if k["measured"] is not None else f"> {k['largest_n']}"
        rules = [f"N = {k[rule]}" if k[rule] is not None else "infeasible" for rule in ("overlapped", "paper")]
        print(f"{k['S']:>3} {k['I']:>3} {measured:>14} {rules[0]:>16} {rules[1]:>11}")
    return 0


def _row(r: dict) -> str:
    req = "  ".join(f"{rule} {v:7.0f}/s" if math.isfinite(v) else f"{rule}     inf" for rule, v in r["r_req"].items())
    return (f"S={r['S']} I={r['I']}  N={r['N']}  R={r['R']:6.0f}/s  T_train={r['t_train']:.3f}s  "
            f"T_bcast={r['t_bcast']:.3f}s  τ={r['install_s']:.3f}s  R_req {req}  "
            f"bubble {100 * r['bubble_measured']:5.1f}%")
