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
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import logging
import mmap
import signal
import time
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator, Callable, Mapping, Sequence

import aiohttp
from aiohttp import web

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
    """Shared server side: version stores, pull and status endpoints, outbound streams."""

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
    ) -> None:
        self.id = node_id
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

    # -- lifecycle ----------------------------------------------------------------------------
    def _routes(self) -> list[web.RouteDef]:
        return [web.get(PREFIX + "/chunks/{key}", self._handle_chunks),
                web.get(PREFIX + "/manifest/{key}", self._handle_manifest),
                web.get(PREFIX + "/status", self._handle_status)]

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
        return self.url

    async def stop(self) -> None:
        for store in list(self.stores.values()):
            await store.close(BroadcastError("node stopped"))
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def url(self) -> str:
        return self._public_url or f"http://{self.host}:{self.port}"

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

        async def post() -> tuple[int, str]:
            assert self._session is not None, "start() the node first"
            async with self._session.post(f"{child.url}{PREFIX}/push", data=body(),
                                          headers={"Content-Type": "application/octet-stream"}) as resp:
                return resp.status, (await resp.text())[:300]

        t0 = time.monotonic()
        try:
            status, text = await guard.run(post())
        except Exception as e:  # noqa: BLE001 - connection errors, stalls, body-generator errors
            return 0, f"{type(e).__name__}: {e}"
        if status == 200:
            dt = time.monotonic() - t0
            store.stats.pushes.append({"chain": chain, "pos": pos, "to": child.id, "seconds": round(dt, 4),
                                       "bytes": store.manifest.wire_size})
            log.info("%s: pushed %s to %s in %.2f s (%.1f MiB/s)", self.id, store.key, child.id, dt,
                     store.manifest.wire_size / MIB / max(dt, 1e-9))
        return status, text

    # -- handlers -----------------------------------------------------------------------------
    async def _handle_chunks(self, request: web.Request) -> web.StreamResponse:
        store = self.stores.get(request.match_info["key"])
        if store is None or store.gone is not None:
            raise web.HTTPNotFound(text=f"{self.id} does not hold {request.match_info['key']}")
        try:
            start = int(request.query.get("from", "0"))
        except ValueError:
            raise web.HTTPBadRequest(text="`from` must be a chunk index") from None
        if not 0 <= start <= store.manifest.num_chunks:
            raise web.HTTPBadRequest(text=f"`from`={start} outside 0..{store.manifest.num_chunks}")
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        await resp.prepare(request)
        guard = StallGuard(self.stall_timeout)

        # A pull is paced like the chain it repairs (the route's rate), so a repairing child
        # does not flood the uplink this node shares with its own push.
        bucket = TokenBucket(store.pace) if store.pace else None

        async def serve() -> None:
            await resp.write(frame_header({"key": store.key, "start": start}))
            async for piece in self._frames(store, start, guard, bucket):
                await resp.write(piece)
            await resp.write_eof()

        try:
            await guard.run(serve())
        except (ConnectionError, aiohttp.ClientError, Stalled, VersionGone, RuntimeError) as e:
            log.info("%s: pull of %s from %d ended: %s", self.id, store.key, start, e)
            if request.transport is not None:
                request.transport.close()
        return resp

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
        """`broadcast.links.LinkSample`s of the versions held here that are done moving: received
        whole, and nothing of theirs still being forwarded (report them to the learner)."""
        from broadcast.links import link_sample

        samples = []
        for store in self.stores.values():
            if store.complete and not any(not t.done() for t in store.tasks):
                sample = link_sample(store.stats, store.manifest.wire_size)
                if sample is not None:
                    samples.append(sample)
        return samples

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
                async with self._session.get(f"{peer.url}{PREFIX}/manifest/{key}") as resp:
                    if resp.status == 200:
                        signed = SignedManifest.from_wire(await resp.read(), self.verify_key)
                        break
            except (aiohttp.ClientError, OSError):
                continue
        if signed is None:
            raise BroadcastFailed(f"no peer of {[p.id for p in peers]} serves {key}")
        if signed.manifest.key != key:
            raise BroadcastFailed(f"asked for {key}, got a manifest for {signed.manifest.key}")
        store = await self._new_store(signed)
        store.ancestors = list(peers)
        await self._spawn(store, self._repair(store, failed_index=-1, reason="fetch"))
        return await self.wait(key)

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
        reader = request.content
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
            self.emit(f"{step}_rejected", peer=request.remote, error=str(e))
            return await self._abort(request, 403 if isinstance(e, SignatureError) else 400, str(e))
        except (ProtocolError, KeyError, TypeError, ValueError, asyncio.TimeoutError) as e:
            return await self._abort(request, 400, f"bad stream header: {type(e).__name__}: {e}")
        key = signed.manifest.key
        if key in self.stores:  # one inbound per version; a broken one is repaired by pulling
            # Reply without cutting the connection: the sender must read this 409 (it means "taken
            # care of", not "failed"); its client stops sending once it has the reply.
            return web.Response(status=409, text=f"{self.id} already has or is receiving {key}")
        store = await self._new_store(signed)
        store.route = route
        store.ancestors = above[sender:]
        store.stats.offered_rate = route.route.rates[chain]
        store.pace = route.route.pace(chain)
        if route.route.below(chain, pos):
            self._spawn(store, self._push(store, route, chain, pos + 1))
        if await self._receive(store, reader, store.ancestors[0]):
            return web.json_response({"have": store.have})
        # Bad upstream: drop its connection (it stops sending) and fetch the rest elsewhere.
        self._spawn(store, self._repair(store, failed_index=0, reason=store.last_failure))
        return await self._abort(request, 502, f"inbound stream failed at chunk {store.have}")

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
        except (ProtocolError, Stalled, aiohttp.ClientError, OSError) as e:
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
        while not store.complete:
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
                assert self._session is not None
                # No read timeout here: `_receive`'s stall guard watches progress.
                async with self._session.get(f"{hop.url}{PREFIX}/chunks/{store.key}",
                                             params={"from": resume}) as resp:
                    if resp.status != 200:
                        reason = f"{hop.id} answered HTTP {resp.status}"
                    else:
                        head = await asyncio.wait_for(read_header(resp.content), self.stall_timeout)
                        if head.get("start") != resume:
                            raise ProtocolError(f"asked for chunks from {resume}, stream starts at {head.get('start')}")
                        if await self._receive(store, resp.content, hop):
                            return
                        reason = store.last_failure
            except (aiohttp.ClientError, OSError, ProtocolError, asyncio.TimeoutError) as e:
                reason = f"{hop.id} unreachable: {type(e).__name__}: {e}"
            idx += 1


class Source(Node):
    """The learner side: publish signed versions and push them down the chains of a plan."""

    def __init__(self, signing_key: SigningKey, node_id: str = "source", **kwargs: Any) -> None:
        kwargs.setdefault("keep_versions", 4)  # current and previous version, full and delta each
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
    args = p.parse_args(argv)

    def print_event(record: dict) -> None:
        print(json.dumps(record, default=str), flush=True)

    async def run() -> None:
        relay = Relay(args.id, VerifyKey.from_text(args.public_key), host=args.host, port=args.port,
                      up_rate=args.up_rate, down_rate=args.down_rate, stall_timeout=args.stall_timeout,
                      on_event=print_event)
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
