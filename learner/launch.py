"""Many trainer ranks on one node: `echo-learner --nproc N` relaunches itself under torchrun.

`launch` checks the plan here (`--preflight` stops there), then runs the same command as
`[run] nproc` torchrun ranks. Rank 0 runs the learner; `follow` is what ranks 1..N-1 do: build
the same trainer and replay rank 0's calls (`learner.train.dist.Lockstep`) until it says stop.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from echo.procs import die_with_parent
from learner.config import LearnerConfig
from learner.rundir import latest_checkpoint
from learner.train.dist import Lockstep, World, close
from learner.train.preflight import PreflightError, check_fits, preflight

LAUNCHED = "ECHO_LEARNER_LAUNCHED"  # set by the launcher for its torchrun ranks: preflight was printed


def launch(cfg: LearnerConfig, argv: list[str], as_json: bool, check_only: bool) -> int:
    try:
        pf = preflight(cfg, cfg.run.nproc, cfg.model.device if not cfg.model.device.startswith("cuda") else "cuda:0",
                       need_tokenizer=not check_only)
        if as_json and check_only:
            print(json.dumps({"parameters": pf.shape.params, "ranks": cfg.run.nproc, "available_bytes": pf.available,
                              "predicted_bytes": pf.plan.total, "predicted": vars(pf.plan)}))
        elif not as_json:
            print("\n".join(pf.lines), flush=True)
        check_fits(pf, cfg, cfg.run.nproc)
    except PreflightError as e:
        print(f"echo-learner: {e}", file=sys.stderr)
        return 2
    if check_only:
        return 0
    # --nproc would reach torchrun's own parser (a prefix of its --nproc-per-node): pass the config key.
    args = [a for i, a in enumerate(argv) if not (a.startswith("--nproc") or (i and argv[i - 1] == "--nproc"))]
    cmd = [sys.executable, "-m", "learner.launch", "--standalone", "--nproc_per_node", str(cfg.run.nproc),
           "-m", "learner.main", *args, "--run.nproc", str(cfg.run.nproc)]
    env = {**os.environ, LAUNCHED: "1", "OMP_NUM_THREADS": str(cfg.run.threads), "PYTHONUNBUFFERED": "1"}
    # A session of its own (its ranks follow it: see main), so that a Ctrl-C at the terminal and a
    # SIGINT sent to this pid alone, as a supervisor sends it, reach torchrun the same way: once, from
    # here. (Before, only the terminal's reached it: `kill -INT` of this pid stopped nothing.)
    proc = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent(), start_new_session=True)
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:  # torchrun stops its ranks, each saying what the run directory keeps
            proc.send_signal(signal.SIGINT)


def check_rank(cfg: LearnerConfig, world: World, as_json: bool) -> bool:
    """This rank's preflight (printed once, by rank 0 of a run not launched by `launch`): does it fit?"""
    try:
        pf = preflight(cfg, world.size, str(world.device))
        if world.is_main and not os.environ.get(LAUNCHED) and not as_json:
            print("\n".join(pf.lines), flush=True)
        check_fits(pf, cfg, world.size)
        return True
    except PreflightError as e:
        print(f"echo-learner: {e}", file=sys.stderr)
        return False


def follow(cfg: LearnerConfig, world: World, resume: Path | None) -> int:
    """Ranks 1..N-1: build the same trainer, then replay rank 0's calls until it says stop."""
    import torch

    from learner.train.trainer import Trainer

    torch.set_num_threads(cfg.run.threads)
    checkpoint = latest_checkpoint(resume) if resume else None
    try:
        trainer = Trainer(cfg, world, checkpoint)
        Lockstep(trainer, world).follow()
    except KeyboardInterrupt:  # torchrun passing on a Ctrl-C: rank 0 says what the run directory keeps
        return 130
    close(world)
    return 0


def torchrun(argv: list[str]) -> int:
    """torchrun, quiet when it is stopped: the launcher's end (Ctrl-C, `kill`) sends it SIGTERM,
    which torchrun raises as a 20-line traceback under the learner's own "interrupted" line."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main

    try:
        main(argv)
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":  # the launcher's torchrun (`launch`)
    sys.exit(torchrun(sys.argv[1:]))
