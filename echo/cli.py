"""`echo-rl`: the umbrella command. Each subcommand lives in its own module and is imported
only when used, so `echo-rl --help` is instant and a missing optional extra breaks one
subcommand, not all of them."""

from __future__ import annotations

import importlib
import sys

# name -> ("module:function", one-line help). Each function takes argv (list[str]) and returns
# an exit code; it parses its own arguments, so `echo-rl NAME --help` explains NAME.
COMMANDS: dict[str, tuple[str, str]] = {
    "build-model": ("learner.tinymodel:cli", "build the tiny demo model + tokenizer and warm-start it"),
    "report": ("echo.report:cli", "turn a run directory's metrics.jsonl into PNG plots"),
    "plan": ("scheduler.plan:cli", "predict staleness, capacity and cost of a configuration"),
    "bench": ("echo.bench:cli", "run a benchmark and print its table"),
    "experiment": ("learner.bench.experiment:cli", "measure sync vs bounded staleness (and replay) end to end"),
    "eval": ("learner.evaluate:cli", "play a model against the poker table's opponents (ECHO-2 Table 4)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [
        "usage: echo-rl COMMAND [ARGS...]",
        "",
        "echo: asynchronous RL post-training with rollouts on rented GPUs.",
        "The learner and workers have their own commands: echo-learner, echo-worker.",
        "",
        "commands:",
    ]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'echo-rl COMMAND --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"echo-rl: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, _, func = COMMANDS[name][0].partition(":")
    return int(getattr(importlib.import_module(module), func)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
