"""Wide-area emulation on one machine: shaped namespaces, a delay relay, a userspace shaper.

- `probe()`: what this machine can emulate (root, netns, veth, tc qdiscs, netem), with a reason.
- `Topology([HostSpec(...), ...])`: a star of namespaces with per-host upload/download caps and
  latency (netem where the kernel has it, else `address()` hands out delay relays).
- `DelayRelay`: an asyncio TCP relay adding latency without capping throughput (no root).
- `TokenBucket`: a userspace rate limit for transports where tc is not available.
- `ProcessGroup`: commands and Python callables run inside namespaces, always cleaned up.
- `python -m netem probe | run SCENARIO [-- CMD] | cleanup`.
"""

from .capability import Capabilities, probe, require_namespaces
from .delay import DelayRelay
from .errors import CapabilityError, CommandError, CommandTimeout, NetemError, RemoteCallError, TopologyError
from .iproute import cleanup
from .run import CallHandle, Process, ProcessGroup, Result, run_in
from .shaper import TokenBucket, read_shaped, write_shaped
from .topology import Host, HostSpec, Topology

__all__ = [
    "CallHandle",
    "Capabilities",
    "CapabilityError",
    "CommandError",
    "CommandTimeout",
    "DelayRelay",
    "Host",
    "HostSpec",
    "NetemError",
    "Process",
    "ProcessGroup",
    "RemoteCallError",
    "Result",
    "TokenBucket",
    "Topology",
    "TopologyError",
    "cleanup",
    "probe",
    "read_shaped",
    "require_namespaces",
    "run_in",
    "write_shaped",
]
