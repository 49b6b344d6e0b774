"""The chain relay: receive a version chunk by chunk, verify, forward while receiving, repair.

Roles (both are `Node`s: an aiohttp server holding versions as `VersionStore`s):
- `Source` (learner side) publishes signed versions and pushes each to the heads of the K
  chains of a plan (`broadcast.planner`).
- `Relay` (worker side) accepts one inbound push per version, verifies the signed manifest,
  then each chunk, writes it into a preallocated buffer of the whole version, and forwards it to
  its child as soon as it is verified. Receiving never waits for forwarding: the forwarder reads
  verified chunks from the buffer at its own pace, so chunk k+1 arrives while chunk k leaves,
  a slow child delays no one upstream, and memory is bounded by the one buffer (no queue of
  bytes grows; sockets apply back-pressure).

HTTP endpoints of every node (prefix `/bcast/v1`):
- `POST /push` — body is a stream (see `broadcast.transport`) whose header carries the signed
  manifest and the signed route of the version (`broadcast.route`). The receiver finds itself
  in the route: the hops after it are where it forwards, the hops before it (then the source)
  where it repairs from, and its chain's pacing rate is the rate every member forwards at, in
  small pieces, so no uplink of the chain runs flat out (a full uplink queue delays the ACKs of
  the relay's own download, and a chain's hops then fall behind one another).
- `GET /chunks/{key}?from=k` — stream chunks k.. of a version as they become available (repair,
  late joiners).
- `GET /manifest/{key}` — the signed manifest (late joiners); `GET /status` — JSON stats,
  including each version's route and this node's measured link rates (`link_sample`).

Repair: when the inbound stream breaks, stalls past `stall_timeout` or delivers a corrupt chunk,
the relay pulls the rest (from its first missing chunk, never from zero) from the nearest
ancestor other than the failed one, walking up to the source. A corrupt chunk is never
committed, so it is never forwarded; its sender is skipped. A version is reported complete only
when every chunk is verified: no node ends with a half-installed version.

Transports: a hop's URL picks the transport of every stream to it — `http://` for aiohttp (the
default), `p2p:<multiaddr>` for py-libp2p (`Node(transport="libp2p")` advertises one; same
frames, see `broadcast.libp2p_transport`). Every node serves HTTP too, so fleets can mix.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import logging
import mmap
import signal
import time
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping, Sequence

import aiohttp
from aiohttp import web

from broadcast.libp2p_transport import (
    MANIFEST_PROTOCOL,
    PULL_PROTOCOL,
    PUSH_PROTOCOL,
    Libp2pError,
    Libp2pHost,
    Libp2pStream,
    Libp2pUnavailable,
    is_p2p,
    listen_addr,
    p2p_addr,
    p2p_url,
)
from broadcast.libp2p_transport import available as libp2p_available
from broadcast.manifest import (
    DEFAULT_CHUNK_SIZE,
    BroadcastError,
    Buffer,
    Manifest,
    TensorEntry,
    build_manifest,
)
from broadcast.planner import Plan
from broadcast.route import RouteError, SignedRoute, route_for, sign_route
from broadcast.signing import (
    ChunkCorrupt,
    SignatureError,
    SignedManifest,
    SigningKey,
    VerifyKey,
    sign_manifest,
    verify_chunk,
)
from broadcast.transport import (
    PACED_PIECE,
    PIECE,
    Hop,
    ProtocolError,
    Stalled,
    StallGuard,
    TokenBucket,
    frame_header,
    pieces,
    read_header,
    read_into,
)

log = logging.getLogger("echo.broadcast")
PREFIX = "/bcast/v1"
MIB = float(1 << 20)
TRANSPORTS = ("aiohttp", "libp2p")


class BroadcastFailed(BroadcastError):
    """A version could not be received from any ancestor; the node stays on its old version."""


class VersionGone(BroadcastError):
    """A version was evicted (superseded) or failed while a stream was waiting for its chunks."""


@dataclass
class TransferStats:
    """Per-version counters of one node; times are wall-clock (time.time()) for cross-host logs."""

    key: str
    parent: str | None = None
    bytes_in: int = 0  # chunk payload bytes received, including any received twice
    bytes_out: int = 0  # chunk payload bytes sent (forwarding and serving pulls)
    chunks_out: int = 0
    forwarded_before_complete: int = 0  # chunks sent while this node was still receiving
    offered_rate: float | None = None  # the chain's pacing rate (bytes/s); None: unpaced
    t_start: float = field(default_factory=time.time)
    t_first_chunk: float | None = None
    t_first_forward: float | None = None
    t_last_forward: float | None = None
    t_complete: float | None = None
    pushes: list[dict] = field(default_factory=list)  # completed push streams sent: chain, to, seconds, bytes
    repairs: list[dict] = field(default_factory=list)
    corrupt: list[dict] = field(default_factory=list)


class VersionStore:
    """One version on one node: the signed manifest, the wire buffer, and how much is verified.

    Invariant: chunks `0 .. have-1` of `buffer` are verified and never written again; readers
    (forwarders, pull servers) only read those, so they never see unverified bytes.
    """

    def __init__(self, signed: SignedManifest, wire: Buffer | None = None) -> None:
        m = signed.manifest
        self.signed = signed
        self.manifest: Manifest = m
        if wire is not None:
            self.buffer = memoryview(wire).cast("B")
            self.have = m.num_chunks
        else:
            # Anonymous mmap: pages are zeroed lazily by the kernel, so a multi-GB buffer is free
            # to allocate and costs memory only as chunks arrive.
            self.buffer = memoryview(mmap.mmap(-1, m.wire_size)) if m.wire_size else memoryview(bytearray())
            self.have = 0
        if len(self.buffer) != m.wire_size:
            raise BroadcastError(f"{m.key}: wire buffer is {len(self.buffer)} B, manifest says {m.wire_size}")
        self.stats = TransferStats(m.key)
        self.route: SignedRoute | None = None
        self.pace: float | None = None  # this node's chain's pacing rate (bytes/s), if paced
        self.ancestors: list[Hop] = []
        self.last_failure = ""  # why the latest inbound stream ended early (for repair events)
        self.gone: BaseException | None = None
        self.tasks: set[asyncio.Task] = set()
        self._cond = asyncio.Condition()
        self.done = asyncio.get_running_loop().create_future()
        if self.complete:
            self.done.set_result(self)

    @property
    def key(self) -> str:
        return self.manifest.key

    @property
    def complete(self) -> bool:
        return self.have == self.manifest.num_chunks

    @property
    def settled(self) -> bool:
        """Received whole and nothing of it still being forwarded: its link sample is final."""
        return self.complete and all(t.done() for t in self.tasks)

    def view(self, index: int) -> memoryview:
        return self.manifest.wire_view(self.buffer, index)

    async def commit(self, index: int) -> None:
        assert index == self.have, f"chunks commit in order ({index} after {self.have})"
        async with self._cond:
            self.have = index + 1
            self._cond.notify_all()
        if self.complete and not self.done.done():
            self.done.set_result(self)

    async def wait_chunk(self, index: int) -> memoryview:
        """The verified bytes of chunk `index`, waiting until it is verified."""
        async with self._cond:
            await self._cond.wait_for(lambda: self.have > index or self.gone is not None)
        if self.have <= index:
            raise VersionGone(f"{self.key}: {self.gone}")
        return self.view(index)

    async def close(self, reason: BaseException) -> None:
        """Fail or evict: wake every waiter, cancel this version's tasks."""
        self.gone = reason
        async with self._cond:
            self._cond.notify_all()
        if not self.done.done():
            self.done.set_exception(reason)
            self.done.exception()  # mark retrieved: nobody may be waiting
        for t in list(self.tasks):
            if t is not asyncio.current_task():
                t.cancel()

    def status(self) -> dict:
        from broadcast.links import link_sample

        sample = link_sample(self.stats, self.manifest.wire_size)
        return {"have": self.have, "chunks": self.manifest.num_chunks, "complete": self.complete,
                "gone": None if self.gone is None else str(self.gone), **self.manifest.to_dict(),
                **asdict(self.stats), "route": self.route.route.to_dict() if self.route else None,
                "link_sample": sample.to_dict() if sample else None}


@dataclass(frozen=True)
class Received:
    """A fully received and verified version, handed to `on_complete` (install it from `data`)."""

    manifest: Manifest
    signed: SignedManifest
    data: memoryview  # the wire buffer: the blob itself for a raw version (see broadcast.delta)
    stats: TransferStats


class Node:
    """Shared server side: version stores, pull and status endpoints, outbound streams.

    `transport="libp2p"` also runs a py-libp2p host (identity `p2p_key`, a fresh key if None;
    TCP `p2p_port` on `host`, any if 0) and advertises its `p2p:` address as this node's `url`
    (or `public_url`, e.g. `p2p_url(f"/ip4/{ip}/tcp/{port}/p2p/{peer_id(key)}")` behind NAT).
    The HTTP server keeps running (status, and pushes from aiohttp peers). Either kind of node
    reaches both kinds of peers.
    """

    def __init__(
        self,
        node_id: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        public_url: str | None = None,
        up_rate: float | None = None,
        stall_timeout: float = 15.0,
        connect_timeout: float = 5.0,
        keep_versions: int = 2,
        on_event: Callable[[dict], Any] | None = None,
        transport: str = "aiohttp",
        p2p_key: SigningKey | None = None,
        p2p_port: int = 0,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if transport == "libp2p" and libp2p_available() is None:
            raise Libp2pUnavailable("transport='libp2p' needs py-libp2p: pip install 'echo-rl[p2p]'")
        self.id = node_id
        self.transport = transport
        self.host, self.port = host, port
        self._public_url = public_url
        self.up = TokenBucket(up_rate) if up_rate else None
        self.stall_timeout = stall_timeout
        self.connect_timeout = connect_timeout
        self.keep_versions = keep_versions
        self.on_event = on_event
        self.stores: dict[str, VersionStore] = {}
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._p2p_key, self._p2p_port = p2p_key, p2p_port
        self._p2p: Libp2pHost | None = None
        self._p2p_lock = asyncio.Lock()
        self._p2p_tasks: set[asyncio.Task] = set()  # inbound libp2p streams being served

    # -- lifecycle ----------------------------------------------------------------------------
    def _routes(self) -> list[web.RouteDef]:
        return [web.get(PREFIX + "/chunks/{key}", self._handle_chunks),
                web.get(PREFIX + "/manifest/{key}", self._handle_manifest),
                web.get(PREFIX + "/status", self._handle_status)]

    def _p2p_handlers(self) -> dict[str, Callable[[Libp2pStream], Awaitable[None]]]:
        return {PULL_PROTOCOL: self._serve_pull_p2p, MANIFEST_PROTOCOL: self._serve_manifest_p2p}

    async def start(self) -> str:
        """Start serving; returns the node's URL."""
        app = web.Application()
        app.add_routes(self._routes())
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout),
            auto_decompress=False)
        if self.transport == "libp2p":
            await self._p2p_host()
        return self.url

    async def _p2p_host(self) -> Libp2pHost:
        """This node's libp2p host: started by `start()` with transport="libp2p", else on the first
        stream to a `p2p:` peer (then listening on loopback only: it is not advertised)."""
        async with self._p2p_lock:
            if self._p2p is None:
                listen = (listen_addr(self.host, self._p2p_port) if self.transport == "libp2p"
                          else listen_addr("127.0.0.1"))
                host = Libp2pHost(self._p2p_key or SigningKey.generate(), listen=listen)
                for protocol, handler in self._p2p_handlers().items():
                    host.set_handler(protocol, self._tracked(handler))
                await host.start()
                self._p2p = host
            return self._p2p

    def _tracked(self, handler: Callable[[Libp2pStream], Awaitable[None]]) -> Callable[[Libp2pStream], Awaitable[None]]:
        """Serve a libp2p stream as a task `stop()` cancels (aiohttp does that for its handlers)."""
        async def serve(stream: Libp2pStream) -> None:
            task = asyncio.current_task()
            assert task is not None
            self._p2p_tasks.add(task)
            try:
                await handler(stream)
            finally:
                self._p2p_tasks.discard(task)

        return serve

    async def stop(self) -> None:
        for store in list(self.stores.values()):
            await store.close(BroadcastError("node stopped"))
        for task in list(self._p2p_tasks):
            task.cancel()
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._p2p is not None:
            await self._p2p.stop()
            self._p2p = None

    @property
    def url(self) -> str:
        if self._public_url:
            return self._public_url
        if self.transport == "libp2p" and self._p2p is not None:
            return p2p_url(self._p2p.addrs[0])
        return f"http://{self.host}:{self.port}"

    @property
    def hop(self) -> Hop:
        return Hop(self.id, self.url)

    # -- helpers ------------------------------------------------------------------------------
    def emit(self, event: str, **fields: Any) -> None:
        """Report an event; a failing observer never stops the relay."""
        record = {"event": event, "node": self.id, "t": time.time(), **fields}
        log.info("%s %s", event, json.dumps(fields, default=str))
        if self.on_event is not None:
            try:
                self.on_event(record)
            except Exception:  # noqa: BLE001 - observers are isolated by design
                log.exception("on_event observer failed on %s", event)

    def _spawn(self, store: VersionStore, coro: Any) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        store.tasks.add(task)
        task.add_done_callback(store.tasks.discard)
        return task

    async def _add_store(self, store: VersionStore) -> VersionStore:
        """Register a version, evicting the oldest beyond `keep_versions`."""
        self.stores[store.key] = store
        by_age = sorted(self.stores.values(), key=lambda s: (s.manifest.version, s.key))
        for old in by_age[:max(0, len(by_age) - self.keep_versions)]:
            del self.stores[old.key]
            await old.close(VersionGone(f"{old.key} evicted by newer versions"))
        return store

    async def _frames(self, store: VersionStore, start: int, guard: StallGuard | None,
                      chain_rate: TokenBucket | None = None) -> AsyncIterator[Buffer]:
        """Frames of chunks `start..` of a version, each sent as soon as it is verified here."""
        for i in range(start, store.manifest.num_chunks):
            if guard is not None:
                with guard.paused():  # waiting on our own upstream is not the peer's stall
                    view = await store.wait_chunk(i)
            else:
                view = await store.wait_chunk(i)
            if store.stats.t_first_forward is None:
                store.stats.t_first_forward = time.time()
            yield frame_header({"i": i, "n": len(view)})
            for piece in pieces(view, PACED_PIECE if chain_rate or self.up else PIECE):
                for bucket in (chain_rate, self.up):
                    if bucket is not None:
                        await bucket.take(len(piece))
                yield piece
                if guard is not None:
                    guard.touch()
            s = store.stats
            s.bytes_out += len(view)
            s.chunks_out += 1
            s.t_last_forward = time.time()
            if not store.complete:
                s.forwarded_before_complete += 1

    async def _push(self, store: VersionStore, route: SignedRoute, chain: int, first: int) -> bool:
        """Stream a version to member `first` of `chain` in the signed `route`, who forwards it on.

        If that member cannot be reached, fails or stalls, route around it: push to the next
        member instead. A member that already has the version (it got the stream header from
        the failed one and is repairing itself by pulling) answers 409; nothing more to do then.
        Returns True if some member took the stream to its end.
        """
        members = route.route.chains[chain]
        for pos in range(first, len(members)):
            status, detail = await self._push_once(store, route, chain, pos)
            if status == 200:
                return True
            if status == 409 or store.gone is not None:
                return status == 409
            self.emit("child_failed", key=store.key, child=members[pos].id, status=status, error=detail,
                      next=members[pos + 1].id if pos + 1 < len(members) else None)
        return False

    async def _push_once(self, store: VersionStore, route: SignedRoute, chain: int, pos: int) -> tuple[int, str]:
        """One push stream to member `pos` of `chain`: (HTTP status, reason); 0 when the stream broke."""
        child = route.route.chains[chain][pos]
        rate = route.route.pace(chain)
        header = {"manifest": store.signed.to_wire(), "route": route.to_wire(), "from": self.id}
        guard = StallGuard(self.stall_timeout)
        bucket = TokenBucket(rate) if rate else None

        async def body() -> AsyncIterator[Buffer]:
            yield frame_header(header)
            async for piece in self._frames(store, 0, guard, bucket):
                yield piece

        send = self._push_p2p if is_p2p(child.url) else self._push_http
        t0 = time.monotonic()
        try:
            status, text = await guard.run(send(child.url, body()))
        except Exception as e:  # noqa: BLE001 - connection errors, stalls, body-generator errors
            return 0, f"{type(e).__name__}: {e}"
        if status == 200:
            dt = time.monotonic() - t0
            store.stats.pushes.append({"chain": chain, "pos": pos, "to": child.id, "seconds": round(dt, 4),
                                       "bytes": store.manifest.wire_size})
            log.info("%s: pushed %s to %s in %.2f s (%.1f MiB/s)", self.id, store.key, child.id, dt,
                     store.manifest.wire_size / MIB / max(dt, 1e-9))
        return status, text

    async def _push_http(self, url: str, body: AsyncIterator[Buffer]) -> tuple[int, str]:
        assert self._session is not None, "start() the node first"
        async with self._session.post(f"{url}{PREFIX}/push", data=body,
                                      headers={"Content-Type": "application/octet-stream"}) as resp:
            return resp.status, (await resp.text())[:300]

    async def _push_p2p(self, url: str, body: AsyncIterator[Buffer]) -> tuple[int, str]:
        """The push over a libp2p stream: write the body, half-close, read the one reply frame.

        The reply is read while writing, as aiohttp does: a child that already has the version
        (409) or refuses the stream answers at once, and the rest of the body is not sent.
        """
        host = await self._p2p_host()
        stream = await host.open_stream(p2p_addr(url), PUSH_PROTOCOL, timeout=self.connect_timeout)

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

    # -- handlers -----------------------------------------------------------------------------
    def _pull_request(self, key: str, start: Any) -> tuple[VersionStore, int]:
        """The store and first chunk of a pull (either transport); raises the HTTP error if refused."""
        store = self.stores.get(key)
        if store is None or store.gone is not None:
            raise web.HTTPNotFound(text=f"{self.id} does not hold {key}")
        try:
            start = int(start)
        except (TypeError, ValueError):
            raise web.HTTPBadRequest(text="`from` must be a chunk index") from None
        if not 0 <= start <= store.manifest.num_chunks:
            raise web.HTTPBadRequest(text=f"`from`={start} outside 0..{store.manifest.num_chunks}")
        return store, start

    async def _send_chunks(self, store: VersionStore, start: int, write: Callable[[Buffer], Awaitable[Any]]) -> None:
        """A pull stream: `{"key", "start"}`, then chunks `start..` as each is verified here."""
        guard = StallGuard(self.stall_timeout)
        # A pull is paced like the chain it repairs (the route's rate), so a repairing child
        # does not flood the uplink this node shares with its own push.
        bucket = TokenBucket(store.pace) if store.pace else None

        async def serve() -> None:
            await write(frame_header({"key": store.key, "start": start}))
            async for piece in self._frames(store, start, guard, bucket):
                await write(piece)

        await guard.run(serve())

    async def _handle_chunks(self, request: web.Request) -> web.StreamResponse:
        store, start = self._pull_request(request.match_info["key"], request.query.get("from", "0"))
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        await resp.prepare(request)
        try:
            await self._send_chunks(store, start, resp.write)
            await resp.write_eof()
        except (ConnectionError, aiohttp.ClientError, Stalled, VersionGone, RuntimeError) as e:
            log.info("%s: pull of %s from %d ended: %s", self.id, store.key, start, e)
            if request.transport is not None:
                request.transport.close()
        return resp

    async def _serve_pull_p2p(self, stream: Libp2pStream) -> None:
        """`PULL_PROTOCOL`: a `{"key", "from"}` request, answered like `GET /chunks/{key}?from=`."""
        try:
            request = await asyncio.wait_for(read_header(stream), self.stall_timeout)
            store, start = self._pull_request(str(request.get("key")), request.get("from", 0))
        except web.HTTPException as e:
            return await self._reply_p2p(stream, {"error": f"{e.status} {e.text}"})
        except (ProtocolError, Libp2pError, asyncio.TimeoutError) as e:
            return await self._reply_p2p(stream, {"error": f"400 bad pull request: {type(e).__name__}: {e}"})
        try:
            await self._send_chunks(store, start, stream.write)
            await stream.close()
        except (Libp2pError, Stalled, VersionGone) as e:
            log.info("%s: pull of %s from %d ended: %s", self.id, store.key, start, e)
            stream.abort()

    async def _serve_manifest_p2p(self, stream: Libp2pStream) -> None:
        """`MANIFEST_PROTOCOL`: `{"key"}` -> `{"manifest": signed wire}`, like `GET /manifest/{key}`."""
        try:
            request = await asyncio.wait_for(read_header(stream), self.stall_timeout)
        except (ProtocolError, Libp2pError, asyncio.TimeoutError) as e:
            return await self._reply_p2p(stream, {"error": f"400 bad manifest request: {type(e).__name__}: {e}"})
        store = self.stores.get(str(request.get("key")))
        await self._reply_p2p(stream, {"manifest": store.signed.to_wire()} if store is not None
                              else {"error": f"404 {self.id} does not hold {request.get('key')}"})

    @staticmethod
    async def _reply_p2p(stream: Libp2pStream, reply: dict) -> None:
        """Write a one-frame answer and half-close; a peer that is gone already is not an error."""
        with contextlib.suppress(Libp2pError):
            await stream.write(frame_header(reply))
            await stream.close()

    async def _handle_manifest(self, request: web.Request) -> web.Response:
        store = self.stores.get(request.match_info["key"])
        if store is None:
            raise web.HTTPNotFound(text=f"{self.id} does not hold {request.match_info['key']}")
        return web.Response(body=store.signed.to_wire(), content_type="application/octet-stream")

    async def _handle_status(self, request: web.Request) -> web.Response:
        return web.json_response({"id": self.id, "url": self.url,
                                  "versions": {k: s.status() for k, s in self.stores.items()}})


class Relay(Node):
    """A worker's relay: receives, verifies and forwards versions; repairs around dead peers.

    `on_complete(received)` is called once per fully verified version (install from
    `received.data`; see `broadcast.delta.decode`). `wait(key)` awaits the same.
    """

    def __init__(
        self,
        node_id: str,
        verify_key: VerifyKey,
        *,
        on_complete: Callable[[Received], Any] | None = None,
        down_rate: float | None = None,
        max_source_retries: int = 3,
        **kwargs: Any,
    ) -> None:
        super().__init__(node_id, **kwargs)
        self.verify_key = verify_key
        self.on_complete = on_complete
        self.down = TokenBucket(down_rate) if down_rate else None
        self.max_source_retries = max_source_retries
        self._arrivals: dict[str, asyncio.Future] = {}

    def _routes(self) -> list[web.RouteDef]:
        return super()._routes() + [web.post(PREFIX + "/push", self._handle_push)]

    def _p2p_handlers(self) -> dict[str, Callable[[Libp2pStream], Awaitable[None]]]:
        return {**super()._p2p_handlers(), PUSH_PROTOCOL: self._serve_push_p2p}

    async def wait(self, key: str, timeout: float | None = None) -> Received:
        """Wait until version `key` is complete here (raises `BroadcastFailed` if it failed)."""
        async def arrival() -> Received:
            store = self.stores.get(key)
            if store is None:
                fut = self._arrivals.setdefault(key, asyncio.get_running_loop().create_future())
                store = await asyncio.shield(fut)  # shielded: a caller's timeout must not cancel it
            await asyncio.shield(store.done)
            return self._received(store)

        return await asyncio.wait_for(arrival(), timeout)

    def link_samples(self) -> list:
        """`broadcast.links.LinkSample`s of the versions held here that are `settled` (report them
        to the learner)."""
        from broadcast.links import link_sample

        samples = []
        for store in self.stores.values():
            if store.settled:
                sample = link_sample(store.stats, store.manifest.wire_size)
                if sample is not None:
                    samples.append(sample)
        return samples

    async def wait_settled(self, key: str, timeout: float) -> VersionStore:
        """Wait until version `key` is `settled` here (received, and every forward of it ended)."""
        await self.wait(key, timeout)
        deadline = time.monotonic() + timeout
        while not self.stores[key].settled:  # forwards end just after the child completes
            if time.monotonic() > deadline:
                raise asyncio.TimeoutError(f"{self.id}: {key} still forwarding after {timeout} s")
            await asyncio.sleep(0.05)
        return self.stores[key]

    async def fetch(self, key: str, peers: Sequence[Hop]) -> Received:
        """Pull a whole version (e.g. a late joiner's full version) from the first peer that has it.

        `peers` are tried in order (put the source last); the manifest is verified first.
        """
        if key in self.stores:
            return await self.wait(key)
        assert self._session is not None, "start() the relay first"
        signed = None
        for peer in peers:
            try:
                wire = await self._get_manifest(peer, key)
            except (aiohttp.ClientError, OSError, Libp2pError, ProtocolError, asyncio.TimeoutError):
                continue
            if wire is not None:
                signed = SignedManifest.from_wire(wire, self.verify_key)
                break
        if signed is None:
            raise BroadcastFailed(f"no peer of {[p.id for p in peers]} serves {key}")
        if signed.manifest.key != key:
            raise BroadcastFailed(f"asked for {key}, got a manifest for {signed.manifest.key}")
        store = await self._new_store(signed)
        store.ancestors = list(peers)
        await self._spawn(store, self._repair(store, failed_index=-1, reason="fetch"))
        return await self.wait(key)

    async def _get_manifest(self, peer: Hop, key: str) -> bytes | None:
        """The signed manifest wire of `key` from `peer` (either transport), None if it lacks it."""
        if is_p2p(peer.url):
            stream = await (await self._p2p_host()).open_stream(p2p_addr(peer.url), MANIFEST_PROTOCOL,
                                                                timeout=self.connect_timeout)
            reply: dict = {}
            try:
                await stream.write(frame_header({"key": key}))
                await stream.close()
                reply = await asyncio.wait_for(read_header(stream), self.stall_timeout)
            finally:
                if not reply:  # no answer: give up the stream (answered: the peer has closed it)
                    stream.abort()
            return reply.get("manifest")
        assert self._session is not None, "start() the relay first"
        async with self._session.get(f"{peer.url}{PREFIX}/manifest/{key}") as resp:
            return await resp.read() if resp.status == 200 else None

    # -- receiving ----------------------------------------------------------------------------
    async def _new_store(self, signed: SignedManifest) -> VersionStore:
        store = await self._add_store(VersionStore(signed))
        fut = self._arrivals.pop(store.key, None)
        if fut is not None and not fut.done():
            fut.set_result(store)
        return store

    def _received(self, store: VersionStore) -> Received:
        return Received(store.manifest, store.signed, store.buffer, store.stats)

    async def _handle_push(self, request: web.Request) -> web.StreamResponse:
        status, text = await self._accept_push(request.content, peer=request.remote)
        if status == 200:
            return web.json_response(text=text)
        if status == 409:
            # Reply without cutting the connection: the sender must read this 409 (it means "taken
            # care of", not "failed"); its client stops sending once it has the reply.
            return web.Response(status=409, text=text)
        # Refused, or a bad upstream: drop its connection (it stops sending).
        return await self._abort(request, status, text)

    async def _serve_push_p2p(self, stream: Libp2pStream) -> None:
        """`PUSH_PROTOCOL`: the push stream, answered with one `{"status", "text"}` frame.

        The reply is followed by a half-close only: a reset could overtake it. The sender reads
        the reply while it writes and resets the stream itself once answered early.
        """
        status, text = await self._accept_push(stream, peer=stream.remote_peer)
        await self._reply_p2p(stream, {"status": status, "text": text})

    async def _accept_push(self, reader: Any, peer: str | None) -> tuple[int, str]:
        """An inbound push, whatever its transport: verify the signed manifest and route, find
        this node in the route, start forwarding, receive; repair if the stream fails.

        Returns the reply as (HTTP status, text): 200 received all, 409 already held, 400/403
        refused, 502 the stream failed (the rest is being pulled elsewhere).
        """
        step = "manifest"
        try:
            header = await asyncio.wait_for(read_header(reader), self.stall_timeout)
            signed = SignedManifest.from_wire(header["manifest"], self.verify_key)
            step = "route"
            route = SignedRoute.from_wire(header["route"], self.verify_key)
            route.route.check(signed.manifest)
            chain, pos = route.route.locate(self.id)
            # Ancestors start at the sender: the members between it and us were routed around.
            above = route.route.above(chain, pos)
            sender = [h.id for h in above].index(header.get("from"))  # ValueError: not our upstream
        except (SignatureError, RouteError) as e:
            self.emit(f"{step}_rejected", peer=peer, error=str(e))
            return 403 if isinstance(e, SignatureError) else 400, str(e)
        except (ProtocolError, Libp2pError, KeyError, TypeError, ValueError, asyncio.TimeoutError) as e:
            return 400, f"bad stream header: {type(e).__name__}: {e}"
        key = signed.manifest.key
        if key in self.stores:  # one inbound per version; a broken one is repaired by pulling
            return 409, f"{self.id} already has or is receiving {key}"
        store = await self._new_store(signed)
        store.route = route
        store.ancestors = above[sender:]
        store.stats.offered_rate = route.route.rates[chain]
        store.pace = route.route.pace(chain)
        if route.route.below(chain, pos):
            self._spawn(store, self._push(store, route, chain, pos + 1))
        if await self._receive(store, reader, store.ancestors[0]):
            return 200, json.dumps({"have": store.have})
        if store.gone is None:  # a bad upstream, not our own shutdown: fetch the rest elsewhere
            self._spawn(store, self._repair(store, failed_index=0, reason=store.last_failure))
        return 502, f"inbound stream failed at chunk {store.have}"

    @staticmethod
    async def _abort(request: web.Request, status: int, text: str) -> web.StreamResponse:
        """Reply, then close the connection, so an upstream that is still sending stops."""
        resp = web.Response(status=status, text=text)
        resp.force_close()  # "Connection: close": the client must not reuse this connection
        try:
            await resp.prepare(request)
            await resp.write_eof()
        except (ConnectionError, RuntimeError):
            pass  # the sender is gone already
        if request.transport is not None:
            request.transport.close()
        return resp

    async def _receive(self, store: VersionStore, reader: Any, parent: Hop) -> bool:
        """Read chunk frames (from chunk `store.have` on) until complete; False on any failure.

        Failures are reported (events, stats) and never raised: the caller repairs.
        """
        guard = StallGuard(self.stall_timeout)
        store.stats.parent = parent.id
        try:
            await guard.run(self._read_chunks(store, reader, guard))
        except ChunkCorrupt as e:
            store.stats.corrupt.append({"t": time.time(), "index": e.index, "from": parent.id, "reason": e.reason})
            self.emit("chunk_corrupt", key=store.key, index=e.index, sender=parent.id, reason=e.reason)
            store.last_failure = f"corrupt chunk {e.index} from {parent.id}"
            return False
        except (ProtocolError, Stalled, Libp2pError, aiohttp.ClientError, OSError) as e:
            store.last_failure = f"{type(e).__name__}: {e}"
            self.emit("inbound_failed", key=store.key, sender=parent.id, have=store.have,
                      error=store.last_failure)
            return False
        self._complete(store)
        return True

    async def _read_chunks(self, store: VersionStore, reader: Any, guard: StallGuard) -> None:
        m = store.manifest
        while store.have < m.num_chunks:
            header = await read_header(reader)
            guard.touch()
            if store.stats.t_first_chunk is None:
                store.stats.t_first_chunk = time.time()
            try:
                i, n = int(header["i"]), int(header["n"])
            except (KeyError, TypeError, ValueError) as e:
                raise ProtocolError(f"bad chunk header {header!r}") from e
            if i != store.have:  # streams are in order from the first chunk we lack
                raise ProtocolError(f"expected chunk {store.have}, got {i}")
            if n != m.chunks[i].wire_length:
                raise ChunkCorrupt(m.key, i, f"announced {n} B, manifest says {m.chunks[i].wire_length}")
            view = store.view(i)
            await read_into(reader, view, guard, self.down)
            store.stats.bytes_in += n
            await asyncio.to_thread(verify_chunk, m, i, view)  # blake3 releases the GIL
            await store.commit(i)

    def _complete(self, store: VersionStore) -> None:
        s = store.stats
        if s.t_complete is not None:
            return
        s.t_complete = time.time()
        dt = s.t_complete - s.t_start
        log.info("%s: %s complete, %.1f MiB in %.2f s (%.1f MiB/s), %d repairs", self.id, store.key,
                 store.manifest.wire_size / MIB, dt, store.manifest.wire_size / MIB / max(dt, 1e-9), len(s.repairs))
        self.emit("complete", key=store.key, seconds=dt, bytes_in=s.bytes_in, repairs=len(s.repairs))
        if self.on_complete is not None:
            try:
                result = self.on_complete(self._received(store))
                if inspect.isawaitable(result):
                    self._spawn(store, result)
            except Exception:  # noqa: BLE001 - observers are isolated by design
                log.exception("on_complete observer failed for %s", store.key)

    async def _repair(self, store: VersionStore, failed_index: int, reason: str) -> None:
        """Pull the missing chunks from the nearest ancestor after `failed_index`, walking up.

        The last ancestor (the source) is retried with backoff before giving up.
        """
        ancestors = store.ancestors
        idx, source_tries = failed_index + 1, 0
        while not store.complete and store.gone is None:
            if idx >= len(ancestors):
                if not ancestors or source_tries >= self.max_source_retries:
                    err = BroadcastFailed(f"{store.key}: no ancestor could deliver the rest ({reason}); "
                                          "staying on the previous version")
                    self.emit("failed", key=store.key, have=store.have, error=str(err))
                    await store.close(err)
                    return
                idx, source_tries = len(ancestors) - 1, source_tries + 1
                await asyncio.sleep(min(0.5 * 2 ** source_tries, 5.0))
            hop = ancestors[idx]
            resume = store.have
            store.stats.repairs.append({"t": time.time(), "reason": reason, "via": hop.id, "from": resume})
            self.emit("repair", key=store.key, via=hop.id, resume_from=resume, reason=reason)
            try:
                failure = await self._pull(store, hop, resume)
                if failure is None:
                    return
                reason = failure
            except (aiohttp.ClientError, OSError, ProtocolError, Libp2pError, asyncio.TimeoutError) as e:
                reason = f"{hop.id} unreachable: {type(e).__name__}: {e}"
            idx += 1

    async def _pull(self, store: VersionStore, hop: Hop, resume: int) -> str | None:
        """Pull chunks `resume..` from `hop` over its transport: None once complete, else why not."""
        if is_p2p(hop.url):
            host = await self._p2p_host()
            stream = await host.open_stream(p2p_addr(hop.url), PULL_PROTOCOL, timeout=self.connect_timeout)
            failure: str | None = "cancelled"
            try:
                await stream.write(frame_header({"key": store.key, "from": resume}))
                await stream.close()
                failure = await self._pull_from(store, stream, hop, resume)
                return failure
            finally:
                if failure is not None:  # failed or cancelled: stop the peer sending (complete: it has closed)
                    stream.abort()
        assert self._session is not None
        # No read timeout here: `_receive`'s stall guard watches progress.
        async with self._session.get(f"{hop.url}{PREFIX}/chunks/{store.key}", params={"from": resume}) as resp:
            if resp.status != 200:
                return f"{hop.id} answered HTTP {resp.status}"
            return await self._pull_from(store, resp.content, hop, resume)

    async def _pull_from(self, store: VersionStore, reader: Any, hop: Hop, resume: int) -> str | None:
        head = await asyncio.wait_for(read_header(reader), self.stall_timeout)
        if "error" in head:
            return f"{hop.id} answered {head['error']}"
        if head.get("start") != resume:
            raise ProtocolError(f"asked for chunks from {resume}, stream starts at {head.get('start')}")
        return None if await self._receive(store, reader, hop) else store.last_failure


class Source(Node):
    """The learner side: publish signed versions and push them down the chains of a plan."""

    def __init__(self, signing_key: SigningKey, node_id: str = "source", **kwargs: Any) -> None:
        kwargs.setdefault("keep_versions", 4)  # current and previous version, full and delta each
        # The learner's libp2p identity is its signing key: workers derive its peer ID from the
        # public key they already hold (`libp2p_transport.peer_id`), and noise proves it.
        kwargs.setdefault("p2p_key", signing_key)
        super().__init__(node_id, **kwargs)
        self.signing_key = signing_key

    async def add(self, signed: SignedManifest, wire: Buffer) -> VersionStore:
        """Hold an already signed version (wire buffer laid out by its manifest) for serving."""
        return await self._add_store(VersionStore(signed, wire))

    async def publish(
        self,
        blob: Buffer,
        version: int,
        *,
        tensors: Sequence[TensorEntry] = (),
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        base: tuple[Buffer, Manifest] | None = None,
    ) -> tuple[SignedManifest, SignedManifest | None]:
        """Sign and hold version `version` in full and, given `(base_blob, base_manifest)`, as a
        delta when that saves enough. Returns `(full, delta or None)`; push `delta.manifest.key`
        to workers that hold the base and `full.manifest.key` to the others.

        The blob must not change afterwards (it is served without a copy).
        """
        full_m = await asyncio.to_thread(build_manifest, blob, version, tensors=tensors, chunk_size=chunk_size)
        full = sign_manifest(self.signing_key, full_m)
        await self.add(full, blob)
        delta = None
        if base is not None:
            from broadcast.delta import (  # numpy/zstd only when deltas are used
                encode_delta,
                join_payloads,
            )

            encoded = await asyncio.to_thread(encode_delta, blob, base[0], full_m, base[1])
            if encoded is not None:
                delta = sign_manifest(self.signing_key, encoded[0])
                await self.add(delta, join_payloads(*encoded))
        return full, delta

    async def push(self, key: str, chains: Sequence[Sequence[Hop]], rates: Sequence[float | None] | None = None,
                   *, paced: bool | None = None, plan: Mapping[str, Any] | None = None) -> list[bool]:
        """Push version `key` to each chain's head (one stream each), at `rates` per chain.

        `paced` (default: whenever rates are given) makes every member forward at its chain's
        rate. The chains, rates and `plan` summary are signed as the version's route
        (`broadcast.route`), which travels with every stream and is what each relay forwards
        by. Returns once every head stream has ended: True per chain whose head received it
        all. The rest of each chain completes on its own; watch workers' events or `/status`.
        """
        store = self.stores.get(key)
        if store is None:
            raise BroadcastError(f"{key} is not published here; publish() it first")
        chains = [list(c) for c in chains if c]
        if rates is not None and len(rates) != len(chains):
            raise BroadcastError(f"{len(rates)} rates for {len(chains)} chains")
        paced = rates is not None if paced is None else paced
        signed = sign_route(self.signing_key, route_for(store.manifest, self.hop, chains, rates, paced=paced,
                                                        plan=dict(plan or {})))
        store.route = signed
        pushes = [self._spawn(store, self._push(store, signed, k, 0)) for k in range(len(chains))]
        return list(await asyncio.gather(*pushes))

    async def push_plan(self, key: str, plan: Plan, hops: Mapping[str, Hop], *, pace: bool = True) -> list[bool]:
        """Push version `key` along a `broadcast.planner.Plan`; `hops` maps worker id → Hop.

        With `pace`, each chain is fed at the plan's rate for it (so a slow chain cannot take
        uplink a faster one could use) and its relays forward at that rate too; plan with
        `headroom` < 1 (e.g. 0.95) so that rate stays below the links' capacity. A star is never
        paced (TCP shares the uplink fairly). The plan's summary is signed into the route.
        """
        missing = [w for chain in plan.chains for w in chain if w not in hops]
        if missing:
            raise BroadcastError(f"plan names workers with no known address: {missing}; re-plan without them")
        chains = [[hops[w] for w in chain] for chain in plan.chains]
        return await self.push(key, chains, plan.rates, paced=pace and plan.kind == "chains", plan=plan.summary())


# -- a relay as a process (tests, manual experiments) ------------------------------------------
def main(argv: Sequence[str] | None = None) -> None:
    """`python -m broadcast.relay --id w1 --public-key ed25519:...`: serve a relay until SIGTERM.

    Prints one JSON line `{"id", "url"}` once listening, then one JSON line per event.
    """
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--id", required=True)
    p.add_argument("--public-key", required=True, help="the learner's key, ed25519:<base64>")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--up-rate", type=float, default=None, help="upload cap, bytes/s")
    p.add_argument("--down-rate", type=float, default=None, help="download cap, bytes/s")
    p.add_argument("--stall-timeout", type=float, default=15.0)
    p.add_argument("--transport", choices=TRANSPORTS, default="aiohttp", help="what this relay advertises")
    args = p.parse_args(argv)

    def print_event(record: dict) -> None:
        print(json.dumps(record, default=str), flush=True)

    async def run() -> None:
        relay = Relay(args.id, VerifyKey.from_text(args.public_key), host=args.host, port=args.port,
                      up_rate=args.up_rate, down_rate=args.down_rate, stall_timeout=args.stall_timeout,
                      on_event=print_event, transport=args.transport)
        url = await relay.start()
        print(json.dumps({"id": args.id, "url": url}), flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        await relay.stop()

    asyncio.run(run())


if __name__ == "__main__":
    main()
