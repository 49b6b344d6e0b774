"""Measure a path as an application sees it: goodput of one TCP stream, and round-trip time.

    with Topology(hosts) as topo:
        mbit = goodput_mbit(topo, "learner", "worker1", nbytes=20_000_000)
        rtt = rtt_ms(topo, "worker1", "learner")  # median of small ping-pongs, in ms

Both run real asyncio TCP endpoints inside the hosts' namespaces and connect through
`topo.address()`, so relays (latency) and caps are included. Every endpoint serves one
connection, moves a bounded number of bytes and gives up after `timeout_s`.
The building blocks (`sink`, `send`, `echo`, `ping`) also work on loopback without root.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import TYPE_CHECKING

from .errors import NetemError

if TYPE_CHECKING:
    from .topology import Topology

_BLOCK = 1 << 20
_CONNECT_TRIES = 200  # x 25 ms: the peer's listener may still be starting


async def sink(port: int, host: str = "0.0.0.0", timeout_s: float = 120.0) -> tuple[int, float]:
    """Accept one connection, read to EOF; return (bytes, seconds from first to last byte).

    Replies with the byte count as ASCII before closing, so a sender can confirm delivery.
    """
    done: asyncio.Future[tuple[int, float]] = asyncio.get_running_loop().create_future()

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        n, first = 0, 0.0
        while data := await r.read(_BLOCK):
            first = first or time.perf_counter()
            n += len(data)
        elapsed = time.perf_counter() - first if n else 0.0
        w.write(str(n).encode())
        await w.drain()
        w.close()
        if not done.done():
            done.set_result((n, elapsed))

    server = await asyncio.start_server(serve, host, port, limit=_BLOCK)
    async with server:
        return await asyncio.wait_for(done, timeout_s)


async def _connect(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    for _ in range(_CONNECT_TRIES):
        try:
            return await asyncio.open_connection(host, port, limit=_BLOCK)
        except OSError:
            await asyncio.sleep(0.025)
    raise NetemError(f"could not connect to {host}:{port}: is the listener running there?")


async def send(host: str, port: int, nbytes: int, timeout_s: float = 120.0) -> float:
    """Connect, send `nbytes` zeros, half-close, wait for the receiver's count; return seconds."""

    async def go() -> float:
        r, w = await _connect(host, port)
        start = time.perf_counter()
        block = bytes(_BLOCK)
        left = nbytes
        while left > 0:
            w.write(block[: min(left, _BLOCK)])
            left -= min(left, _BLOCK)
            await w.drain()
        w.write_eof()
        got = int(await r.read() or b"0")
        w.close()
        if got != nbytes:
            raise NetemError(f"receiver got {got} of {nbytes} bytes")
        return time.perf_counter() - start

    return await asyncio.wait_for(go(), timeout_s)


async def echo(port: int, host: str = "0.0.0.0", timeout_s: float = 60.0) -> None:
    """Accept one connection and echo it back until EOF."""
    done = asyncio.get_running_loop().create_future()

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
        w.close()
        if not done.done():
            done.set_result(None)

    server = await asyncio.start_server(serve, host, port)
    async with server:
        await asyncio.wait_for(done, timeout_s)


async def ping(host: str, port: int, count: int = 10, timeout_s: float = 60.0) -> list[float]:
    """Round-trip times (seconds) of `count` one-byte ping-pongs against `echo`."""

    async def go() -> list[float]:
        r, w = await _connect(host, port)
        times = []
        for _ in range(count):
            start = time.perf_counter()
            w.write(b"x")
            await w.drain()
            await r.readexactly(1)
            times.append(time.perf_counter() - start)
        w.write_eof()
        await r.read()
        w.close()
        return times

    return await asyncio.wait_for(go(), timeout_s)


def goodput_mbit(
    topo: Topology, src: str, dst: str, nbytes: int, port: int = 9500, timeout_s: float = 120.0
) -> float:
    """Goodput (Mbit/s, 10^6 bit/s) of one TCP stream src -> dst, measured by the receiver."""
    receiver = topo[dst].call_async(sink, port, timeout_s=timeout_s)
    receiver.wait_listening(port)
    host, p = topo.address(src, dst, port)
    topo[src].call_async(send, host, p, nbytes, timeout_s=timeout_s).result(timeout_s + 10)
    got, seconds = receiver.result(timeout_s + 10)
    return got * 8 / seconds / 1e6


def rtt_ms(
    topo: Topology, src: str, dst: str, count: int = 10, port: int = 9501, timeout_s: float = 60.0
) -> float:
    """Median round-trip time (ms) of small messages src -> dst -> src, through `address()`."""
    server = topo[dst].call_async(echo, port, timeout_s=timeout_s)
    server.wait_listening(port)
    host, p = topo.address(src, dst, port)
    times = topo[src].call_async(ping, host, p, count, timeout_s=timeout_s).result(timeout_s + 10)
    server.result(timeout_s + 10)
    return statistics.median(times) * 1000
