"""Typed errors of the emulation harness; each message says what to do about it."""

from __future__ import annotations


class NetemError(RuntimeError):
    """Base of every error raised by `netem`."""


class CapabilityError(NetemError):
    """This machine lacks something the emulation needs (root, iproute2, tc, a qdisc)."""


class TopologyError(NetemError):
    """Bringing a topology up or down failed, or it was used wrongly."""


class CommandError(NetemError):
    """A command run inside a namespace failed; carries its exit status and output."""

    def __init__(self, message: str, returncode: int | None = None, output: str = "") -> None:
        super().__init__(message)
        self.returncode = returncode
        self.output = output


class CommandTimeout(CommandError):
    """A command outlived its time and was stopped."""


class RemoteCallError(NetemError):
    """A Python callable run inside a namespace raised; the message holds its traceback."""
