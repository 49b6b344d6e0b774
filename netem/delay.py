"""A userspace TCP delay relay: latency for links whose kernel has no `netem` qdisc.

    async with DelayRelay(target=("127.0.0.1", 9000), delay_ms=40) as relay:
        reader, writer = await asyncio.open_connection(*relay.address)  # RTT grows by ~80 ms

Each byte is held `delay_ms` in each direction, measured from when it arrived at the relay.
Bytes wait in a timestamped queue and a separate writer releases them when due, so the relay
adds latency without capping throughput (a sleep per read would cap it at read_size/delay).
The queue is bounded (`max_buffer_bytes`): when it is full the relay stops reading and TCP
flow control pushes back on the sender. To keep a link of rate R busy the buffer must hold
R x delay (5 MB for 1 Gbit/s at 40 ms); the 32 MiB default covers ~6 Gbit/s at 40 ms.

Optional token buckets (`forward`, `backward`) also cap the rate, which makes the relay a
complete rate+latency link emulator that needs no root.

Run standalone: `python -m netem.delay --listen 127.0.0.1:9001 --target 127.0.0.1:9000
--delay-ms 40 [--rate-mbit 200]`, or as a relay server driven by JSON lines on stdin
(`--control`, used by `Topology` inside its hub namespace).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import socket
import struct
import sys
import time
from dataclasses import dataclass

from .shaper import TokenBucket

_READ = 256 * 1024
_CONNECT_TIMEOUT_S = 10.0


@dataclass
class RelayStats:
    """Counters of one relay (read them freely; nothing resets them)."""

    connections: int = 0
    failed_connects: int = 0
    bytes_forward: int = 0
    bytes_backward: int = 0


class DelayRelay:
    """Listen on `listen`, forward every connection to `target`, holding bytes `delay_ms` each way."""

    def __init__(
        self,
        target: tuple[str, int],
        delay_ms: float,
        listen: tuple[str, int] = ("127.0.0.1", 0),
        *,
        max_buffer_bytes: int = 32 * 1024 * 1024,
        forward: TokenBucket | None = None,
        backward: TokenBucket | None = None,
    ) -> None:
        if delay_ms < 0:
            raise ValueError(f"delay_ms must be >= 0, got {delay_ms}")
        if max_buffer_bytes < _READ:
            raise ValueError(f"max_buffer_bytes must be >= {_READ} (one read), got {max_buffer_bytes}")
        self.target = target
        self.delay_s = delay_ms / 1000.0
        self.listen = listen
        self.max_buffer_bytes = max_buffer_bytes
        self.forward, self.backward = forward, backward
        self.stats = RelayStats()
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) clients connect to; valid after `start()`."""
        if self._server is None:
            raise RuntimeError("relay not started: call `await relay.start()` or use `async with`")
        host, port = self._server.sockets[0].getsockname()[:2]
        return host, port

    async def start(self) -> tuple[str, int]:
        """Bind and start accepting; return the bound address."""
        # A 1 MiB stream limit lets each read take a big slice instead of 64 KiB dribbles.
        self._server = await asyncio.start_server(self._accept, *self.listen, limit=1 << 20)
        return self.address

    async def close(self) -> None:
        """Stop listening and cut every relayed connection."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)

    async def __aenter__(self) -> DelayRelay:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            await self._relay(client_r, client_w)
        except asyncio.CancelledError:
            # Only `close()` cancels these; ending quietly keeps asyncio's stream callback
            # from logging the cancellation as an error.
            client_w.close()
        finally:
            self._conns.discard(task)

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.wait_for(
                asyncio.open_connection(*self.target, limit=1 << 20), _CONNECT_TIMEOUT_S
            )
        except (OSError, asyncio.TimeoutError):
            # Reset the client's connection (linger 0 -> RST): the nearest thing to the refusal
            # it would have got directly, so clients fail fast instead of seeing a clean EOF.
            self.stats.failed_connects += 1
            sock = client_w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client_w.close()
            return
        self.stats.connections += 1
        pipes = [
            asyncio.ensure_future(self._pipe(client_r, server_w, self.forward, "bytes_forward")),
            asyncio.ensure_future(self._pipe(server_r, client_w, self.backward, "bytes_backward")),
        ]
        try:
            # Both directions end on EOF (half-close is forwarded); a reset ends both at once.
            await asyncio.wait(pipes, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for pipe in pipes:
                pipe.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)
            for w in (client_w, server_w):
                w.close()

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        bucket: TokenBucket | None,
        counter: str,
    ) -> None:
        """Copy reader -> writer, each chunk released `delay_s` after it was read."""
        queue: collections.deque[tuple[float, bytes]] = collections.deque()
        changed = asyncio.Condition()
        queued = 0  # bytes in `queue`; invariant: queued <= max_buffer_bytes + _READ

        async def take_in() -> None:
            nonlocal queued
            while True:
                async with changed:
                    # Wait for room *before* reading, so the timestamp is the real arrival.
                    while queued >= self.max_buffer_bytes:
                        await changed.wait()
                data = await reader.read(_READ)
                async with changed:
                    queue.append((time.monotonic() + self.delay_s, data))
                    queued += len(data)
                    changed.notify_all()
                if not data:  # EOF travels through the queue like data, delay included
                    return

        async def give_out() -> None:
            nonlocal queued
            while True:
                async with changed:
                    while not queue:
                        await changed.wait()
                    due = queue[0][0]
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                async with changed:
                    now = time.monotonic()
                    batch = []
                    while queue and queue[0][0] <= now:
                        batch.append(queue.popleft()[1])
                    queued -= sum(len(b) for b in batch)
                    changed.notify_all()
                for data in batch:
                    if not data:
                        if writer.can_write_eof():
                            writer.write_eof()
                        return
                    if bucket is not None:
                        await bucket.consume(len(data))
                    writer.write(data)
                    setattr(self.stats, counter, getattr(self.stats, counter) + len(data))
                await writer.drain()

        tasks = [asyncio.ensure_future(take_in()), asyncio.ensure_future(give_out())]
        try:
            # Normally both end: the reader at EOF, the writer after delivering it.
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()  # re-raise a reset so the whole connection ends
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


async def _control(max_buffer_bytes: int) -> None:
    """Serve relays on request: one JSON object per stdin line, one JSON reply per stdout line.

    Request `{"listen": ["10.231.0.254", 0], "target": ["10.231.0.2", 9000], "delay_ms": 40}`,
    reply `{"address": ["10.231.0.254", 40123]}` or `{"error": "..."}`. Ends when stdin closes,
    so relays never outlive the process that asked for them.
    """
    loop = asyncio.get_running_loop()
    relays: list[DelayRelay] = []
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            try:
                req = json.loads(line)
                relay = DelayRelay(
                    (req["target"][0], int(req["target"][1])),
                    float(req["delay_ms"]),
                    (req["listen"][0], int(req["listen"][1])),
                    max_buffer_bytes=max_buffer_bytes,
                )
                reply: dict[str, object] = {"address": list(await relay.start())}
                relays.append(relay)
            except (ValueError, KeyError, TypeError, IndexError, OSError) as e:
                reply = {"error": f"{type(e).__name__}: {e}"}
            print(json.dumps(reply), flush=True)
    finally:
        await asyncio.gather(*(r.close() for r in relays), return_exceptions=True)


async def _standalone(args: argparse.Namespace) -> None:
    buckets = (
        (TokenBucket.mbit(args.rate_mbit), TokenBucket.mbit(args.rate_mbit))
        if args.rate_mbit
        else (None, None)
    )
    relay = DelayRelay(
        args.target,
        args.delay_ms,
        args.listen,
        max_buffer_bytes=args.max_buffer_bytes,
        forward=buckets[0],
        backward=buckets[1],
    )
    async with relay:
        host, port = relay.address
        print(
            f"relaying {host}:{port} -> {args.target[0]}:{args.target[1]} "
            f"holding {args.delay_ms:g} ms each way",
            flush=True,
        )
        await asyncio.Event().wait()  # until interrupted


def main(argv: list[str] | None = None) -> int:
    """`python -m netem.delay`: run one relay, or a relay server driven by stdin (`--control`)."""
    p = argparse.ArgumentParser(prog="python -m netem.delay", description=__doc__.split("\n")[0])
    p.add_argument("--control", action="store_true", help="serve relays requested as JSON lines on stdin")
    p.add_argument("--listen", type=_hostport, default=("127.0.0.1", 0), help="HOST:PORT to listen on")
    p.add_argument("--target", type=_hostport, help="HOST:PORT to forward to")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay added in each direction")
    p.add_argument("--rate-mbit", type=float, default=None, help="also cap each direction (Mbit/s)")
    p.add_argument("--max-buffer-bytes", type=int, default=32 * 1024 * 1024, help="queue bound per direction")
    args = p.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        if args.control:
            asyncio.run(_control(args.max_buffer_bytes))
        elif args.target is None:
            p.error("--target is required (or use --control)")
        else:
            asyncio.run(_standalone(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
