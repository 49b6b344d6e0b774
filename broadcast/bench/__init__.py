"""The broadcast benchmarks (drivers, not library code): `echo-rl bench broadcast` runs
`netem_runs` (chains, stripes and the star on emulated WAN links, faults, deltas, NAT);
`echo-rl bench broadcast transports` runs `transports` (aiohttp vs py-libp2p on loopback).
Both print with `table`."""

from broadcast.bench.netem_runs import MBIT, Bench, BenchError, Settings, cli, main, render, sweep

__all__ = ["MBIT", "Bench", "BenchError", "Settings", "cli", "main", "render", "sweep"]
