"""Network addresses as per-address limits count them, for any server that faces workers (the
learner's control API, its broadcast source, a worker's relay).

A rented worker can open as many identities as it likes, but not as many addresses: an IPv4
address, or an IPv6 /64 (what one customer line gets), is the unit every limit counts in. An
IPv6 /48 (one site; a tunnel broker gives one away) holds 65,536 /64s, so it is bounded too.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
from collections.abc import AsyncIterator

UNKNOWN = "unknown"  # a request whose address cannot be parsed counts under one shared key


@functools.lru_cache(maxsize=4096)  # parsed twice per refused credential, a burst of them from one address
def address_key(address: str) -> str:
    """The unit limits count in: the IPv4 address itself, or the /64 an IPv6 address lies in."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return UNKNOWN
    if ip.version == 6:
        if ip.ipv4_mapped is not None:  # ::ffff:a.b.c.d is the IPv4 address a.b.c.d
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def prefix48(address: str) -> str | None:
    """The /48 an IPv6 address lies in, or None (IPv4, IPv4-mapped, not an address)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    if ip.version != 6 or ip.ipv4_mapped is not None:
        return None
    return str(ipaddress.ip_network(f"{ip}/48", strict=False))


def in_networks(address: str, networks: list) -> bool:
    """Whether `address` lies in one of `networks` (`ipaddress` networks); not an address: no."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in net for net in networks)


def connection_limits(limit: int, trusted: list, per_48: int = 8):
    """Connection limits (`broadcast.node.ConnectionCap`: the control API's, the broadcast
    source's, a relay's): `limit` per address (an IPv6 /64), `per_48` times that per IPv6 /48
    (its 65,536 /64s would hold 65,536 times as many); a trusted proxy, which speaks for many
    workers, is not counted."""
    def limits(host: str) -> tuple[tuple[str, int], ...]:
        if in_networks(host, trusted):
            return ()
        wide = prefix48(host)
        return ((address_key(host), limit),) if wide is None else ((address_key(host), limit), (wide, limit * per_48))
    return limits


class NoTurn(Exception):
    """An address's streams were all busy for as long as a request may wait (`StreamGate.hold`)."""


class StreamGate:
    """At most `per_address` weight streams at once from one address (`address_key`); the rest
    wait their turn, at most `wait_s`. Sixteen identities at one address, each allowed a few
    copies of a version, took 64 of the uplink's fair shares at once from every other worker;
    honest workers behind one NAT share that address's downlink anyway, so taking turns costs
    them little."""

    def __init__(self, per_address: int, wait_s: float):
        self.per_address, self.wait_s = per_address, wait_s
        self._gates: dict[str, tuple[asyncio.Semaphore, list[int]]] = {}  # key -> (its slots, [holders + waiters])

    @contextlib.asynccontextmanager
    async def hold(self, address: str) -> AsyncIterator[None]:
        """A turn for `address`'s stream; `NoTurn` after `wait_s` without one."""
        key = address_key(address)
        slots, users = self._gates.setdefault(key, (asyncio.Semaphore(self.per_address), [0]))
        users[0] += 1
        try:
            try:
                async with asyncio.timeout(self.wait_s):
                    await slots.acquire()
            except TimeoutError:
                raise NoTurn(f"{self.per_address} streams to this address were busy for {self.wait_s:g} s") from None
            try:
                yield
            finally:
                slots.release()
        finally:
            users[0] -= 1
            if not users[0]:
                del self._gates[key]  # nothing kept for an address with no stream
