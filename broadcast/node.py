"""What every broadcast node does, whatever its role or transport: hold versions, serve them,
send them down the trees of a route.

A `Node` is an aiohttp server (status, health, and the HTTP transport's endpoints) holding
versions as `broadcast.store.VersionStore`s. Streams to a peer go through the transport its URL's
scheme picks (`broadcast.transport.SCHEMES`: `http(s)://` is `broadcast.http_transport`, `p2p:`
`broadcast.libp2p_transport`), made and started on first use; inbound streams of every
transport reach the same transport-free core: `accept_push` (relays), `open_pull`/`serve_pull`
and `manifest_wire`.

Sending follows the version's signed route (`broadcast.route`): a node pushes each tree it is in
to its children in that tree, the span of the tree only, each chunk as soon as it is verified
here, paced at the tree's rate when the route says so, in small pieces, so no uplink runs flat
out (a full uplink queue delays the ACKs of the node's own download). A child that cannot be
reached, fails or stalls is routed around: its own children are pushed to instead. Children the
route marks as pulling (unreachable behind NAT) are never pushed to: they pull from us.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from http import HTTPStatus
from typing import Any, AsyncIterator, Callable

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from broadcast.manifest import BroadcastError, Buffer
from broadcast.receipts import RECEIPT_CHARS
from broadcast.route import SignedRoute
from broadcast.signing import SigningKey
from broadcast.store import VersionGone, VersionStore
from broadcast.tickets import Proof, Readers
from broadcast.transport import (
    ADVERTISED,
    PACED_PIECE,
    PIECE,
    PREFIX,
    TRANSPORTS,
    Hop,
    Refused,
    StallGuard,
    TokenBucket,
    Transport,
    bearer,
    frame_header,
    http_url,
    pieces,
    scheme_of,
    transport_class,
)

log = logging.getLogger("echo.broadcast")
MIB = float(1 << 20)
#: A version's size a ticket holder may pull of it from one node: once, and once again for repairs
#: (a joined identity pulled 2,060 whole versions in 20 s, all of the source's uplink).
PULL_SHARE = 2
HEADER_TIMEOUT_S = 30.0  # a connection without a whole request in this long is closed (slow headers)
SERVER_SCHEME = "http"  # a node's own server: status, health, the route feed (and HTTP streams)
REFUSAL_DELAY = web.AppKey("refusal_delay_s", float)  # the node's `refusal_delay_s`, for its middleware


def receipt_of(reply: str) -> str:
    """The receipt in a child's answer to a push taken whole (`broadcast.receipts`); "" if none."""
    try:
        found = json.loads(reply).get("receipt", "")
    except (ValueError, AttributeError):
        return ""
    # Anything but the receipt's form is dropped here: a child's garbage in its parent's heartbeat
    # would have the learner refuse the whole heartbeat (echo.protocol.Delivery).
    return found if isinstance(found, str) and re.fullmatch(f"[0-9a-f]{{{RECEIPT_CHARS}}}", found) else ""


def key_version(key: str) -> int | None:
    """The version number of a stream key ("v7", "v7-d6"); None if it is not one."""
    try:
        return int(key[1:].split("-")[0]) if key.startswith("v") else None
    except ValueError:
        return None


class Node:
    """Shared server side: version stores, pull and status endpoints, outbound streams.

    `transport` names what it advertises (`broadcast.transport.ADVERTISED`): "libp2p" also runs
    a py-libp2p host (identity `p2p_key`, a fresh key if None; TCP `p2p_port` on `host`, any if
    0) and advertises its `p2p:` address as this node's `url` (or `public_url`). The HTTP server
    keeps running (status, and pushes from aiohttp peers). Every node reaches every kind of peer.

    `read_token`: this node's read ticket (`broadcast.tickets`). When set, the node presents it on
    its own requests and serves manifests, chunks, pushes and its status only to requests that
    present a valid ticket of the run (`readers`, set by `Source` and `Relay`, which hold the
    run's key): the weights reach no one without one. The holder renews it (`read_token` is read
    at each request). `proof_key`: the key a worker's ticket names (`broadcast.tickets.proof_key`),
    with which its pulls and pushes over HTTP prove the ticket is its own.
    """

    # A request without a valid read ticket is answered this many seconds late, as a login
    # refused (PAM's faildelay): a reader that waits for its answers, one connection at a time,
    # costs this node one request a second instead of as many as it can send.
    refusal_delay_s = 1.0

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
        read_token: str | None = None,
        proof_key: SigningKey | None = None,
        connection_limits: Callable[[str], tuple[tuple[str, int], ...]] | None = None,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self._advertised = transport_class(ADVERTISED[transport])
        self._advertised.check_available()
        self.id = node_id
        self.read_token = read_token or None
        self.proof_key = proof_key
        self.connection_limits = connection_limits  # open connections per address (`ConnectionCap`); None: any
        self.readers: Readers | None = None  # set with the run's key by Source and Relay
        self.on_pull: Callable[[str, str, int, int], None] | None = None  # (key, ticket holder, chunks) of each pull served
        self.on_pushed: Callable[[str, str, int], None] | None = None  # (key, member, tree) of each push taken whole
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
        self.p2p_key, self.p2p_port = p2p_key, p2p_port
        self._transports: dict[type[Transport], Transport] = {}  # by class: http and https share one
        self._store_added: asyncio.Condition | None = None  # created in start() (needs a loop)
        self._making = asyncio.Lock()
        self._stopped = False  # a stopped node makes no transports (a pull still running on it fails)

    # -- lifecycle ----------------------------------------------------------------------------
    def _routes(self) -> list[web.RouteDef]:
        return [web.get(PREFIX + "/status", self._handle_status, allow_head=False),
                web.get(PREFIX + "/health", self._handle_health, allow_head=False)]

    async def start(self) -> str:
        """Start serving (the HTTP server, and the advertised transport); returns the node's URL."""
        self._store_added = asyncio.Condition()
        self._stopped = False
        own = [self._make(cls) for cls in dict.fromkeys((transport_class(SERVER_SCHEME), self._advertised))]
        app = web.Application(middlewares=[refusals_returned])
        app[REFUSAL_DELAY] = self.refusal_delay_s
        app.on_response_prepare.append(no_version_banner)
        app.add_routes(self._routes() + [r for t in own for r in t.routes()])
        # A connection that sends no whole request in this long (slow headers, idle) is closed.
        # auto_decompress=False: nothing here takes a compressed body, and aiohttp would inflate a gzip one unbounded
        self._runner = QuietRunner(app, limits=self.connection_limits, access_log=None,
                                   keepalive_timeout=HEADER_TIMEOUT_S, auto_decompress=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        for transport in own:
            await transport.start()
        return self.url

    def _make(self, cls: type[Transport]) -> Transport:
        if cls not in self._transports:
            self._transports[cls] = cls.for_node(self, advertised=cls is self._advertised)
        return self._transports[cls]

    async def transport_for(self, url: str) -> Transport:
        """The transport of a peer URL, by its scheme; made and started on first use."""
        cls = transport_class(scheme_of(url))
        if cls in self._transports:
            return self._transports[cls]
        async with self._making:  # concurrent pushes to new kinds of peer make one transport
            if self._stopped:
                raise BroadcastError("node stopped")
            if cls in self._transports:
                return self._transports[cls]
            # On a thread: a transport's first use may import its library (py-libp2p: ~0.5 s), and
            # this is often the learner's event loop in the middle of a push.
            transport = await asyncio.to_thread(cls.for_node, self, cls is self._advertised)
            await transport.start()
            self._transports[cls] = transport
        return transport

    async def stop(self) -> None:
        self._stopped = True
        for store in list(self.stores.values()):
            await store.close(BroadcastError("node stopped"))
        # A stopped node holds no version: aiohttp's middleware cache (1,024 entries) keeps its
        # handlers, and so the node, alive, and a worker that joins again starts a new one: each
        # old node kept its versions, a whole model's buffer each.
        self.stores.clear()
        for transport in set(self._transports.values()):
            await transport.stop()
        self._transports.clear()
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def url(self) -> str:
        advertised = self._transports.get(self._advertised)
        return self._public_url or (advertised.url if advertised is not None else None) or http_url(self.host, self.port)

    @property
    def hop(self) -> Hop:
        return Hop(self.id, self.url)

    # -- helpers ------------------------------------------------------------------------------
    def emit(self, event: str, **fields: Any) -> None:
        """Report an event; a failing observer never stops the relay."""
        record = {"event": event, "node": self.id, "t": time.time(), **fields}
        # "complete" has a line of its own (`Relay._complete`); the others are said only here
        log.log(logging.DEBUG if event == "complete" else logging.INFO, "%s: %s %s", self.id, event,
                json.dumps(fields, default=str))
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
        if self._store_added is not None:
            async with self._store_added:
                self._store_added.notify_all()
        return store

    async def _store_soon(self, key: str, timeout: float) -> VersionStore | None:
        """The store of `key`, waiting up to `timeout` s for a version newer than any held here
        to arrive (a child may ask before its parent's own push has started)."""
        store = self.stores.get(key)
        v = key_version(key)
        newest = max((s.manifest.version for s in self.stores.values()), default=-1)
        if store is not None or v is None or v < newest or self._store_added is None:
            return store
        async with self._store_added:
            try:
                await asyncio.wait_for(self._store_added.wait_for(lambda: key in self.stores), timeout)
            except asyncio.TimeoutError:
                return None
        return self.stores.get(key)

    async def _frames(self, store: VersionStore, start: int, end: int, guard: StallGuard | None,
                      tree_rate: TokenBucket | None = None) -> AsyncIterator[Buffer]:
        """Frames of chunks `start..end-1` of a version, each sent as soon as it is verified here."""
        for i in range(start, end):
            if guard is not None:
                with guard.paused():  # waiting on our own upstream is not the peer's stall
                    view = await store.wait_chunk(i)
            else:
                view = await store.wait_chunk(i)
            if store.stats.t_first_forward is None:
                store.stats.t_first_forward = time.time()
            yield frame_header({"i": i, "n": len(view)})
            for piece in pieces(view, PACED_PIECE if tree_rate or self.up else PIECE):
                for bucket in (tree_rate, self.up):
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

    # -- sending along a route ---------------------------------------------------------------------
    async def _push(self, store: VersionStore, route: SignedRoute, tree: int, member: int) -> bool:
        """Stream tree `tree`'s span to `member` of it, who forwards it on; route around failures.

        A member that cannot be reached, fails or stalls is skipped: its children are pushed to
        instead. A member that already has the span (it got the stream header from the failed
        one and is repairing itself, or it pulls) answers 409: nothing more to do then. Returns
        True if the member (or, around it, every child) took the stream to its end.
        """
        r = route.route
        members = r.chains[tree]
        status, detail = await self._push_once(store, route, tree, member)
        if status in (200, 409) or store.gone is not None:
            return status in (200, 409)
        around = [c for c in r.children(tree, member) if members[c].id not in r.pull]
        self.emit("child_failed", key=store.key, child=members[member].id, status=status, error=detail,
                  next=[members[c].id for c in around] or None)
        if not around:
            return False
        return all(await asyncio.gather(*(self._push(store, route, tree, c) for c in around)))

    async def _push_once(self, store: VersionStore, route: SignedRoute, tree: int, member: int) -> tuple[int, str]:
        """One push stream to `member` of `tree`: (HTTP status, reason); 0 when the stream broke."""
        child = route.route.chains[tree][member]
        first, end = route.route.span(tree, store.manifest.num_chunks)
        rate = route.route.pace(tree)
        header = {"manifest": store.manifest_wire, "route": route.to_wire(), "from": self.id, "tree": tree}
        guard = StallGuard(self.stall_timeout)
        bucket = TokenBucket(rate) if rate else None

        async def body() -> AsyncIterator[Buffer]:
            yield frame_header(header)
            async for piece in self._frames(store, first, end, guard, bucket):
                yield piece

        t0 = time.monotonic()
        try:
            transport = await self.transport_for(child.url)
            status, text = await guard.run(transport.push(child.url, body(), ticket=self.push_ticket(child.id),
                                                          audience=child.id))
        except Exception as e:  # noqa: BLE001 - connection errors, stalls, body-generator errors
            status, text = 0, f"{type(e).__name__}: {e}"
        if status != 200:  # reported as a push without a receipt: a child that refused it and then
            # pulled from the learner had this relay blamed, exactly as before receipts (a tester, 2026-11-29)
            store.stats.refused.append({"chain": tree, "to": child.id, "status": status})
            return status, text
        dt = time.monotonic() - t0
        nbytes = sum(store.manifest.chunks[i].wire_length for i in range(first, end))
        store.stats.pushes.append({"chain": tree, "pos": member, "to": child.id, "seconds": round(dt, 4),
                                   "bytes": nbytes, "receipt": receipt_of(text)})
        if self.on_pushed is not None:  # the learner's source: whoever acknowledged a whole span has it
            self.on_pushed(store.key, child.id, tree)
        log.info("%s: pushed %s[%d:%d] to %s in %.2f s (%.1f MiB/s)", self.id, store.key, first, end,
                 child.id, dt, nbytes / MIB / max(dt, 1e-9))
        return status, text

    # -- serving (every transport) --------------------------------------------------------------------
    async def open_pull(self, key: str, start: Any, end: Any = None) -> tuple[VersionStore, int, int]:
        """The store and chunk range of a pull request; `Refused` (404, 400) if it cannot be served."""
        store = await self._store_soon(key, min(self.stall_timeout, 5.0))
        if store is None or store.gone is not None:
            raise Refused(404, f"{self.id} does not hold {key[:64]!r}")  # a key is anyone's: bounded, escaped
        n = store.manifest.num_chunks
        try:
            start, end = int(start), n if end is None else int(end)
        except (TypeError, ValueError):
            raise Refused(400, "`from` and `to` must be chunk indices") from None
        if not 0 <= start <= end <= n:
            raise Refused(400, f"chunks [{start}, {end}) outside 0..{n}")
        return store, start, end

    async def serve_pull(self, store: VersionStore, start: int, end: int, write: Callable[[Buffer], Any],
                         holder: str | None = None) -> None:
        """A pull stream: `{"key", "start"}`, then chunks `start..end-1` as each is verified here.
        What a pull that ends early did not send is given back to `holder`'s share (`pulled`)."""
        guard = StallGuard(self.stall_timeout)
        # A pull is paced like the tree it fills (the route's rate), so a repairing child does
        # not flood the uplink this node shares with its own pushes.
        pace = store.pace(min(start, store.manifest.num_chunks - 1)) if end > start else None
        bucket = TokenBucket(pace) if pace else None
        sent = 0

        async def serve() -> None:
            nonlocal sent
            await write(frame_header({"key": store.key, "start": start}))
            async for piece in self._frames(store, start, end, guard, bucket):
                await write(piece)
                sent += len(piece)

        try:
            await guard.run(serve())
        finally:
            if holder in store.pulled_by:
                unsent = max(0, store.range_bytes(start, end) - sent)
                store.pulled_by[holder] = max(0, store.pulled_by[holder] - unsent)

    def manifest_wire(self, key: str) -> bytes | None:
        store = self.stores.get(key)
        return None if store is None else store.signed.to_wire()

    async def accept_push(self, reader: Any, peer: str | None, identity: Any) -> tuple[int, str]:
        return 404, f"{self.id} does not accept pushes"

    def push_ticket(self, child: str) -> str | None:
        """The read ticket presented on a push to node `child`: this node's own."""
        return self.read_token

    def require_read(self, presented: str | None, proof: Proof | None = None) -> str | None:
        """Refuse (401) a request for this node's versions without a valid read ticket of the run,
        or, with `proof` (a pull or a push over HTTP), without its holder's proof; the ticket's
        holder (None where this node checks no tickets)."""
        if self.readers is not None:
            try:
                return self.readers.holder(presented, proof)
            except Refused as e:
                raise Refused(401, f"{self.id}: {e.text}") from None
        return None

    def version_streams(self, store: VersionStore) -> tuple[list[VersionStore], int, int | None]:
        """The streams held of `store`'s version (full and delta), the larger's size, the version."""
        version = key_version(store.key)
        streams = [store, *(s for s in self.stores.values()
                            if s is not store and version is not None and key_version(s.key) == version)]
        return streams, max(s.manifest.wire_size for s in streams), version

    def pulled(self, store: VersionStore, holder: str | None, start: int, end: int) -> None:
        """A pull of chunks [start, end) of `store` by a ticket's holder is to begin: refused (429)
        past the holder's share of this version (`PULL_SHARE`), else counted, and the source tells
        `on_pull` (the learner blames the relay that should have forwarded them, `broadcast.forwarding`)."""
        if holder is None:
            return
        # A version's full and delta streams share one share, of the larger's size: counted per
        # stream, one holder took each twice, 3.5 versions' worth (a tester, 2026-11-29)
        streams, size, version = self.version_streams(store)
        served, wanted = sum(s.pulled_by.get(holder, 0) for s in streams), store.range_bytes(start, end)
        if served + wanted > PULL_SHARE * size:
            raise Refused(429, f"{self.id}: {holder[:64]!r} was served {served} B of version {version} by pull "
                               f"already, of {size} B; a worker needs a version once (at most {PULL_SHARE}× its "
                               "size, for repairs)")
        store.pulled_by[holder] = store.pulled_by.get(holder, 0) + wanted
        if self.on_pull is not None:
            self.on_pull(store.key, holder, start, end)

    async def _handle_status(self, request: web.Request) -> web.Response:
        """This node's versions, pushes and receipts: for its own machine (the learner's operator at
        the source, a worker's owner at its relay). Any ticket holder read every relay's stripe plan
        and receipts once it knew their addresses (an API-only tester, 2026-11-29)."""
        self.require_read(bearer(request))  # a `Refused` is answered by `refusals_returned`
        if request.remote not in ("127.0.0.1", "::1"):  # not all of 127/8: the hostile bench's attackers are there
            raise Refused(403, f"{self.id}: a node's status answers its own machine only")
        return web.json_response({"id": self.id, "url": self.url,
                                  "versions": {k: s.status() for k, s in self.stores.items()}})

    async def _handle_health(self, request: web.Request) -> web.Response:
        """What `broadcast.reach.probe_relay` fetches: proof that this node accepts connections."""
        return web.json_response({"id": self.id, "ok": True})


async def no_version_banner(request: web.Request, response: web.StreamResponse) -> None:
    """`Server: echo`, not aiohttp's `Python/3.x aiohttp/3.y.z`: which versions (and so which of
    their published faults) a server runs is none of a client's business."""
    response.headers["Server"] = "echo"


def _plain_text(status: int) -> web.Response:
    return web.Response(status=status, text=f"{status} {HTTPStatus(status).phrase}")


class _QuietParserErrors(RequestHandler):
    __slots__ = ()  # aiohttp's layout: a handler aiohttp made becomes one (`QuietRunner`)
    answer = staticmethod(_plain_text)
    rejected = None

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None, message: str | None = None):
        super().handle_error(request, status, exc, message)  # logs it, or raises where a reply already began
        if status == HTTPStatus.BAD_REQUEST and self.rejected is not None:
            self.rejected.labels("malformed-http").inc()
        response = self.answer(status)
        response.headers["Server"] = "echo"
        response.force_close()
        return response


class _Handlers:
    """aiohttp's protocol factory (its `web.Server`), each request handler it makes of class `cls`."""

    def __init__(self, server, cls: type):
        self.server, self.cls = server, cls

    def __getattr__(self, name):  # shutdown, connections, ...: the wrapped server's
        return getattr(self.server, name)

    def __call__(self, *args, **kwargs):
        handler = self.server(*args, **kwargs)
        try:
            handler.__class__ = self.cls
        except TypeError:  # another aiohttp, whose handler has another layout: its own answers, then
            pass
        return handler


class ConnectionCap:
    """aiohttp's protocol factory, with at most so many open connections per address:
    `limits(host)` names the keys a connection from `host` counts under, each with its limit
    (none: not counted). 24,000 idle connections from three addresses, each closed by the header
    timer only after 20 s, took the learner to its file-descriptor limit (accept() failing, an
    honest heartbeat waiting 7 s, the learner's own file opens failing); 21,000 on the broadcast
    source's port did the same later. A connection past a limit is closed as it opens."""

    def __init__(self, server, limits: Callable[[str], tuple[tuple[str, int], ...]]):
        self.server, self.limits = server, limits
        self.open: dict[str, int] = {}
        self.refused = 0

    def __getattr__(self, name):  # shutdown, connections, ...: the wrapped server's
        return getattr(self.server, name)

    def __call__(self, *args, **kwargs):
        return _Counted(self, self.server(*args, **kwargs))

    def opened(self, transport) -> tuple[str, ...] | None:
        """Count a new connection; close it if a key of its address holds too many. Its keys."""
        peer = transport.get_extra_info("peername")
        limits = self.limits(peer[0] if peer else "")
        for key, _ in limits:
            self.open[key] = self.open.get(key, 0) + 1
        if any(self.open[key] > limit for key, limit in limits):
            self.refused += 1
            transport.abort()
        return tuple(key for key, _ in limits)

    def closed(self, keys: tuple[str, ...] | None) -> None:
        for key in keys or ():
            left = self.open.get(key, 0) - 1
            if left > 0:
                self.open[key] = left
            else:
                self.open.pop(key, None)


class _Counted(asyncio.Protocol):
    """aiohttp's request handler (slotted, so not patched) behind a counting protocol."""

    def __init__(self, cap: ConnectionCap, handler):
        self.cap, self.handler, self.key = cap, handler, None

    def connection_made(self, transport) -> None:
        self.handler.connection_made(transport)
        self.key = self.cap.opened(transport)

    def connection_lost(self, exc) -> None:
        self.cap.closed(self.key)
        self.key = None
        self.handler.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.handler.data_received(data)

    def eof_received(self):
        return self.handler.eof_received()

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()


class QuietRunner(web.AppRunner):
    """An AppRunner whose request handlers answer what aiohttp's parser refuses (a bad method, a
    NUL in a header: before any route, middleware or `no_version_banner` runs) with
    `answer(status)` and `Server: echo`, counted in `rejected` (a Prometheus counter by reason) as
    `malformed-http`. aiohttp's own answer carried its version and echoed the rejected line back
    to the sender, and a bad method went uncounted (aiohttp logs it at debug level only).

    What a route leaves unread of a body is read after the answer up to `left_unread` bytes
    (`read_what_is_left`), not aiohttp's 10 s of lingering."""

    def __init__(self, app: web.Application, answer: Callable[[int], web.Response] | None = None, rejected=None,
                 limits: Callable[[str], tuple[tuple[str, int], ...]] | None = None,
                 left_unread: int = 16 << 20, **kwargs):
        app.middlewares.insert(0, read_what_is_left(left_unread))
        super().__init__(app, lingering_time=0, **kwargs)
        attrs = {"__slots__": (), "rejected": rejected, **({"answer": staticmethod(answer)} if answer else {})}
        self.handler_class = type("QuietParserErrors", (_QuietParserErrors,), attrs)
        self.limits = limits  # connections per address (`ConnectionCap`), or none

    async def _make_server(self):
        server = _Handlers(await super()._make_server(), self.handler_class)
        return ConnectionCap(server, self.limits) if self.limits else server


LINGER_S = 10.0  # aiohttp's lingering time: how long what is left of a body is read, at most


def read_what_is_left(most: int):
    """A middleware: what the route left unread of a request's body is read after the answer
    (a sender still sending then reads the answer, not a reset), up to `most` bytes within
    `LINGER_S`; then, still not at its end, the connection is closed (the runner's
    `lingering_time` is 0). aiohttp's own lingering read for 10 s whatever came: an endless
    chunked body to any route, `GET /v1/health` without a credential included, was read at
    2 GB/s, and four such connections took 0.9 of the learner's core (the API-only tester,
    2026-11-29). An honest body fits its route's bound, and this is that bound."""
    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        response = await handler(request)
        if request.content.is_eof():
            return response
        try:  # answered first: a sender that waits for `100 Continue` sends nothing more
            await response.prepare(request)
            await response.write_eof()
        except ConnectionError:
            return response
        loop, left = asyncio.get_running_loop(), most
        deadline = loop.time() + LINGER_S
        try:
            while left > 0 and (piece := await asyncio.wait_for(request.content.readany(), deadline - loop.time())):
                left -= len(piece)
        except Exception:  # timed out, cut, malformed: the answer is sent, and the connection closes
            pass
        return response
    return middleware


@web.middleware
async def refusals_returned(request: web.Request, handler) -> web.StreamResponse:
    """A refusal raised by a route (`Refused`, or aiohttp's `HTTPException`) answered as a
    response returned from here. Left to aiohttp, each raised one kept the request, its headers
    and the exception's frames in a reference cycle (~23 objects) for the collector: a hostile
    bench run's 8,500 weight requests without a ticket made the learner's clocked collections
    half as long again."""
    try:
        return await handler(request)
    except Refused as e:
        if e.status == 401:  # no valid read ticket: answered late (`Node.refusal_delay_s`)
            await asyncio.sleep(request.app[REFUSAL_DELAY])
        return web.Response(status=e.status, text=e.text)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return web.Response(status=e.status, text=e.text)
