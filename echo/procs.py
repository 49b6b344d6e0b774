"""Child processes that do not outlive their parent (Linux: `prctl(PR_SET_PDEATHSIG)`).

A learner killed with `kill -9` cannot stop what it started: torchrun puts its ranks in their
own sessions and spawned workers keep training on their own. Every process echo starts for
itself (the torchrun launcher, its ranks, local workers) asks the kernel instead to signal it
when its parent dies. Elsewhere than Linux this is a no-op.
"""

from __future__ import annotations

import ctypes
import functools
import os
import resource
import signal

_PR_SET_PDEATHSIG = 1


def _ask_kernel(sig: int, parent: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request was made: act on it now
        os.kill(os.getpid(), sig)


def die_with_parent(sig: int = signal.SIGTERM):
    """A `preexec_fn` for `subprocess.Popen`: the child gets `sig` when this process dies."""
    return functools.partial(_ask_kernel, sig, os.getpid())


def die_with_my_parent(sig: int = signal.SIGTERM) -> None:
    """Ask, for this process, to get `sig` when its current parent dies."""
    _ask_kernel(sig, os.getppid())


def more_files() -> int:
    """Raise this process's soft limit on open files to the hard limit: a learner serving a
    thousand workers holds a few connections each, past the usual soft limit of 1024, and would
    stop accepting anyone (EMFILE). Returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft
