"""`echo-worker join <learner-url> --token <t>`: join a run and generate rollouts for it."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

import aiohttp

from echo.config import ConfigError, add_config_args, dump_toml
from worker.client import LearnerError
from worker.config import load_worker_config

DEFAULT_CONFIG = "configs/worker.toml"


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
    args, overrides = parser.parse_known_args(argv)
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
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    from worker.rollout import Worker

    try:
        return asyncio.run(Worker(cfg, args.url, args.token).run())
    except LearnerError as e:
        print(f"echo-worker: the learner refused: {e.message or e}", file=sys.stderr)
        return 1
    except aiohttp.ClientConnectionError as e:
        print(f"echo-worker: cannot reach the learner at {args.url}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
