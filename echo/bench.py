"""`echo-rl bench NAME`: the benchmarks whose tables are in docs/benchmarks.md.

Each prints a table that compares against a bound or a baseline measured in the same run.
"""

from __future__ import annotations

import importlib
import sys

BENCHMARKS: dict[str, tuple[str, str]] = {
    "broadcast": ("broadcast.bench:cli", "stripes, chains and the star against the bound T* on emulated WAN links: symmetric, asymmetric and mixed fleets, a killed stripe owner, a worker behind NAT (needs root)"),
    "activation": ("scheduler.bench.planning:activation_cli", "greedy vs exact (ILP) activation on random pools: cost gap, solve time"),
    "staleness": ("scheduler.bench.planning:staleness_cli", "closed-form staleness vs the discrete-event simulator on a grid"),
    "simspeed": ("scheduler.bench.planning:speed_cli", "simulator throughput in simulated rollouts/s"),
    "install-memory": ("worker.bench.install_memory:cli", "a worker's host memory to stage and read a version: a copy with tensors copied out (before) vs the relay's buffer with tensor views"),
    "install-check": ("worker.bench.install_check:cli", "what checking an install costs a vLLM worker's CPU: the trainer's probe computed there (before) vs read from the snapshot"),
    "engines": ("worker.bench.engines:cli", "rollout engines: generation tokens/s, install ms and mismatch_kl, transformers vs vLLM"),
    "overlap": ("learner.bench.overlap:cli", "the overlap capacity rule on the real system: bubble vs pool size and S"),
    "control-plane": ("learner.bench.control_plane:cli", "the control API under many simulated workers with churn: latency per route, loop lag, ledger; --hostile F: a share of them attacking, against a benign run"),
    "buffer": ("learner.bench.buffer_memory:cli", "what the buffer of uploaded groups costs to hold: memory and a full garbage-collection pass, arrays vs Python lists"),
    "learner": ("learner.bench.trainer:cli", "trainer memory and time: batch tokens, chunked log-probs, ranks, largest model"),
}


def cli(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        width = max(map(len, BENCHMARKS))
        print("usage: echo-rl bench NAME [ARGS...]\n\nbenchmarks:")
        for name, (_, help_) in BENCHMARKS.items():
            print(f"  {name:<{width}}  {help_}")
        print("\nRun 'echo-rl bench NAME --help' for its options.")
        return 0
    if argv[0] not in BENCHMARKS:
        print(f"echo-rl bench: unknown benchmark {argv[0]!r}; choose from {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    module, _, func = BENCHMARKS[argv[0]][0].partition(":")
    return int(getattr(importlib.import_module(module), func)(argv[1:]) or 0)
