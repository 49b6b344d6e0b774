"""`echo-worker join <learner-url> --token <t>`: join a run and generate rollouts for it."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from urllib.parse import urlsplit

import aiohttp

from echo import serving
from echo.config import ConfigError, add_config_args, dump_toml
from echo.tasks import TaskError
from worker.client import LearnerError
from worker.config import load_worker_config

DEFAULT_CONFIG = "configs/worker.toml"


def url_problem(url: str) -> str | None:
    """What is wrong with a learner URL typed on the command line, or None."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number in range
    except ValueError as e:
        return str(e)
    if parts.scheme not in ("http", "https"):
        return "no http:// or https:// in front" if "://" not in url else f"scheme {parts.scheme!r}"
    if not parts.hostname:
        return "no host"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="echo-worker",
        description="Generate rollouts for an echo learner. Any other --section.key VALUE "
                    "overrides the config, e.g. --engine.type vllm --worker.price_per_hour 0.35.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    join = sub.add_parser("join", help="join a learner's run and work until it finishes",
                          description="Join a learner's run and work until it finishes.")
    join.add_argument("url", help="the learner's URL, e.g. http://10.0.0.5:8650")
    join.add_argument("--token", default=os.environ.get("ECHO_TOKEN", ""),
                      help="run token printed by echo-learner (default: $ECHO_TOKEN)")
    add_config_args(join, DEFAULT_CONFIG if os.path.exists(DEFAULT_CONFIG) else None)
    doctor = sub.add_parser("doctor", help="check this machine: GPU, engine, disk, the learner's link, clock, a generation",
                            description="Check this machine: one PASS/FAIL/SKIP line per check (paste them into a bug report).")
    doctor.add_argument("url", nargs="?", help="the learner's URL (its checks are skipped without it)")
    doctor.add_argument("--token", default=os.environ.get("ECHO_TOKEN", ""),
                        help="run or machine token (default: $ECHO_TOKEN)")
    doctor.add_argument("--min-disk-gb", type=float, default=20.0, help="free disk the cache needs (default 20 GB)")
    add_config_args(doctor, DEFAULT_CONFIG if os.path.exists(DEFAULT_CONFIG) else None)
    args, overrides = parser.parse_known_args(argv)
    if args.command == "doctor":
        from worker.doctor import run

        try:
            cfg = load_worker_config(args.config, overrides)
        except ConfigError as e:
            print(f"echo-worker: {e}", file=sys.stderr)
            return 2
        return run(args.url, args.token, cfg.worker.cache_dir, args.min_disk_gb, print_line=lambda s: print(s, flush=True))
    try:
        cfg = load_worker_config(args.config, overrides)
    except ConfigError as e:
        print(f"echo-worker: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(dump_toml(cfg), end="")
        return 0
    if not args.token:
        print("echo-worker: no run token: pass --token TOKEN (printed by echo-learner) or set $ECHO_TOKEN",
              file=sys.stderr)
        return 2
    if (wrong := url_problem(args.url)) is not None:
        print(f"echo-worker: the learner's URL must look like http://HOST:PORT (as echo-learner prints it), "
              f"not {args.url[:200]!r}: {wrong}", file=sys.stderr)
        return 2
    from worker.engines import EngineError, check_engine_here

    try:
        check_engine_here(cfg.engine.type, cfg.engine.device)
    except EngineError as e:
        print(f"echo-worker: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    from worker.rollout import QUARANTINED, Worker

    try:
        # As the learner's: SIGTERM as Ctrl-C, the relay and the engine closed on the way out and
        # said (a SIGTERM'd worker exited without a line; a new user, 2026-12-07)
        return serving.run(Worker(cfg, args.url, args.token).run())
    except LearnerError as e:
        print(f"echo-worker: the learner refused: {e.message or e}", file=sys.stderr)
        # Quarantined (or barred from joining for it), whichever call heard it first: code 3, as
        # docs/workers.md says, so a supervisor does not restart a worker the learner refuses.
        return QUARANTINED if e.reason in ("quarantined", "banned") else 1
    except aiohttp.ClientConnectionError as e:
        print(f"echo-worker: cannot reach the learner at {args.url}: {e}", file=sys.stderr)
        return 1
    except (TaskError, EngineError) as e:  # the run's task or engine needs something this machine lacks
        print(f"echo-worker: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # said, as echo-learner says its own
        print("echo-worker: interrupted; the prompts it held go out again when their leases expire. Join again "
              "with the same command to carry on", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
