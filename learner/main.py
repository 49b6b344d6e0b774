"""`echo-learner --config configs/demo.toml`: serve workers, train, publish, log.

The command line: the config and its overrides (`--dry-run` prints it resolved), `--preflight`,
`--resume`, and `--nproc N` (or `[run] nproc`), which relaunches under torchrun
(`learner.launch`): rank 0 runs the learner (`learner.serve`, the composition root), ranks
1..N-1 replay its trainer calls. Ctrl-C or SIGTERM stops a run; its run directory keeps the
last checkpoint.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from echo import serving
from echo.chat import ChatError
from echo.config import ConfigError, add_config_args, dump_toml
from echo.tasks import TaskError
from learner.config import load_learner_config
from echo.procs import die_with_my_parent, more_files
from learner.launch import check_rank, follow, launch
from learner.local_workers import LocalWorkers
from learner.rundir import RunDir, nothing_to_train, port_in_use
from learner.serve import serve
from learner.train.dist import DeviceError, close, cuda_allocator_defaults, init_world, under_torchrun

DEFAULT_CONFIG = "configs/demo.toml"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cuda_allocator_defaults()
    parser = argparse.ArgumentParser(
        prog="echo-learner",
        description="Run the echo learner: serve prompts to workers, train on their rollouts with "
                    "bounded staleness, publish versioned snapshots. Any other --section.key VALUE "
                    "overrides the config, e.g. --trainer.lr 3e-4 --workers.spawn 0.",
    )
    add_config_args(parser, DEFAULT_CONFIG if os.path.exists(DEFAULT_CONFIG) else None)
    parser.add_argument("--resume", type=Path, metavar="RUN_DIR",
                        help="continue a run from its latest checkpoint (its config.toml is the base config)")
    parser.add_argument("--nproc", type=int, metavar="N",
                        help="trainer ranks on this node (FSDP2 under torchrun; same as --run.nproc N)")
    parser.add_argument("--preflight", action="store_true",
                        help="print the model, dtypes and predicted memory per rank, check they fit, and exit "
                             "(reads config.json and the tokenizer only: no weights)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per step and a JSON summary")
    args, overrides = parser.parse_known_args(argv)
    if args.nproc is not None:
        overrides += ["--run.nproc", str(args.nproc)]
    config_path = args.resume / "config.toml" if args.resume else args.config
    if args.resume and not config_path.exists():
        print(f"echo-learner: --resume {args.resume}: not a run directory (no config.toml there); give the "
              "directory a run printed at its start (RUN_DIR, e.g. runs/demo-20261128-093000)", file=sys.stderr)
        return 2
    try:
        cfg = load_learner_config(config_path, overrides)
    except ConfigError as e:
        print(f"echo-learner: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(dump_toml(cfg), end="")
        # What the file leaves to be derived, as the run will use it (a key left unset prints
        # nothing above; one set is not "derived": a new user's --publish.every 2 was said to be)
        derived = [f"[publish] every = {cfg.publish_every} (I; unset: S - 1, at least 1)" if cfg.publish.every is None
                   else None,
                   f"[buffer] dynamic_sampling = {str(cfg.dynamic_sampling).lower()} (unset: on with loss = 'grpo')"
                   if cfg.buffer.dynamic_sampling is None else None]
        if said := [d for d in derived if d]:
            print("\n# derived: " + ", ".join(said))
        return 0
    done, was_finished = (nothing_to_train(args.resume, cfg.run.steps) if args.resume else None) or (None, False)
    if done is not None and was_finished:
        # Resuming a finished run evaluated again, re-saved its last checkpoint and replaced its
        # summary with one of zero groups trained. Nothing to do (said before a model loads).
        print(f"echo-learner: {args.resume} already finished: {done} of {cfg.run.steps} updates applied (its "
              f"summary.json and model/ are the run's); to train on, resume with a larger --run.steps",
              file=sys.stderr)
        return 0
    if done is not None:
        print(f"echo-learner: --run.steps {cfg.run.steps} leaves nothing to train: {args.resume} was stopped after its "
              f"checkpoint at update {done}; resume with --run.steps above {done}",
              file=sys.stderr)
        return 2
    if not (cfg.model.path / "config.json").exists():
        # Say what to do for the model the config names: a real one is downloaded (its published
        # config.json, shipped under configs/models/, is all --preflight reads); the demo's is built.
        shipped = Path("configs/models") / cfg.model.path.name
        if args.preflight and (shipped / "config.json").exists():
            fix = f"--preflight reads only config.json: add --model.path {shipped} (its published config)"
        else:
            fix = (f"set [model] path (--model.path) to a model's directory, e.g. one downloaded with `huggingface-cli "
                   f"download ORG/NAME --local-dir {cfg.model.path}`, or build the tiny test model there with "
                   f"`echo-rl build-model --config {config_path} --out {cfg.model.path}`")
        print(f"echo-learner: {cfg.model.path} has no config.json, so it is not a Hugging Face model directory; {fix}",
              file=sys.stderr)
        return 2
    try:
        cfg.task.build().check_here()
    except TaskError as e:
        print(f"echo-learner: {e}", file=sys.stderr)
        return 2
    if args.preflight or (cfg.run.nproc > 1 and not under_torchrun()):
        return launch(cfg, argv, args.json, check_only=args.preflight)
    if under_torchrun():  # torchrun puts ranks in sessions of their own: end with it, whatever killed it
        die_with_my_parent(signal.SIGKILL)
    try:
        world = init_world(cfg.model.device)
    except DeviceError as e:
        print(f"echo-learner: {e}", file=sys.stderr)
        return 2
    if not check_rank(cfg, world, args.json):
        close(world)
        return 2
    if not world.is_main:
        try:
            return follow(cfg, world, args.resume)
        except (TaskError, ChatError):
            return 2  # rank 0 says why
    more_files()  # the control API holds a few connections per worker
    run_dir = RunDir(cfg, args.resume)
    if run_dir.resumed and (holder := run_dir.hold()) is not None:
        print(f"echo-learner: {run_dir} is served by another learner ({holder}); stop it first", file=sys.stderr)
        close(world)
        return 2
    port = cfg.server.port or (run_dir.port(0) if run_dir.resumed else 0)
    if port and port_in_use(cfg.server.host, port):  # said now, not in a traceback after the model loaded
        print(f"echo-learner: {cfg.server.host}:{port} is in use; "
              + ("the run had it: choose another with --server.port N" if run_dir.resumed and not cfg.server.port
                 else "choose another --server.port (0: a free one)"), file=sys.stderr)
        close(world)
        return 2
    if not run_dir.resumed:
        run_dir.hold()  # a fresh run's, now that it will serve: a --resume of it meanwhile is refused
    workers = LocalWorkers(cfg.workers, run_dir / "workers", run_dir.token, cfg.run.seed)
    try:
        return serving.run(serve(cfg, world, run_dir, workers, args.json))
    except (TaskError, ChatError) as e:  # the task cannot be played with this model (`Episodes.check_playable`)
        print(f"echo-learner: {e}", file=sys.stderr)
        close(world)
        return 2
    except KeyboardInterrupt:
        from learner.rundir import latest_checkpoint

        every = cfg.run.checkpoint_every
        kept = (f"keeps the last checkpoint (continue with --resume {run_dir})" if latest_checkpoint(run_dir.path)
                else f"holds no checkpoint yet (the first comes after {every} updates; start the run again)"
                if every and every < cfg.run.steps
                else f"holds no checkpoint ([run] checkpoint_every = {every} saves one only at the end of this "
                     f"{cfg.run.steps}-step run; start the run again)")
        print(f"echo-learner: interrupted; the run directory {run_dir} {kept}", file=sys.stderr)
        return 130
    finally:
        workers.kill()
        close(world)


if __name__ == "__main__":
    sys.exit(main())
