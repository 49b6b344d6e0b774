"""py-libp2p streams for relay links, driven from asyncio (optional extra: `pip install echo-rl[p2p]`).

Why libp2p at all: identity and reachability, not speed. A node's peer ID is derived from an
ed25519 key — the learner's is the key that signs manifests, so a worker that holds the
learner's public key text knows the learner's peer ID too (`peer_id`) and noise authenticates
it; libp2p also brings relays and hole punching for workers behind NAT. Bulk bytes stay the same
frames as over HTTP (`broadcast.transport`: u32 length + msgpack header, raw payload), verified
chunk by chunk against the signed manifest, so a libp2p link is as safe as an aiohttp one.

How the relay uses it (`broadcast.relay.Node(transport="libp2p")`): a node advertises the hop
URL `p2p:<multiaddr>` (`p2p_url`, e.g. `p2p:/ip4/10.0.0.2/tcp/4001/p2p/12D3KooW...`); a sender
picks the transport from the scheme of its peer's URL, so aiohttp and libp2p nodes mix in one
chain. Three protocols, each one stream per exchange:
- `PUSH_PROTOCOL`: exactly the body of `POST /bcast/v1/push` (stream header with the signed
  manifest and route, then chunk frames), half-closed by the sender; the receiver answers one
  frame `{"status": <HTTP-like code>, "text": ...}` — possibly early (409, rejections), so the
  sender reads while it writes and stops once answered.
- `PULL_PROTOCOL`: the client sends `{"key", "from"}` and half-closes; the answer is the body of
  `GET /bcast/v1/chunks/{key}?from=k` (`{"key", "start"}` then chunk frames), or `{"error"}`.
- `MANIFEST_PROTOCOL`: `{"key"}` -> `{"manifest": signed wire}` or `{"error"}` (late joiners).

How it is bridged: py-libp2p runs on trio, echo on asyncio. A `Libp2pHost` runs trio in its own
thread; calls cross with `run_sync_soon` (asyncio -> trio) and `call_soon_threadsafe`
(trio -> asyncio). A `Libp2pStream` is what asyncio code sees: `read`/`readexactly` (so
`read_header` and `read_into` work unchanged), `write`, `close`, `reset`/`abort`.

The yamux stall limit: py-libp2p's yamux *writer* gives up on a stream when the reader's window
stays closed for 5 s ("Timed out waiting for window update"); it is the only timer on a stream
(an idle stream with an open window never times out). What that means for relay links:
- Receiving side. Each inbound stream has a pump in trio that keeps reading into a bounded
  buffer (`buffer_bytes`, 16 MiB by default) whatever the asyncio consumer does, and yamux
  credits the window on every read; so a consumer may pause for `buffer_bytes / rate` + 5 s
  before its sender gives up. The relay's receiver never pauses (it writes into the version's
  buffer; forwarding reads from there at its own pace). It only reads slower than its sender
  writes under a `down_rate` cap, and then the window reopens with every 256 KiB it consumes:
  the limit is reached only below ~50 kB/s (256 KiB per 5 s; measured: a 30 kB/s reader had
  its sender reset after 5 s, a 120 kB/s one ran 40 s without). A slow *network* never hits
  it: the pump reads each frame as it arrives, and every read credits the window.
- Sending side. A relay's push stream to its child sits idle while the relay waits for its own
  upstream (its stall guard is paused then, as over HTTP): no write is pending, so no window
  wait runs, and an idle stream is never reset — checked with a 7 s gap between chunks. A
  write only waits for the window once the child's pump buffer and window are full (the
  child is wedged, or capped below the floor above). Whichever fires first then ends the push
  as a broken stream (status 0): yamux's 5 s (the write fails) or the stall guard
  (`stall_timeout`; it resets the stream, which also ends the write pending in trio). The
  sender routes around that child, and the child, if alive, repairs by pulling. So over libp2p
  a sender's stall limit for a wedged child is min(5 s, stall_timeout), once its buffers are full.
- Cancelling the asyncio side of a call does not cancel its trio side: a write stuck on the
  window keeps waiting in trio until the stream is reset (`abort()`) or yamux's 5 s expire.

Cancellation and py-libp2p 0.8.1 (found making relay tests repeatable):
- A trio task cancelled inside a connection write (yamux sends window updates from within
  `read`) can leave noise's nonce one ahead of what was sent: the peer fails to decrypt the
  next frame and drops the connection, with every stream on it. Pumps therefore read under a
  cancellation shield and end with their stream (EOF, reset); an inbound stream's pump drains
  the peer's leftovers after its handler returns (`_drain`) instead of being cancelled.
- A read parked on a stream that was reset locally is never woken, and neither is one on a
  connection the peer closed unless py-libp2p cancels its handler: `abort()` stops its pump
  after the reset, `_inbound` stops its pump when cancelled, and `stop()` resets every open
  stream before ending the pumps, so peers learn at once rather than by their stall guard.

Other limits (py-libp2p 0.8.1): a host listens on an IP literal (`/ip4` or `/ip6`, no DNS
names). The first stream to a peer costs ~0.25 s on loopback (connection setup); later ones
reuse the connection (~4 ms), and so does a peer restarted elsewhere under the same key until
the old connection closes. A push's `from` is not checked against the stream's (noise-proven)
peer ID: as over HTTP, the signed route and chunk hashes are what is trusted. The trio thread
competes for the GIL with the asyncio loop: a libp2p link costs more CPU than an aiohttp one
(`broadcast.bench.transports`, the loopback benchmark, measures both).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from cryptography.hazmat.primitives import serialization

from broadcast.manifest import BroadcastError, Buffer
from broadcast.signing import SigningKey, VerifyKey
from broadcast.transport import (
    PIECE,
    PeerError,
    ProtocolError,
    Refused,
    Transport,
    check_pull_header,
    frame_header,
    read_header,
)

log = logging.getLogger("echo.broadcast.libp2p")
# py-libp2p logs each peer's failed handshake and reset stream at INFO: a peer's to trigger, 34
# lines a minute from one silent fake relay in the learner's log. Our own lines say what matters.
logging.getLogger("libp2p").setLevel(logging.WARNING)


def _not_a_failed_dial(record: logging.LogRecord) -> bool:
    """py-libp2p logs a dial that fails at ERROR, then raises it, which we answer (a push to
    that peer fails, its event says so): a fleet of relays that listen on nothing made a line
    each per version, ~90 a second at a thousand identities."""
    return not str(record.msg).startswith(("Failed to open TCP stream", "Unexpected error opening TCP stream"))


logging.getLogger("libp2p.transport.tcp.tcp").addFilter(_not_a_failed_dial)
PUSH_PROTOCOL = "/echo/bcast/push/1.0.0"
PULL_PROTOCOL = "/echo/bcast/pull/1.0.0"
MANIFEST_PROTOCOL = "/echo/bcast/manifest/1.0.0"
P2P_SCHEME = "p2p:"  # a hop URL "p2p:<multiaddr ending in /p2p/<peer id>>"
DEFAULT_BUFFER_BYTES = 16 << 20


def is_p2p(url: str) -> bool:
    """Whether a hop URL names a libp2p peer (else it is an aiohttp base URL)."""
    return url.startswith(P2P_SCHEME)


def p2p_url(multiaddr: str) -> str:
    return P2P_SCHEME + multiaddr


def p2p_addr(url: str) -> str:
    """The multiaddr of a `p2p:` hop URL."""
    if not is_p2p(url):
        raise ValueError(f"not a libp2p hop URL: {url!r}")
    return url[len(P2P_SCHEME):]


def listen_addr(host: str, port: int = 0) -> str:
    """The listening multiaddr of an IP literal (`/ip4/...` or `/ip6/...`)."""
    ip = ipaddress.ip_address(host)  # ValueError for host names: libp2p listens on IPs
    return f"/ip{ip.version}/{ip}/tcp/{port}"


class Libp2pError(PeerError):
    """A libp2p host or stream failed (dial, negotiation, reset); the message says which."""


class Libp2pUnavailable(Libp2pError):
    """py-libp2p is not installed; install the extra (`pip install 'echo-rl[p2p]'`) or use aiohttp.
    (A `Libp2pError`: to a node, a `p2p:` peer it cannot dial is an unreachable peer.)"""


def _libp2p() -> Any:
    try:
        import libp2p
    except ImportError as e:
        raise Libp2pUnavailable(f"py-libp2p is not importable ({e}); `pip install 'libp2p>=0.2'` "
                                "or keep the default aiohttp transport") from e
    return libp2p


def available() -> str | None:
    """The installed py-libp2p version, or None."""
    try:
        _libp2p()
    except Libp2pUnavailable:
        return None
    from importlib.metadata import version

    return version("libp2p")


# -- identity ------------------------------------------------------------------------------------
def _raw_private(key: SigningKey | bytes) -> bytes:
    if isinstance(key, (bytes, bytearray)):
        if len(key) != 32:
            raise ValueError(f"an ed25519 seed is 32 bytes, got {len(key)}")
        return bytes(key)
    return key._key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                  serialization.NoEncryption())


def _raw_public(key: SigningKey | VerifyKey | bytes) -> bytes:
    if isinstance(key, SigningKey):
        key = key.public_key()
    if isinstance(key, VerifyKey):
        return key._key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    if len(key) != 32:
        raise ValueError(f"an ed25519 public key is 32 bytes, got {len(key)}")
    return bytes(key)


def key_pair(key: SigningKey | bytes) -> Any:
    """The libp2p `KeyPair` of an echo ed25519 key (a `SigningKey` or its 32-byte seed)."""
    _libp2p()
    from libp2p.crypto.ed25519 import create_new_key_pair

    return create_new_key_pair(_raw_private(key))


def peer_id(key: SigningKey | VerifyKey | bytes) -> str:
    """The libp2p peer ID ("12D3KooW...") of an ed25519 key; public keys suffice.

    A worker computes the learner's peer ID from the public key text it was given at join.
    """
    _libp2p()
    from libp2p.crypto.ed25519 import Ed25519PublicKey
    from libp2p.peer.id import ID

    return ID.from_pubkey(Ed25519PublicKey.from_bytes(_raw_public(key))).to_base58()


# -- the stream, as asyncio sees it --------------------------------------------------------------
class Libp2pStream:
    """One libp2p stream: `read`/`readexactly` (a `broadcast.transport.Reader`), `write`, `close`.

    Inbound bytes are pumped by a trio task into a buffer of at most `buffer_bytes` (see the
    module docstring for why the pump never waits on the consumer until that fills).
    """

    def __init__(self, host: Libp2pHost, stream: Any, buffer_bytes: int) -> None:
        self._host = host
        self._stream = stream
        self._limit = buffer_bytes
        self.remote_peer = str(getattr(stream.muxed_conn, "peer_id", ""))
        self.protocol = str(stream.get_protocol())
        # asyncio side (only touched on the asyncio loop)
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._eof = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._released = 0  # consumed bytes not yet reported to the pump
        self.bytes_read = 0
        # trio side
        self._room: Any = None  # trio.Event, set when the consumer frees space (or on stop)
        self._in_pump = 0  # bytes delivered and not yet reported consumed
        self._discard = False  # nobody reads any more: drain the peer's bytes until it ends
        self._stopped = False
        self._read_scope: Any = None  # trio.CancelScope of the read in progress
        self._ended: Any = None  # trio.Event, set when the pump returns

    # -- trio side ---------------------------------------------------------------------------
    async def _pump(self) -> None:
        """Read the stream into the asyncio-side buffer until EOF, reset, error or `_stop()`.

        The read is shielded from cancellation: py-libp2p's yamux sends a window update from
        inside `read`, and a cancellation that cuts that write after noise has encrypted the
        frame desynchronises the connection's nonces — the peer fails to decrypt and drops the
        connection, with every stream on it (seen when handlers cancelled their pumps). So a
        pump ends when its stream does; `_stop` lifts the shield only where that is safe.
        """
        import trio
        from libp2p.network.stream.exceptions import StreamEOF

        self._ended = trio.Event()
        self._host._pumps.add(self)
        error: BaseException | None = None
        try:
            while True:
                while self._in_pump >= self._limit and not (self._discard or self._stopped):
                    self._room = trio.Event()
                    await self._room.wait()
                if self._stopped:
                    break
                with trio.CancelScope(shield=True) as self._read_scope:
                    data = await self._stream.read(PIECE)
                if self._read_scope.cancelled_caught or not data:
                    break
                if not self._discard:
                    self._in_pump += len(data)
                    self._host._to_asyncio(self._feed, data)
        except StreamEOF:
            pass
        except Exception as e:  # noqa: BLE001 - delivered to the reader as a typed error
            error = Libp2pError(f"stream from {self.remote_peer} broke: {type(e).__name__}: {e}")
        except BaseException:  # cancelled: the host is stopping; a waiting reader must not hang
            error = Libp2pError(f"stream from {self.remote_peer} closed: host stopped")
            raise
        finally:
            self._host._pumps.discard(self)
            self._ended.set()
            if error is None and self._stopped:
                error = Libp2pError(f"stream from {self.remote_peer} was aborted")
            self._host._to_asyncio(*((self._fail, error) if error is not None else (self._feed, b"")))

    def _stop(self) -> None:
        """End the pump now (trio side). Only safe while its read is parked, waiting for bytes
        that will never come — not while it may be writing a window update (see `_pump`)."""
        self._stopped = True
        if self._room is not None:
            self._room.set()
        if self._read_scope is not None:
            self._read_scope.shield = False
            self._read_scope.cancel()

    async def _abort(self) -> None:
        """Reset the stream, then end the pump (trio side).

        py-libp2p does not wake a read parked on a stream it resets locally; a read that was
        not parked ends by itself (the reset makes its next read fail) well within a second,
        so a pump still running after that is parked, and safe to stop.
        """
        import trio

        with contextlib.suppress(Exception):
            await self._stream.reset()
        if self._ended is not None:
            with trio.move_on_after(1.0):
                await self._ended.wait()
        self._stop()

    async def _drain(self, linger: float) -> None:
        """After the handler of an inbound stream returned (trio side): half-close, and read
        (dropping) whatever the peer still sends until it closes or resets its side, so the
        pump ends on its own; a peer still at it after `linger` seconds is reset."""
        import trio

        self._discard = True
        if self._room is not None:
            self._room.set()
        with contextlib.suppress(Exception):
            await self._stream.close_write()
        if self._ended is not None:
            with trio.move_on_after(linger):
                await self._ended.wait()
            if not self._ended.is_set():
                await self._abort()

    def _consumed(self, n: int) -> None:
        self._in_pump -= n
        if self._room is not None and self._in_pump < self._limit:
            self._room.set()

    # -- asyncio side ------------------------------------------------------------------------
    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _feed(self, data: bytes) -> None:
        if data:
            self._chunks.append(data)
            self._buffered += len(data)
        else:
            self._eof = True
        self._wake()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._wake()

    def _take(self, n: int) -> bytes:
        if len(self._chunks[0]) <= n:  # the common case: a whole delivered piece, no copy
            out: bytes | bytearray = self._chunks.popleft()
        else:
            out = bytearray()
            while self._chunks and len(out) < n:
                head = self._chunks[0]
                need = n - len(out)
                if len(head) <= need:
                    out += self._chunks.popleft()
                else:
                    out += head[:need]
                    self._chunks[0] = head[need:]
        self._buffered -= len(out)
        self.bytes_read += len(out)
        self._released += len(out)
        # Report consumption in small batches: yamux credits the sender per read, and a sender
        # waits at most 5 s for credit (see the module docstring).
        if self._released >= min(self._limit // 4, PIECE) or not self._buffered:
            released, self._released = self._released, 0
            self._host._to_trio(self._consumed, released)
        return bytes(out) if isinstance(out, bytearray) else out

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def read(self, n: int = -1) -> bytes:
        """Up to `n` bytes (at least one), or b"" at the end of the stream."""
        while not self._buffered:
            if self._error is not None:
                raise self._error
            if self._eof:
                return b""
            await self._wait()
        return self._take(self._buffered if n < 0 else n)

    async def readexactly(self, n: int) -> bytes:
        """Exactly `n` bytes; `asyncio.IncompleteReadError` if the stream ends first.

        Takes what has arrived as it goes (never waits for `n` bytes to be buffered at once),
        so `n` may exceed the pump's buffer bound.
        """
        out = bytearray()
        while len(out) < n:
            data = await self.read(n - len(out))
            if not data:
                raise asyncio.IncompleteReadError(bytes(out), n)
            out += data
        return bytes(out)

    async def write(self, data: Buffer) -> None:
        """Send `data`; returns once libp2p has taken it (back-pressure from the yamux window)."""
        await self._host._call(self._stream.write, bytes(data) if not isinstance(data, bytes) else data)

    async def close(self) -> None:
        """Half-close: the peer reads EOF; replies can still be read."""
        await self._host._call(self._stream.close_write)

    async def reset(self) -> None:
        """Abort both directions."""
        await self._host._call(self._stream.reset)

    def abort(self) -> None:
        """Reset without waiting (safe in `finally` and after cancellation): the peer's reads and
        writes fail, a write of ours stuck on the window gives up, and a read here ends."""
        with contextlib.suppress(Libp2pError):
            self._host._to_trio(lambda: self._host._nursery.start_soon(self._abort))


# -- the host ----------------------------------------------------------------------------------
StreamHandler = Callable[[Libp2pStream], Awaitable[None]]


class Libp2pHost:
    """A py-libp2p host on its own trio thread, used from asyncio.

        host = Libp2pHost(SigningKey.generate())
        addrs = await host.start()            # ["/ip4/127.0.0.1/tcp/4001/p2p/12D3KooW..."]
        host.set_handler(PUSH_PROTOCOL, on_stream)   # async def on_stream(stream): ...
        stream = await other.open_stream(addrs[0], PUSH_PROTOCOL)

    `security`: "noise" (libp2p's default: encrypted, and the peer proves its key) or
    "plaintext" (peer IDs are exchanged but not proven; chunks are still verified against the
    signed manifest). Listens on `listen` (loopback by default).
    """

    def __init__(self, key: SigningKey | bytes, *, listen: str = "/ip4/127.0.0.1/tcp/0",
                 security: str = "noise", buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> None:
        _libp2p()
        if security not in ("noise", "plaintext"):
            raise ValueError(f"security must be 'noise' or 'plaintext', got {security!r}")
        self._key_pair = key_pair(key)
        self.peer_id = peer_id(_raw_public(self._key_pair.public_key.to_bytes()))
        self.listen, self.security, self.buffer_bytes = listen, security, buffer_bytes
        self.addrs: list[str] = []
        self._handlers: dict[str, StreamHandler] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._token: Any = None
        self._nursery: Any = None
        self._host: Any = None
        self._stop: Any = None  # trio.Event
        self._pumps: set[Libp2pStream] = set()  # running pumps (trio side), stopped with the host

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> list[str]:
        """Start the trio thread and listen; returns the full multiaddrs (with /p2p/<id>)."""
        self._loop = asyncio.get_running_loop()
        ready: asyncio.Future = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=f"libp2p-{self.peer_id[-6:]}",
                                        daemon=True)
        self._thread.start()
        self.addrs = await ready
        return self.addrs

    async def stop(self) -> None:
        """Close every connection and end the trio thread."""
        if self._thread is None:
            return
        try:
            self._to_trio(lambda: self._stop.set())
        except Libp2pError:
            pass  # already finished
        await asyncio.to_thread(self._thread.join, 10)
        self._thread = None

    async def __aenter__(self) -> Libp2pHost:  # noqa: PYI034 - Self needs Python 3.11
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _run(self, ready: asyncio.Future) -> None:
        import trio

        def resolve(fut: asyncio.Future, value: Any = None, error: BaseException | None = None) -> None:
            if not fut.done():
                fut.set_exception(error) if error is not None else fut.set_result(value)

        try:
            trio.run(self._main, ready)
        except BaseException as e:  # noqa: BLE001 - reported to whoever awaits start()
            assert self._loop is not None
            if not self._loop.is_closed():
                self._loop.call_soon_threadsafe(resolve, ready, None,
                                                Libp2pError(f"libp2p host failed: {type(e).__name__}: {e}"))

    async def _main(self, ready: asyncio.Future) -> None:
        import multiaddr
        import trio
        from libp2p import new_host

        kp = self._key_pair
        if self.security == "noise":
            from libp2p.crypto.x25519 import create_new_key_pair as x25519
            from libp2p.security.noise.transport import PROTOCOL_ID, Transport

            sec = {PROTOCOL_ID: Transport(kp, x25519().private_key)}
        else:
            from libp2p.security.insecure.transport import (
                PLAINTEXT_PROTOCOL_ID,
                InsecureTransport,
            )

            sec = {PLAINTEXT_PROTOCOL_ID: InsecureTransport(kp)}
        self._host = new_host(key_pair=kp, sec_opt=sec)
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        for protocol in self._handlers:
            self._host.set_stream_handler(protocol, self._inbound)
        async with self._host.run([multiaddr.Multiaddr(self.listen)]), trio.open_nursery() as nursery:
            self._nursery = nursery
            addrs = [str(a) for a in self._host.get_addrs()]
            self._to_asyncio(lambda: ready.done() or ready.set_result(addrs))
            await self._stop.wait()
            # Reset every open stream first, so peers learn at once (reads parked on a closing
            # connection are not always woken); then end the pumps: a torn frame is moot now.
            with trio.move_on_after(1.0):
                for pump in list(self._pumps):
                    with contextlib.suppress(Exception):
                        await pump._stream.reset()
            for pump in list(self._pumps):
                pump._stop()
            nursery.cancel_scope.cancel()

    # -- crossing between the loops --------------------------------------------------------------
    def _to_asyncio(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._loop is not None
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    def _to_trio(self, fn: Callable[..., Any], *args: Any) -> None:
        import trio

        if self._token is None:
            raise Libp2pError("the libp2p host is not running: await start() first")
        try:
            self._token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            raise Libp2pError("the libp2p host has stopped") from None

    async def _call(self, async_fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run `async_fn(*args)` in the trio thread; await its result here."""
        assert self._loop is not None
        fut: asyncio.Future = self._loop.create_future()

        def settle(value: Any, error: BaseException | None) -> None:
            if not fut.done():
                fut.set_exception(error) if error is not None else fut.set_result(value)

        async def run() -> None:
            try:
                value = await async_fn(*args)
            except Exception as e:  # noqa: BLE001 - re-raised on the asyncio side
                self._to_asyncio(settle, None, e if isinstance(e, BroadcastError) else
                                 Libp2pError(f"{getattr(async_fn, '__name__', 'call')}: {type(e).__name__}: {e}"))
            except BaseException:  # cancelled: the host is stopping; the caller must not hang
                self._to_asyncio(settle, None, Libp2pError("the libp2p host stopped"))
                raise
            else:
                self._to_asyncio(settle, value, None)

        self._to_trio(lambda: self._nursery.start_soon(run))
        return await fut

    # -- streams -------------------------------------------------------------------------------
    def set_handler(self, protocol: str, handler: StreamHandler) -> None:
        """Serve inbound streams of `protocol` with `handler` (a coroutine run on this asyncio
        loop); the stream is closed when it returns. Set handlers before or after start()."""
        self._handlers[protocol] = handler
        if self._host is not None:
            self._to_trio(self._host.set_stream_handler, protocol, self._inbound)

    async def _inbound(self, stream: Any) -> None:
        import trio

        handler = self._handlers.get(str(stream.get_protocol()))
        if handler is None or self._loop is None:
            await stream.reset()
            return
        wrapped = Libp2pStream(self, stream, self.buffer_bytes)
        done = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wrapped._pump)
            fut = asyncio.run_coroutine_threadsafe(handler(wrapped), self._loop)

            def finished(f: Any) -> None:  # runs on the asyncio thread
                if not f.cancelled() and f.exception() is not None:
                    log.warning("handler for %s from %s failed: %r", wrapped.protocol, wrapped.remote_peer,
                                f.exception())
                with contextlib.suppress(Exception):  # trio may have finished already
                    self._token.run_sync_soon(done.set)

            fut.add_done_callback(finished)
            try:
                await done.wait()
                # Not nursery.cancel_scope.cancel(): the pump must end with the stream (see _pump).
                await wrapped._drain(linger=10.0)
            except BaseException:
                # Cancelled: py-libp2p is closing the connection (that is how a read learns the
                # peer is gone) or the host stops; a torn frame no longer matters.
                wrapped._stop()
                raise
        with contextlib.suppress(Exception):  # the peer may be gone already
            await stream.close()

    async def open_stream(self, addr: str, protocol: str, timeout: float | None = None) -> Libp2pStream:
        """Dial `addr` (a multiaddr ending in /p2p/<peer id>) and open a `protocol` stream,
        within `timeout` seconds (connect and protocol negotiation together)."""

        async def dial() -> Libp2pStream:
            import multiaddr
            import trio
            from libp2p.peer.peerinfo import info_from_p2p_addr

            info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
            # The timeout runs in trio (cancelling the asyncio side would leave the dial running),
            # and covers the connection only: cutting a stream's negotiation on an established
            # connection could tear that connection's framing (see _pump); py-libp2p times
            # negotiation out by itself.
            with trio.fail_after(timeout) if timeout else contextlib.nullcontext():
                await self._host.connect(info)
            stream = await self._host.new_stream(info.peer_id, [protocol])
            wrapped = Libp2pStream(self, stream, self.buffer_bytes)
            self._nursery.start_soon(wrapped._pump)
            return wrapped

        return await self._call(dial)


# -- the transport of `p2p:` peers (`broadcast.transport.Transport`) ------------------------------------
def url_peer_id(url: str) -> str | None:
    """The peer ID a `p2p:` hop URL names (its `/p2p/<id>` part); None for other URLs."""
    if not is_p2p(url) or "/p2p/" not in url:
        return None
    return url.rsplit("/p2p/", 1)[1].split("/")[0] or None


class Libp2pTransport(Transport):
    """Push, pull and manifest streams over py-libp2p, one protocol each, the same frames as HTTP.

    Its host is started with the node when the node advertises `p2p:` (`listen` on its address),
    else on the first stream to a `p2p:` peer (then on loopback only: it is not advertised).
    `for_node` takes the node's `p2p_key`, `p2p_port`, `host` and `connect_timeout`.
    Inbound pushes are authenticated: noise proves the remote peer ID, and it must be the one
    the signed route binds to the sender the stream names (`Node.accept_push`).
    """

    schemes = ("p2p",)

    def __init__(self, node: Any, key: SigningKey, listen: str, connect_timeout: float,
                 advertised: bool = False) -> None:
        self.check_available()
        self.node, self.key, self.listen, self.connect_timeout = node, key, listen, connect_timeout
        self.advertised = advertised
        self.host: Libp2pHost | None = None
        self._lock = asyncio.Lock()
        self._serving: set[asyncio.Task] = set()  # inbound streams being served (cancelled by stop)

    @classmethod
    def check_available(cls) -> None:
        if available() is None:
            raise Libp2pUnavailable("p2p: peers and transport='libp2p' need py-libp2p: pip install 'echo-rl[p2p]'")

    @classmethod
    def for_node(cls, node: Any, advertised: bool) -> "Libp2pTransport":
        # The node's identity (a fresh key if it has none). Advertised: listen where the node
        # serves; only dialling out: on loopback, not advertised.
        listen = listen_addr(node.host, node.p2p_port) if advertised else listen_addr("127.0.0.1")
        return cls(node, node.p2p_key or SigningKey.generate(), listen, node.connect_timeout, advertised)

    @classmethod
    async def probe(cls, url: str, timeout_s: float) -> bool:
        # On a thread with its own event loop: importing py-libp2p and setting up a host hold
        # a loop for most of a second, and the caller's is the learner's.
        return await asyncio.wait_for(asyncio.to_thread(lambda: asyncio.run(_probe(url, timeout_s))),
                                      timeout_s + 10.0)

    @property
    def url(self) -> str | None:
        return p2p_url(self.host.addrs[0]) if self.advertised and self.host is not None else None

    async def start(self) -> None:
        await self._host()

    async def stop(self) -> None:
        for task in list(self._serving):
            task.cancel()
        if self.host is not None:
            await self.host.stop()
            self.host = None

    async def _host(self) -> Libp2pHost:
        async with self._lock:
            if self.host is None:
                # Importing py-libp2p and deriving the key pair take ~0.5 s: not on the event loop
                # (a learner makes its first libp2p host at its first push to a p2p: relay).
                host = await asyncio.to_thread(lambda: Libp2pHost(self.key, listen=self.listen))
                for protocol, handler in ((PUSH_PROTOCOL, self._serve_push), (PULL_PROTOCOL, self._serve_pull),
                                          (MANIFEST_PROTOCOL, self._serve_manifest)):
                    host.set_handler(protocol, self._tracked(handler))
                await host.start()
                self.host = host
            return self.host

    async def _open(self, url: str, protocol: str) -> Libp2pStream:
        return await (await self._host()).open_stream(p2p_addr(url), protocol, timeout=self.connect_timeout)

    def _tracked(self, handler: StreamHandler) -> StreamHandler:
        async def serve(stream: Libp2pStream) -> None:
            task = asyncio.current_task()
            assert task is not None
            self._serving.add(task)
            try:
                await handler(stream)
            finally:
                self._serving.discard(task)

        return serve

    # -- client half -----------------------------------------------------------------------------
    async def push(self, url: str, body: Any, ticket: str | None = None, audience: str | None = None) -> tuple[int, str]:
        """Write the body, half-close, read the one reply frame. The reply is read while writing,
        as aiohttp does: a child that already has the version (409) or refuses the stream answers
        at once, and the rest of the body is not sent."""
        stream = await self._open(url, PUSH_PROTOCOL)

        async def send() -> None:
            async for piece in body:
                await stream.write(piece)
            await stream.close()  # half-close: the child reads EOF, we still read its reply

        sending = asyncio.ensure_future(send())
        sending.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no warning
        replied = asyncio.ensure_future(read_header(stream))
        clean = False
        try:
            await asyncio.wait({sending, replied}, return_when=asyncio.FIRST_COMPLETED)
            if not replied.done():
                sending.result()  # sending failed: raise why (the reply may never come)
            reply = await replied
            clean = sending.done() and not sending.cancelled() and sending.exception() is None
            try:
                return int(reply["status"]), str(reply.get("text", ""))[:300]
            except (KeyError, TypeError, ValueError) as e:
                raise ProtocolError(f"bad push reply {reply!r}") from e
        finally:
            sending.cancel()
            replied.cancel()
            if not clean:  # answered early, failed or cancelled: stop both directions now
                stream.abort()

    @contextlib.asynccontextmanager
    async def pull(self, url: str, key: str, start: int, end: int, audience: str | None = None) -> Any:
        stream = await self._open(url, PULL_PROTOCOL)
        finished = False
        try:
            await stream.write(frame_header({"key": key, "from": start, "to": end, "cap": self.node.read_token}))
            await stream.close()
            check_pull_header(await asyncio.wait_for(read_header(stream), self.node.stall_timeout), key, start)
            yield stream
            finished = True
        finally:
            if not finished:  # failed or cancelled: stop the peer sending (finished: it has closed)
                stream.abort()

    async def manifest(self, url: str, key: str) -> bytes | None:
        stream = await self._open(url, MANIFEST_PROTOCOL)
        reply: dict = {}
        try:
            await stream.write(frame_header({"key": key, "cap": self.node.read_token}))
            await stream.close()
            reply = await asyncio.wait_for(read_header(stream), self.node.stall_timeout)
        finally:
            if not reply:  # no answer: give up the stream (answered: the peer has closed it)
                stream.abort()
        return reply.get("manifest")

    # -- server half ------------------------------------------------------------------------------
    async def _serve_push(self, stream: Libp2pStream) -> None:
        """The push stream, answered with one `{"status", "text"}` frame and a half-close (a reset
        could overtake the reply; the sender resets the stream itself once answered early)."""

        def identity(sender: Any, route: Any) -> str | None:
            """Why the stream's proven peer ID is not the sender the signed route names, or None."""
            expected = url_peer_id(sender.url)
            if expected is None and sender.id == route.source.id:  # the learner's ID is its signing key's
                expected = peer_id(self.node.verify_key)
            if expected is None:
                return f"{sender.id} has no libp2p identity in the route"
            if stream.remote_peer != expected:
                return f"stream from peer {stream.remote_peer}, but the route binds {sender.id} to {expected}"
            return None

        status, text = await self.node.accept_push(stream, peer=stream.remote_peer, identity=identity)
        await _reply(stream, {"status": status, "text": text})

    async def _serve_pull(self, stream: Libp2pStream) -> None:
        """A `{"key", "from", "to"}` request, answered like `GET /chunks/{key}?from=&to=`."""
        try:
            request = await asyncio.wait_for(read_header(stream), self.node.stall_timeout)
            holder = self.node.require_read(request.get("cap") if isinstance(request.get("cap"), str) else None)
            store, start, end = await self.node.open_pull(str(request.get("key")), request.get("from", 0),
                                                          request.get("to"))
            self.node.pulled(store, holder, start, end)
        except Refused as e:
            return await _reply(stream, {"error": f"{e.status} {e.text}"})
        except (ProtocolError, Libp2pError, asyncio.TimeoutError) as e:
            return await _reply(stream, {"error": f"400 bad pull request: {type(e).__name__}: {e}"})
        try:
            await self.node.serve_pull(store, start, end, stream.write, holder)
            await stream.close()
        except BroadcastError as e:  # Libp2pError, Stalled, VersionGone
            log.info("%s: pull of %s from %d ended: %s", self.node.id, store.key, start, e)
            stream.abort()

    async def _serve_manifest(self, stream: Libp2pStream) -> None:
        """`{"key"}` -> `{"manifest": signed wire}`, like `GET /manifest/{key}`."""
        try:
            request = await asyncio.wait_for(read_header(stream), self.node.stall_timeout)
        except (ProtocolError, Libp2pError, asyncio.TimeoutError) as e:
            return await _reply(stream, {"error": f"400 bad manifest request: {type(e).__name__}: {e}"})
        try:
            self.node.require_read(request.get("cap") if isinstance(request.get("cap"), str) else None)
        except Refused as e:
            return await _reply(stream, {"error": f"{e.status} {e.text}"})
        wire = self.node.manifest_wire(str(request.get("key")))
        await _reply(stream, {"manifest": wire} if wire is not None
                     else {"error": f"404 {self.node.id} does not hold {str(request.get('key'))[:64]!r}"})


async def _probe(url: str, timeout_s: float) -> bool:
    """Dial with a throwaway identity and ask for a manifest that does not exist: any answer
    proves the relay accepted the connection and speaks the protocol."""
    host = Libp2pHost(SigningKey.generate())
    await host.start()
    try:
        stream = await host.open_stream(p2p_addr(url), MANIFEST_PROTOCOL, timeout=timeout_s)
        try:
            await stream.write(frame_header({"key": "probe"}))
            await stream.close()
            reply = await asyncio.wait_for(read_header(stream), timeout_s)
        finally:
            with contextlib.suppress(Exception):
                stream.abort()
        return isinstance(reply, dict)
    finally:
        await host.stop()


async def _reply(stream: Libp2pStream, reply: dict) -> None:
    """Write a one-frame answer and half-close; a peer that is gone already is not an error."""
    with contextlib.suppress(Libp2pError):
        await stream.write(frame_header(reply))
        await stream.close()
