"""WAN scenarios from TOML, and the `python -m netem` command line.

A scenario file (see `configs/wan/*.toml`):

    description = "learner 1 Gbit/s up, 4 workers at 200/200 Mbit/s, 20 ms one way"
    [[hosts]]
    name = "learner"
    up_mbit = 1000
    down_mbit = 1000
    delay_ms = 20
    [[hosts]]
    name = "worker"        # with count = 4: worker1 .. worker4
    count = 4
    up_mbit = 200
    down_mbit = 200
    delay_ms = 20
    [[processes]]          # optional: started in each host's namespace by `netem run`
    host = "learner"
    cmd = ["{python}", "-m", "http.server", "9000"]

Commands:

    python -m netem probe [--json]                      what this machine can emulate
    python -m netem run SCENARIO [--host H] [-- CMD...]  up, run [[processes]] and CMD, down
    python -m netem cleanup [--all] [--json]            remove leftovers of crashed runs of ours

In `cmd` strings, `{ip[learner]}` is a host's address, `{hub}` the hub's, `{python}` this
Python interpreter, and
`{addr[worker1][learner][9000]}` is `HOST:PORT` where worker1 connects to reach port 9000 on
learner with the path's latency (a relay when the kernel has no netem). Write `{{` for `{`.
Every process also gets `NETEM_TOPOLOGY`: the path of a JSON file describing the topology.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import string
import sys
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from echo.config import ConfigError, Section, load_config

from . import iproute
from .capability import probe
from .errors import CommandTimeout, NetemError
from .run import Process, Result
from .topology import HostSpec, Topology


class HostGroup(HostSpec):
    """A `[[hosts]]` table: one host, or `count` alike hosts named `<name>1` .. `<name><count>`."""

    count: int = Field(default=1, ge=1, le=253, description="hosts.count: how many such hosts")


class ProcessSpec(Section):
    """A `[[processes]]` table: a command started in one host's namespace by `netem run`."""

    host: str = Field(description="processes.host: name of the host to run in")
    cmd: list[str] = Field(min_length=1, description="processes.cmd: argv; placeholders allowed")


class Scenario(Section):
    """A whole WAN scenario file."""

    description: str = Field(default="", description="description: one line about the scenario")
    latency: Literal["auto", "netem", "relay"] = Field(
        default="auto", description="latency: 'netem' qdisc, userspace 'relay', or 'auto'"
    )
    queue_ms: float = Field(
        default=50.0, gt=0, le=10_000, description="queue_ms: router buffer per link, ms of its rate"
    )
    subnet: str = Field(
        default="10.231.0",
        pattern=r"^10\.\d{1,3}\.\d{1,3}$",
        description="subnet: first three octets of the private /24 used inside our namespaces",
    )
    hosts: list[HostGroup] = Field(min_length=1, description="hosts: the [[hosts]] tables")
    processes: list[ProcessSpec] = Field(default=[], description="processes: the [[processes]] tables")

    def host_specs(self) -> list[HostSpec]:
        """The hosts, with each `count` expanded."""
        specs = []
        for group in self.hosts:
            fields = group.model_dump(exclude={"count", "name"})
            names = (
                [group.name] if group.count == 1 else [f"{group.name}{i}" for i in range(1, group.count + 1)]
            )
            specs.extend(HostSpec(name=n, **fields) for n in names)
        return specs

    @model_validator(mode="after")
    def _check(self) -> Scenario:
        names = [h.name for h in self.host_specs()]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"host names must be unique; repeated: {', '.join(dupes)}")
        for p in self.processes:
            if p.host not in names:
                raise ValueError(f"processes.host = {p.host!r} is not a host (hosts: {', '.join(names)})")
        return self

    def topology(self) -> Topology:
        """A `Topology` for this scenario (not yet up: use it in a `with`)."""
        return Topology(self.host_specs(), subnet=self.subnet, latency=self.latency, queue_ms=self.queue_ms)


def load_scenario(path: str | Path, overrides: list[str] | None = None) -> Scenario:
    """Read and validate a scenario TOML; errors name the key and the file."""
    return load_config(Scenario, path, overrides)


class _Lookup:
    """`{addr[a][b][9000]}` in a format string: chained item access ending in a call."""

    def __init__(self, fn: Any, depth: int, keys: tuple[str, ...] = ()) -> None:
        self._fn, self._depth, self._keys = fn, depth, keys

    def __getitem__(self, key: Any) -> Any:
        keys = (*self._keys, str(key))
        return self._fn(*keys) if len(keys) == self._depth else _Lookup(self._fn, self._depth, keys)


def expand(arg: str, topo: Topology) -> str:
    """Fill `{ip[h]}`, `{hub}` and `{addr[src][dst][port]}` in one command argument."""
    ips = {h.name: h.ip for h in topo}

    def addr(src: str, dst: str, port: str) -> str:
        host, p = topo.address(src, dst, int(port))
        return f"{host}:{p}"

    fields = {"ip": ips, "hub": topo.hub_ip, "addr": _Lookup(addr, 3), "python": sys.executable}
    try:
        return string.Formatter().vformat(arg, (), fields)
    except (KeyError, IndexError, ValueError, AttributeError) as e:
        raise ConfigError(
            f"bad placeholder in {arg!r} ({type(e).__name__}: {e}); allowed: {{ip[HOST]}}, {{hub}}, "
            "{python}, {addr[SRC][DST][PORT]}; write {{ and }} for literal braces"
        ) from None


def run_scenario(
    scenario: Scenario, command: list[str] | None = None, host: str | None = None, timeout_s: float = 600.0
) -> tuple[dict[str, Any], list[Result]]:
    """Bring the scenario up, run its processes and `command`, tear down; return what happened.

    With `command`, the run lasts until it exits (the `[[processes]]`, typically servers, are
    then stopped); without, until every process exits. `command` runs in `host`'s namespace,
    or in the root namespace when `host` is None (it can then enter hosts itself with the
    namespace names in `NETEM_TOPOLOGY`). Raises `CommandTimeout` after `timeout_s`, every process
    stopped and its output in the error's.
    """
    with scenario.topology() as topo, tempfile.TemporaryDirectory(prefix="echo-netem-") as tmp:
        described = topo.describe()
        info = Path(tmp) / "topology.json"
        info.write_text(json.dumps(described, indent=1))
        env = {"NETEM_TOPOLOGY": str(info)}
        procs = [_start(topo, p.host, [expand(a, topo) for a in p.cmd], env) for p in scenario.processes]
        waited = procs
        if command:
            main = _start(topo, host, [expand(a, topo) for a in command], env)
            waited = [main]
            procs.append(main)
        try:
            topo.processes.wait_all(waited, timeout_s)
        except CommandTimeout as e:  # out of time: what each process printed is what says why
            for proc in procs:
                proc.stop()
            raise CommandTimeout(f"{e}; every process was stopped", None,
                                 _format_results([proc.wait(0) for proc in procs])) from None
        for proc in procs:
            proc.stop()
        return described, [proc.wait(0) for proc in procs]


def _start(topo: Topology, host: str | None, argv: list[str], env: dict[str, str]) -> Process:
    """Start `argv` in `host`'s namespace (None: the root one), named `host:program`."""
    ns = topo[host].ns if host else None
    return topo.processes.start(f"{host or 'root'}:{Path(argv[0]).name}", argv, ns, env)


def _format_results(results: list[Result]) -> str:
    lines = []
    for r in results:
        lines.append(f"--- {r.name}: exit {r.returncode} after {r.elapsed_s:.2f} s: {' '.join(r.argv)}")
        if r.output:
            lines.append(r.output.rstrip())
    return "\n".join(lines)


def cli(argv: list[str] | None = None) -> int:
    """`python -m netem ...`; returns the process exit status."""
    p = argparse.ArgumentParser(prog="python -m netem", description="Wide-area emulation on one machine.")
    sub = p.add_subparsers(dest="command", required=True)
    pr = sub.add_parser("probe", help="report what this machine can emulate")
    pr.add_argument("--json", action="store_true", help="machine-readable output")
    cl = sub.add_parser("cleanup", help="remove namespaces left by crashed runs of ours")
    cl.add_argument("--all", action="store_true", help="also those of running processes of ours")
    cl.add_argument("--json", action="store_true", help="machine-readable output")
    ru = sub.add_parser("run", help="bring a scenario up, run its processes and CMD, tear it down")
    ru.add_argument("scenario", help="scenario TOML (see configs/wan/)")
    ru.add_argument("--host", default=None, help="run CMD in this host's namespace (default: root ns)")
    ru.add_argument("--timeout", type=float, default=600.0, help="seconds before everything is stopped")
    ru.add_argument("--dry-run", action="store_true", help="print the resolved scenario and exit")
    ru.add_argument("--json", action="store_true", help="machine-readable output")
    ru.epilog = "then: -- CMD ARGS... (the command to run)"
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after `--` is the command, options included, so split before argparse sees it.
    command = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)

    try:
        if args.command == "probe":
            caps = probe()
            if args.json:
                print(json.dumps({**dataclasses.asdict(caps), "namespaces": caps.namespaces}))
            else:
                ok = [k for k, v in dataclasses.asdict(caps).items() if v is True]
                print(f"available: {', '.join(ok) or 'nothing'}")
                print(f"shaped namespace topologies: {'yes' if caps.namespaces else 'no'}")
                if caps.reason:
                    print(f"notes: {caps.reason}")
            return 0 if caps.namespaces else 1
        if args.command == "cleanup":
            removed = iproute.cleanup(include_live=args.all) if probe().root else []
            print(json.dumps({"removed": removed}) if args.json else f"removed {len(removed)} namespace(s)")
            return 0
        scenario = load_scenario(args.scenario)
        if args.dry_run:  # the resolved scenario, with every `count` expanded
            resolved = scenario.model_dump(exclude={"hosts"})
            resolved["hosts"] = [h.model_dump() for h in scenario.host_specs()]
            print(json.dumps(resolved, indent=2))
            return 0
        if args.host is not None and args.host not in {h.name for h in scenario.host_specs()}:
            raise ConfigError(f"--host {args.host!r} is not a host of {args.scenario}")
        described, results = run_scenario(scenario, command or None, args.host, args.timeout)
    except (NetemError, ConfigError) as e:
        if isinstance(e, CommandTimeout):  # what each process printed says why it ran so long
            print(e.output)
        print(f"netem: {e}", file=sys.stderr)
        return 124 if isinstance(e, CommandTimeout) else 2
    if args.json:
        print(json.dumps({"topology": described, "processes": [dataclasses.asdict(r) for r in results]}))
    else:
        print(_format_results(results))
    return next((r.returncode for r in results if not r.ok), 0) if not command else results[-1].returncode
