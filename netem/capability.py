"""What this machine can emulate: namespaces, veth, bridges, tc qdiscs, ifb.

    caps = probe()
    if not caps.namespaces:
        pytest.skip(caps.reason)

The probe creates one throw-away namespace of ours, tries each feature inside it and deletes
it again, so it touches nothing outside that namespace. The result is cached per process.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, fields

from . import iproute
from .errors import CapabilityError


@dataclass(frozen=True)
class Capabilities:
    """Which features work here; `reason` says what is missing and what to do ("" if nothing)."""

    root: bool
    iproute2: bool
    netns: bool
    veth: bool
    bridge: bool
    htb: bool
    tbf: bool
    ifb: bool
    netem: bool
    reason: str

    @property
    def namespaces(self) -> bool:
        """True when a shaped star topology (namespaces, veth, bridge, htb) can be built."""
        return self.root and self.iproute2 and self.netns and self.veth and self.bridge and self.htb

    def missing(self) -> list[str]:
        """Names of the features that are not available."""
        return [f.name for f in fields(self) if f.type == "bool" and not getattr(self, f.name)]


def require_namespaces() -> Capabilities:
    """The capabilities, or `CapabilityError` saying why a topology cannot be built here."""
    caps = probe()
    if not caps.namespaces:
        raise CapabilityError(caps.reason)
    return caps


@functools.cache
def probe() -> Capabilities:
    """Try each feature once (in a scratch namespace of ours) and report what works."""
    root = os.geteuid() == 0
    tools = iproute.tools_present()
    if not root or not tools:
        why = []
        if not root:
            why.append("network emulation needs root (run as root or skip the netns tests)")
        if not tools:
            why.append("the iproute2 tools `ip`/`tc` are missing (apt-get install -y iproute2)")
        return Capabilities(root, tools, *([False] * 7), reason="; ".join(why))

    ns = iproute.netns_name("probe", "caps")
    ok: dict[str, bool] = dict.fromkeys(("netns", "veth", "bridge", "htb", "tbf", "ifb", "netem"), False)
    try:
        ok["netns"] = iproute.ip("netns", "add", ns, check=False).returncode == 0
        if ok["netns"]:
            ok["veth"] = _works(
                "ip", "link", "add", "name", "p0", "type", "veth", "peer", "name", "p1", ns=ns
            )
            ok["bridge"] = _works("ip", "link", "add", "name", "br0", "type", "bridge", ns=ns)
            ok["ifb"] = _works("ip", "link", "add", "name", "ifb0", "type", "ifb", ns=ns)
        if ok["veth"]:
            for kind, args in {
                "htb": ("htb", "default", "1"),
                "tbf": ("tbf", "rate", "10mbit", "burst", "32kb", "latency", "50ms"),
                "netem": ("netem", "delay", "10ms"),
            }.items():
                ok[kind] = _works("tc", "qdisc", "replace", "dev", "p0", "root", *args, ns=ns)
    finally:
        if ok["netns"]:
            iproute.netns_delete(ns)

    why = []
    if not ok["netns"]:
        why.append("`ip netns add` failed (no network-namespace support in this kernel/container)")
    else:
        for name, what in (("veth", "veth pairs"), ("bridge", "bridges"), ("htb", "the htb qdisc")):
            if not ok[name]:
                why.append(f"the kernel lacks {what}, needed for a shaped topology")
        if not ok["netem"]:
            why.append("no netem qdisc: latency comes from the userspace delay relay")
    return Capabilities(root, tools, **ok, reason="; ".join(why))


def _works(tool: str, *args: str, ns: str) -> bool:
    run = iproute.ip if tool == "ip" else iproute.tc
    return run(*args, ns=ns, check=False).returncode == 0
