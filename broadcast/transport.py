"""Wire format and stream plumbing shared by every broadcast stream (push and pull alike).

A stream is a sequence of frames over one HTTP body (chunked POST for a push, a streamed GET
response for a pull):

    frame  := u32 big-endian header length | msgpack header | payload
    stream := frame{stream header, no payload} frame{"i": index, "n": length} payload ...

The payload follows its small header as raw bytes: msgpack would copy a bulk payload, and the
receiver reads it straight into its preallocated buffer. Also here: a token bucket (the
userspace shaper used when `tc` is unavailable) and a stall guard (no progress for `timeout`
seconds cancels the transfer, so a silent peer is detected without per-chunk round trips).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import importlib
import ipaddress
import socket
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Iterator, Protocol, TypeVar

import msgpack

from broadcast.manifest import BroadcastError

PREFIX = "/bcast/v1"  # every node's HTTP endpoints (`broadcast.http_transport`)

MAX_HEADER_BYTES = 16 << 20  # a stream header carries the signed manifest (~100 B per chunk)
PIECE = 256 << 10  # read/write granularity: fine enough for smooth shaping and stall checks
#: Write granularity of a paced stream. Each piece leaves at line rate, so it queues at the
#: sender's bottleneck; 256 KiB pieces kept a 50 Mbit/s uplink queue ~40 ms deep, delaying
#: the ACKs of the relay's own download (measured on netem). Small pieces keep it shallow.
PACED_PIECE = 32 << 10

T = TypeVar("T")


class ProtocolError(BroadcastError):
    """A peer sent bytes that do not follow the broadcast wire format (or stopped mid-frame)."""


class Stalled(BroadcastError):
    """A stream made no progress for longer than the stall timeout."""


class Reader(Protocol):
    """What we need from aiohttp's StreamReader (request.content / response.content)."""

    async def read(self, n: int = -1) -> bytes: ...

    async def readexactly(self, n: int) -> bytes: ...


@dataclass(frozen=True)
class Hop:
    """A peer on a route: its id and the base URL of its broadcast server."""

    id: str
    url: str

    def to_wire(self) -> list[str]:
        return [self.id, self.url]

    @classmethod
    def from_wire(cls, raw: Any) -> "Hop":
        if not (isinstance(raw, (list, tuple)) and len(raw) == 2 and all(isinstance(x, str) for x in raw)):
            raise ProtocolError(f"bad hop {raw!r}: expected [id, url]")
        return cls(raw[0], raw[1].rstrip("/"))


def frame_header(obj: dict) -> bytes:
    """Length-prefixed msgpack header of one frame."""
    body = msgpack.packb(obj, use_bin_type=True)
    return len(body).to_bytes(4, "big") + body


async def read_header(reader: Reader, limit: int = MAX_HEADER_BYTES) -> dict:
    """Read one frame header; `ProtocolError` on EOF, oversize or non-map headers."""
    try:
        size = int.from_bytes(await reader.readexactly(4), "big")
        if size > limit:
            raise ProtocolError(f"frame header of {size} B exceeds the {limit} B limit")
        obj = msgpack.unpackb(await reader.readexactly(size), raw=False)
    except asyncio.IncompleteReadError as e:
        raise ProtocolError(f"stream ended before a frame header ({len(e.partial)} B read)") from e
    except (ValueError, msgpack.UnpackException) as e:
        raise ProtocolError(f"frame header is not valid msgpack: {e}") from e
    if not isinstance(obj, dict):
        raise ProtocolError("frame header must be a msgpack map")
    return obj


async def read_into(reader: Reader, view: memoryview, guard: "StallGuard | None" = None,
                    bucket: "TokenBucket | None" = None) -> None:
    """Fill `view` from the stream (one copy, straight into the destination buffer)."""
    pos, n = 0, len(view)
    while pos < n:
        data = await reader.read(min(n - pos, PIECE))
        if not data:
            raise ProtocolError(f"stream ended inside a payload ({pos} of {n} B)")
        view[pos:pos + len(data)] = data
        pos += len(data)
        if guard is not None:
            guard.touch(len(data))
        if bucket is not None:
            await bucket.take(len(data))


def pieces(view: memoryview, size: int = PIECE) -> Iterator[memoryview]:
    for off in range(0, len(view), size):
        yield view[off:off + size]


class TokenBucket:
    """Async token bucket: at most `rate` bytes/s on average, bursts up to `burst` bytes.

    Shared by every stream of a node (one upload cap); the lock makes waiting FIFO, so the
    streams share the rate fairly.
    """

    def __init__(self, rate: float, burst: float | None = None) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be > 0 bytes/s, got {rate}")
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else max(2 * PACED_PIECE, 0.01 * rate))
        self._tokens = self.burst
        self._t = time.monotonic()
        self._lock = asyncio.Lock()

    async def take(self, n: int) -> None:
        async with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._t) * self.rate)
            self._t = now
            self._tokens -= n
            if self._tokens < 0:  # in debt: wait until the debt is repaid
                await asyncio.sleep(-self._tokens / self.rate)


#: A stream planned at a rate (its tree's pace) must move at least this share of it.
FLOOR_SHARE = 1 / 8


class StallGuard:
    """Cancels a transfer that makes no progress for `timeout` seconds, or, given the `pace` it
    was planned at (bytes/s), one that moves less than `FLOOR_SHARE` of it over any
    `2 × timeout` window.

    The floor is what stops a *trickling* peer: one byte every few seconds is progress, so a
    parent that forwards nothing but a trickle would hold its child (and everyone below it)
    on the old version for as long as it liked. Twice the timeout lets a parent that stalled
    and repaired itself catch up before its child gives up on it.

    The transfer calls `touch(nbytes)` whenever bytes move, and wraps waits that are not the
    peer's fault (our own upstream is slower) in `paused()`.
    """

    def __init__(self, timeout: float, pace: float | None = None) -> None:
        self.timeout = timeout
        self.min_rate = FLOOR_SHARE * pace if pace else None
        self._last = time.monotonic()
        self._paused = 0
        self._moved = 0
        self._marks: collections.deque[tuple[float, int]] = collections.deque()  # (when, bytes moved by then)

    def touch(self, nbytes: int = 0) -> None:
        self._last = time.monotonic()
        self._moved += nbytes

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self.touch()
            self._marks.clear()  # a window that held a pause says nothing of the peer's rate

    def _too_slow(self, now: float) -> float | None:
        """The rate over the last window, if it fell below `min_rate`; None otherwise."""
        if self.min_rate is None or self._paused:
            return None
        window = 2 * self.timeout
        self._marks.append((now, self._moved))
        while len(self._marks) > 1 and self._marks[1][0] <= now - window:
            self._marks.popleft()  # keep one mark at least a window old
        t0, moved0 = self._marks[0]
        if now - t0 < window:
            return None
        rate = (self._moved - moved0) / (now - t0)
        return rate if rate < self.min_rate else None

    async def run(self, aw: Awaitable[T]) -> T:
        """Await `aw`; raise `Stalled` (after cancelling it) if it stops making progress."""
        task = asyncio.ensure_future(aw)
        self._marks.clear()
        self._marks.append((time.monotonic(), self._moved))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.timeout / 4)
                if done:
                    return task.result()
                now = time.monotonic()
                stalled = not self._paused and now - self._last > self.timeout
                slow = None if stalled else self._too_slow(now)
                if stalled or slow is not None:
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
                    raise Stalled(f"no progress for {self.timeout:.1f} s" if stalled else
                                  f"{slow / 1e3:.1f} kB/s over {2 * self.timeout:.0f} s, below the floor of "
                                  f"{self.min_rate / 1e3:.1f} kB/s ({FLOOR_SHARE:.3g} of its planned rate)")
        finally:
            if not task.done():
                task.cancel()


# -- transports: how a node reaches a peer, chosen by the peer URL's scheme -------------------------
class Refused(BroadcastError):
    """A peer (or this node) refused a request: `status` is HTTP-like (404 not held, 400 bad)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"{status} {text}")
        self.status, self.text = status, text


NOT_A_TOKEN = "\x00"  # what a bearer value outside printable ASCII reads as: wrong, never equal to a token


def bearer(request: Any) -> str | None:
    """The `Authorization: Bearer` value of an HTTP request, or None. The scheme is any case
    (RFC 7235: `bearer x` was counted as a wrong credential against the sender's address). A value
    with a character outside printable ASCII (no token has one) is `NOT_A_TOKEN`: comparing or
    encoding it raised (a 500 with a traceback, unthrottled), where it is only a wrong token."""
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    value = value.lstrip(" ")
    return value if value.isascii() and value.isprintable() else NOT_A_TOKEN


class PeerError(BroadcastError):
    """A transport failed to carry a stream to or from one peer (dial, negotiation, reset): the
    peer is unreachable or gone, and the node carries on without it."""


class Transport:
    """One way of carrying broadcast streams, client and server half, and its whole lifecycle.

    A node makes one instance per scheme it meets (`Node.transport_for`: `for_node`, then
    `start`), plus, at its own start, the one it advertises (`advertised=True`: it listens
    where the node serves and its `url` is the node's). `stop` ends them with the node. The
    frames are the same on every transport (module docstring); a transport only opens streams
    and hands inbound ones to the node's transport-free core (`Node.accept_push`,
    `Node.serve_pull`, `Node.manifest_wire`).
    """

    schemes: tuple[str, ...] = ()

    @classmethod
    def check_available(cls) -> None:
        """Raise, saying what to install, if this transport cannot run here."""

    @classmethod
    def for_node(cls, node: Any, advertised: bool) -> "Transport":
        """This transport for `node` (not started yet)."""
        raise NotImplementedError

    @classmethod
    async def probe(cls, url: str, timeout_s: float) -> bool:
        """Does a node at `url` accept a connection and answer within `timeout_s` seconds?"""
        raise NotImplementedError

    def routes(self) -> list[Any]:
        """aiohttp routes this transport serves on the node's HTTP server (if any)."""
        return []

    @property
    def url(self) -> str | None:
        """The node's URL on this transport, once started and if it listens; else None."""
        return None

    async def start(self) -> None:
        """Start serving inbound streams (if this transport listens)."""

    async def stop(self) -> None:
        """Close connections and listeners."""

    async def push(self, url: str, body: Any, ticket: str | None = None, audience: str | None = None) -> tuple[int, str]:
        """Send a push stream (`body`: async iterator of bytes) to `url` (node `audience`),
        presenting `ticket` where the transport authenticates by read ticket; (status, reply text)."""
        raise NotImplementedError

    def pull(self, url: str, key: str, start: int, end: int, audience: str | None = None) -> Any:
        """Async context manager: a reader of chunks `start..end-1` of `key` from `url` (node
        `audience`), positioned after the stream header; raises `Refused` if the peer answers with an error."""
        raise NotImplementedError

    async def manifest(self, url: str, key: str) -> bytes | None:
        """The signed manifest wire of `key` held by `url`; None if it does not hold it."""
        raise NotImplementedError

    async def route_feed(self, url: str, after: int, node_id: str) -> dict:
        """One long poll of the learner's route feed at `url` (`broadcast.source`): `{"seq", "items"}`."""
        raise NotImplementedError(f"{type(self).__name__} carries no route feed (it is the learner's HTTP API)")


#: The transport of each URL scheme, imported on first use (py-libp2p stays optional).
SCHEMES = {
    "http": "broadcast.http_transport:HttpTransport",
    "https": "broadcast.http_transport:HttpTransport",
    "p2p": "broadcast.libp2p_transport:Libp2pTransport",
}
#: What a node may advertise (`[worker] relay_transport`, `relay --transport`): the scheme of each.
ADVERTISED = {"aiohttp": "http", "libp2p": "p2p"}
TRANSPORTS = tuple(ADVERTISED)


def scheme_of(url: str) -> str:
    return url.split(":", 1)[0].lower()


def transport_class(scheme: str) -> type[Transport]:
    """The transport registered for `scheme`; `BroadcastError` if none is."""
    if scheme not in SCHEMES:
        raise BroadcastError(f"no transport for {scheme!r} URLs: use http(s):// or p2p:<multiaddr>")
    module, name = SCHEMES[scheme].split(":")
    return getattr(importlib.import_module(module), name)


def check_pull_header(head: dict, key: str, start: int) -> None:
    """A pull stream's first frame: `{"key", "start"}` or `{"error"}` (then `Refused`)."""
    if "error" in head:
        text = str(head["error"])
        status = int(text[:3]) if text[:3].isdigit() else 502
        raise Refused(status, text[4:] if text[:3].isdigit() else text)
    if head.get("start") != start:
        raise ProtocolError(f"asked for {key} chunks from {start}, stream starts at {head.get('start')}")


def http_url(host: str, port: int) -> str:
    """The URL another machine reaches a server bound to `host` at (the learner's join URL, its
    broadcast source's): an IPv6 address in brackets, and for a wildcard bind (0.0.0.0, ::) the
    address this machine reaches the internet from (a URL naming the wildcard reaches nothing
    from another machine)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f"http://{host}:{port}"  # a name
    if ip.is_unspecified:
        ip = ipaddress.ip_address(_outbound_address(ip.version))
    return f"http://[{ip}]:{port}" if ip.version == 6 else f"http://{ip}:{port}"


def local_address_toward(host: str, loopback: str = "127.0.0.1") -> str:
    """The address of this machine's interface on its route to `host` (a name or an IP): the one
    `host` sees it connect from, unless a NAT lies between (a UDP connect sends nothing);
    `loopback` where there is no route or the name does not resolve."""
    try:
        family, _, _, _, target = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(target)
            return s.getsockname()[0]
    except OSError:
        return loopback


def _outbound_address(version: int) -> str:
    """The source address of this machine's route to the internet (documentation addresses:
    nothing is sent); loopback where there is no route."""
    return local_address_toward("2001:db8::1", "::1") if version == 6 else local_address_toward("192.0.2.1")
