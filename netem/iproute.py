"""Thin wrappers over the `ip` and `tc` tools, and the naming of our namespaces.

Every namespace this package creates is named `echo-netem-<pid>-<...>`, where `<pid>` is the
process that made it. Veth, bridge and ifb devices are only ever created *inside* those
namespaces (never in the root namespace), so deleting a namespace removes everything we made
in it, and `cleanup()` can find leftovers of crashed runs by name alone.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from .errors import CapabilityError, TopologyError

PREFIX = "echo-netem-"
_OURS = re.compile(rf"^{re.escape(PREFIX)}(\d+)-")
_TIMEOUT_S = 30.0  # an ip/tc call never legitimately takes this long


def tools_present() -> bool:
    """True when both `ip` and `tc` (iproute2) are on PATH."""
    return shutil.which("ip") is not None and shutil.which("tc") is not None


def run_tool(argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one iproute2 command; raise `TopologyError` naming the command on failure."""
    if shutil.which(argv[0]) is None:
        raise CapabilityError(
            f"`{argv[0]}` not found: install iproute2 (apt-get install -y iproute2) or skip "
            "the namespace emulation"
        )
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise TopologyError(f"`{' '.join(argv)}` hung for {_TIMEOUT_S:.0f} s") from None
    if check and done.returncode != 0:
        raise TopologyError(f"`{' '.join(argv)}` failed (exit {done.returncode}): {done.stderr.strip()}")
    return done


def ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`ip [-n ns] args...`."""
    return run_tool(["ip", *(["-n", ns] if ns else []), *args], check=check)


def tc(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`tc [-n ns] args...`."""
    return run_tool(["tc", *(["-n", ns] if ns else []), *args], check=check)


def netns_list() -> list[str]:
    """Names of all network namespaces known to `ip netns` (ours and others')."""
    out = ip("netns", "list").stdout
    # Lines look like "name" or "name (id: 3)".
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netns_name(seq: str, role: str) -> str:
    """The namespace name for `role` of this process's topology number `seq`."""
    return f"{PREFIX}{os.getpid()}-{seq}-{role}"


def netns_delete(name: str) -> None:
    """Delete one of our namespaces (and with it every device inside); idempotent."""
    if not _OURS.match(name):
        raise TopologyError(f"refusing to delete namespace {name!r}: it is not one of ours")
    done = ip("netns", "delete", name, check=False)
    if done.returncode != 0 and name in netns_list():
        raise TopologyError(f"could not delete namespace {name}: {done.stderr.strip()}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ours(include_live: bool = False) -> list[str]:
    """Our namespaces: those of dead owner processes, or all of ours with `include_live`."""
    found = []
    for name in netns_list():
        m = _OURS.match(name)
        if m and (include_live or not _alive(int(m.group(1)))):
            found.append(name)
    return found


def cleanup(include_live: bool = False) -> list[str]:
    """Remove namespaces left behind by crashed runs of ours; return the names removed.

    By default only namespaces whose owner process is gone are removed, so a concurrent run
    is never disturbed; `include_live=True` removes every `echo-netem-*` namespace.
    Processes still running inside a namespace are killed first (they are ours: they were
    started inside a namespace only our code creates).
    """
    removed = []
    for name in ours(include_live):
        kill_netns_pids(name)
        netns_delete(name)
        removed.append(name)
    return removed


def kill_netns_pids(name: str) -> None:
    """SIGKILL every process still running inside our namespace `name`, by pid."""
    if not _OURS.match(name):
        raise TopologyError(f"refusing to kill processes in {name!r}: it is not one of ours")
    out = ip("netns", "pids", name, check=False).stdout
    for token in out.split():
        if token.isdigit() and int(token) != os.getpid():
            try:
                os.kill(int(token), 9)
            except ProcessLookupError:
                pass
