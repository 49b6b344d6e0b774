"""A star of shaped links on one machine: one namespace per host, all wired to a hub bridge.

    hosts = [HostSpec(name="learner", up_mbit=1000, down_mbit=1000, delay_ms=20),
             HostSpec(name="w1", up_mbit=200, down_mbit=200, delay_ms=20)]
    with Topology(hosts) as topo:
        host, port = topo.address("w1", "learner", 9000)  # where w1 connects to reach learner:9000
        topo["learner"].start(["python", "-m", "my.server", "--port", "9000"])
        print(topo["w1"].call(fetch, host, port))        # a callable run inside w1's namespace

Layout (everything lives inside namespaces named `echo-netem-<pid>-<n>-*`; nothing is added to
the root namespace, so deleting the namespaces removes it all):

    [host ns: eth0 10.231.0.i] ==veth== [hub ns: h<i> -- br0 10.231.0.254]

- upload cap: htb on egress of the host's `eth0`;
- download cap: htb on egress of the hub's `h<i>` (the bridge port towards the host), so no
  ifb is needed;
- latency, `delay_ms` one way between a host and the hub (a path A->B takes
  delay_A + delay_B): a `netem` leaf on both qdiscs where the kernel has netem; otherwise a
  userspace delay relay in the hub namespace, whose address `address()` hands out. Traffic
  through a relay still crosses both capped links, so caps hold.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

from pydantic import Field

from echo.config import Section

from . import iproute
from .capability import require_namespaces
from .errors import CapabilityError, TopologyError
from .run import CallHandle, Process, ProcessGroup, Result, netns_argv

Latency = Literal["auto", "netem", "relay"]

_HUB = 254  # the hub's host number in the /24; hosts take .1, .2, ...
_SEQ = itertools.count()  # topology number within this process, so names never collide
# A reply comes in milliseconds; the wait ends the moment it does. (A CI run once counted none
# in 10 s though the server had printed one: reading its log moved the offset the server wrote
# at, so the reply landed over an earlier one. `Process.output` reads with pread now.)
_RELAY_REPLY_TIMEOUT_S = 30.0
_MIN_QUEUE_BYTES = 256 * 1024  # a few 64 KiB GSO frames, or a tiny queue stalls fast links


class HostSpec(Section):
    """One emulated host and its link to the hub (TOML: one `[[hosts]]` table)."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]{0,31}$", description="hosts.name: unique host name")
    up_mbit: float = Field(gt=0, le=100_000, description="hosts.up_mbit: upload cap, Mbit/s (10^6 bit/s)")
    down_mbit: float = Field(gt=0, le=100_000, description="hosts.down_mbit: download cap, Mbit/s")
    delay_ms: float = Field(
        default=0.0, ge=0, le=10_000, description="hosts.delay_ms: one-way latency host<->hub, ms"
    )
    accept_inbound: bool = Field(
        default=True,
        description="hosts.accept_inbound: false = behind NAT: inbound TCP connections are dropped, "
        "outbound ones work",
    )


class Host:
    """A running emulated host: its namespace, its address, and ways to run things inside it."""

    def __init__(self, spec: HostSpec, ns: str, ip: str, processes: ProcessGroup) -> None:
        self.spec = spec
        self.ns = ns
        self.ip = ip
        self._processes = processes

    @property
    def name(self) -> str:
        return self.spec.name

    def argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` wrapped to run in this host's namespace (for callers that spawn it themselves)."""
        return netns_argv(self.ns, argv)

    def start(
        self, argv: Sequence[str], env: dict[str, str] | None = None, name: str | None = None
    ) -> Process:
        """Start a command here; its output is collected and it is stopped at teardown."""
        return self._processes.start(name or f"{self.name}:{argv[0]}", argv, self.ns, env)

    def run(self, argv: Sequence[str], timeout_s: float = 60.0, check: bool = True) -> Result:
        """Run a command here to completion; with `check`, a failure raises `CommandError`."""
        return self.start(argv).wait(timeout_s, check)

    def call_async(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> CallHandle:
        """Start `func(*args, **kwargs)` in a Python process here; `.result()` collects it."""
        name = f"{self.name}:{getattr(func, '__name__', 'call')}"
        return self._processes.call_async(name, self.ns, func, *args, **kwargs)

    def call(self, func: Callable[..., Any], *args: Any, timeout_s: float = 60.0, **kwargs: Any) -> Any:
        """Run `func(*args, **kwargs)` here and return its value (blocking, `timeout_s` at most).

        `timeout_s` belongs to this call; to pass an argument of that name to `func`, use
        `call_async(func, ..., timeout_s=...).result(limit)`.
        """
        return self.call_async(func, *args, **kwargs).result(timeout_s)

    def __repr__(self) -> str:
        return f"Host({self.name!r}, ip={self.ip}, ns={self.ns})"


class Topology:
    """Hosts in their own namespaces, each linked to a hub bridge by a shaped veth.

    Use as a context manager: `__exit__` tears everything down (processes, relays,
    namespaces and with them every device) even when the body raised. Not thread-safe.
    """

    def __init__(
        self,
        hosts: Sequence[HostSpec],
        *,
        subnet: str = "10.231.0",
        latency: Latency = "auto",
        queue_ms: float = 50.0,
    ) -> None:
        """`subnet`: first three octets of the private /24 used *inside* our namespaces only.

        `latency`: "netem" (kernel qdisc), "relay" (userspace relay in the hub) or "auto"
        (netem when the kernel has it). `queue_ms`: each shaped link queues at most this much
        of its rate (min 256 KiB) before dropping, like a router buffer, so a saturated link
        does not add seconds of queueing delay.
        """
        names = [h.name for h in hosts]
        if not hosts:
            raise TopologyError("a topology needs at least one host")
        if len(set(names)) != len(names):
            raise TopologyError(f"host names must be unique, got {names}")
        if len(hosts) >= _HUB:
            raise TopologyError(f"at most {_HUB - 1} hosts fit in one /24, got {len(hosts)}")
        if latency not in ("auto", "netem", "relay"):
            raise TopologyError(f"latency must be 'auto', 'netem' or 'relay', got {latency!r}")
        self.specs = list(hosts)
        self.subnet = subnet
        self.requested_latency: Latency = latency
        self.latency: Literal["netem", "relay"] = "relay"
        self.queue_ms = queue_ms
        self.hosts: dict[str, Host] = {}
        self._processes: ProcessGroup | None = None
        self.hub_ns = ""
        self.hub_ip = f"{subnet}.{_HUB}"
        self._namespaces: list[str] = []
        self._relay_servers: list[Process] = []  # delay relay processes, relays dealt round robin
        self._relays: dict[tuple[str, str, int], tuple[str, int]] = {}

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> Topology:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        """Create the namespaces, links, bridge and shaping; raise if any step fails."""
        caps = require_namespaces()
        if self.requested_latency == "netem" and not caps.netem:
            raise CapabilityError("latency='netem' but this kernel has no netem qdisc: use 'relay' or 'auto'")
        self.latency = "netem" if self.requested_latency != "relay" and caps.netem else "relay"
        iproute.cleanup()  # leftovers of our own crashed runs (dead owner pid only)

        self._processes = ProcessGroup()
        seq = str(next(_SEQ))
        self.hub_ns = self._add_ns(iproute.netns_name(seq, "hub"))
        iproute.ip("link", "add", "name", "br0", "type", "bridge", ns=self.hub_ns)
        iproute.ip("addr", "add", f"{self.hub_ip}/24", "dev", "br0", ns=self.hub_ns)
        iproute.ip("link", "set", "br0", "up", ns=self.hub_ns)
        for i, spec in enumerate(self.specs, start=1):
            ns = self._add_ns(iproute.netns_name(seq, spec.name))
            port = f"h{i}"
            # Both ends are created directly inside their namespaces: nothing in the root one.
            iproute.ip(
                *f"link add name eth0 netns {ns} type veth peer name {port} netns {self.hub_ns}".split()
            )
            iproute.ip("link", "set", port, "master", "br0", "up", ns=self.hub_ns)
            ip = f"{self.subnet}.{i}"
            iproute.ip("addr", "add", f"{ip}/24", "dev", "eth0", ns=ns)
            iproute.ip("link", "set", "eth0", "up", ns=ns)
            delay = spec.delay_ms if self.latency == "netem" else 0.0
            self._shape(ns, "eth0", spec.up_mbit, delay)
            self._shape(self.hub_ns, port, spec.down_mbit, delay)
            if not spec.accept_inbound:
                self._refuse_inbound(self.hub_ns, port)
            self.hosts[spec.name] = Host(spec, ns, ip, self._processes)

    def down(self) -> None:
        """Stop processes and relays, delete our namespaces; idempotent, never stops halfway."""
        errors = []
        try:
            if self._processes is not None:
                self._processes.close()
        except Exception as e:  # keep going: the namespaces must go regardless
            errors.append(f"stopping processes: {e}")
        self._processes = None
        for ns in reversed(self._namespaces):
            try:
                iproute.kill_netns_pids(ns)
                iproute.netns_delete(ns)
            except Exception as e:
                errors.append(f"deleting {ns}: {e}")
        self._namespaces.clear()
        self.hosts.clear()
        self._relays.clear()
        self._relay_servers = []
        if errors:
            raise TopologyError(
                "teardown was incomplete; run `python -m netem cleanup`: " + "; ".join(errors)
            )

    def _add_ns(self, name: str) -> str:
        iproute.ip("netns", "add", name)
        self._namespaces.append(name)  # recorded at once, so down() removes it even if we fail next
        iproute.ip("link", "set", "lo", "up", ns=name)
        return name

    def _shape(self, ns: str, dev: str, mbit: float, delay_ms: float) -> None:
        """Cap egress of `dev` at `mbit` (htb) with a bounded leaf queue, or a netem delay leaf."""
        rate_bit = int(mbit * 1e6)
        # Burst of >= 1 ms of the rate and >= two 64 KiB GSO frames: veth hands htb frames of up
        # to 64 KiB, bigger than htb's default burst (about rate/HZ) at these rates.
        burst = max(128 * 1024, rate_bit // 8 // 1000)
        iproute.tc("qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "1", ns=ns)
        iproute.tc(
            "class",
            "add",
            "dev",
            dev,
            "parent",
            "1:",
            "classid",
            "1:1",
            "htb",
            "rate",
            f"{rate_bit}bit",
            "ceil",
            f"{rate_bit}bit",
            "burst",
            str(burst),
            "cburst",
            str(burst),
            ns=ns,
        )
        if delay_ms > 0:
            # netem must hold everything in flight during the delay: rate x delay, in packets.
            limit = max(1000, int(rate_bit / 8 * delay_ms / 1000 / 1500) * 2)
            leaf = ["netem", "delay", f"{delay_ms}ms", "limit", str(limit)]
        else:
            queue = max(_MIN_QUEUE_BYTES, int(rate_bit / 8 * self.queue_ms / 1000))
            leaf = ["bfifo", "limit", str(queue)]
        iproute.tc("qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *leaf, ns=ns)

    @staticmethod
    def _refuse_inbound(ns: str, dev: str) -> None:
        """Drop TCP SYNs (SYN set, ACK clear) the hub sends down `dev` towards a host: nobody can
        open a connection to it, while its own connections (whose SYN-ACKs carry ACK) work —
        what a NAT or a stateful firewall does. A u32 filter steers them into an htb class whose
        queue holds one byte; filters, not iptables or tc actions, which this kernel may lack."""
        iproute.tc("class", "add", "dev", dev, "parent", "1:", "classid", "1:2", "htb", "rate", "8kbit",
                   "ceil", "8kbit", ns=ns)
        iproute.tc("qdisc", "add", "dev", dev, "parent", "1:2", "handle", "20:", "bfifo", "limit", "1", ns=ns)
        iproute.tc("filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                   "match", "ip", "protocol", "6", "0xff", "match", "u8", "0x02", "0x12", "at", "33",
                   "flowid", "1:2", ns=ns)

    # -- use ---------------------------------------------------------------------------------

    @property
    def processes(self) -> ProcessGroup:
        """Every process started in this topology (stopped at teardown)."""
        if self._processes is None:
            raise TopologyError("the topology is not up: use `with Topology(...) as topo:`")
        return self._processes

    def __getitem__(self, name: str) -> Host:
        try:
            return self.hosts[name]
        except KeyError:
            raise TopologyError(
                f"no host {name!r} (hosts: {', '.join(self.hosts) or 'none: call up()'})"
            ) from None

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts.values())

    def delay_ms(self, src: str, dst: str) -> float:
        """One-way latency of the path src -> dst (through the hub)."""
        return self[src].spec.delay_ms + self[dst].spec.delay_ms

    def address(self, src: str, dst: str, port: int) -> tuple[str, int]:
        """Where a process on `src` connects to reach `port` on `dst` with the path's latency.

        With netem (or zero delay) that is `dst`'s own address. Otherwise a relay in the hub
        holding bytes `delay_ms(src, dst)` each way is started (once per (src, dst, port)) and
        its address returned. The listener on `dst` must bind `0.0.0.0` or `dst`'s IP.
        """
        target = (self[dst].ip, port)
        delay = self.delay_ms(src, dst)
        if self.latency == "netem" or delay == 0:
            return target
        key = (src, dst, port)
        if key not in self._relays:
            self._relays[key] = self._request_relay(target, delay)
        return self._relays[key]

    def _request_relay(self, target: tuple[str, int], delay_ms: float) -> tuple[str, int]:
        """Ask one of the hub's relay servers (one per core, started on first use; relays dealt
        round robin, so every core carries delayed bytes) for one more relay."""
        i = len(self._relays) % (os.cpu_count() or 1)
        if i >= len(self._relay_servers):
            argv = [sys.executable, "-m", "netem.delay", "--control"]
            self._relay_servers.append(self.processes.start(f"hub:relay{i}", argv, self.hub_ns, stdin=True))
        server = self._relay_servers[i]
        assert server.popen.stdin is not None
        request = {"listen": [self.hub_ip, 0], "target": list(target), "delay_ms": delay_ms}
        replies_before = len(_json_lines(server.output()))
        server.popen.stdin.write((json.dumps(request) + "\n").encode())
        server.popen.stdin.flush()
        deadline = time.monotonic() + _RELAY_REPLY_TIMEOUT_S
        while time.monotonic() < deadline:
            replies = _json_lines(server.output())
            if len(replies) > replies_before:
                reply = replies[replies_before]
                if "error" in reply:
                    raise TopologyError(f"the hub relay refused {request}: {reply['error']}")
                host, port = reply["address"]
                return host, int(port)
            if server.poll() is not None:
                break
            time.sleep(0.01)
        raise TopologyError(f"the hub relay server gave no answer; its output:\n{server.output()[-2000:]}")

    def describe(self) -> dict[str, Any]:
        """The running topology as plain data (JSON-able): what child processes need to know."""
        return {
            "hub": {"ns": self.hub_ns, "ip": self.hub_ip},
            "latency": self.latency,
            "hosts": {
                h.name: {"ns": h.ns, "ip": h.ip, **h.spec.model_dump(exclude={"name"})}
                for h in self.hosts.values()
            },
        }


def _json_lines(text: str) -> list[dict[str, Any]]:
    """Complete JSON lines of the relay server's output (a partial last line is skipped)."""
    out = []
    for line in text.splitlines(keepends=True):
        if line.endswith("\n") and line.lstrip().startswith("{"):
            out.append(json.loads(line))
    return out
