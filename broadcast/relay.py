"""The worker's relay: receive a version chunk by chunk, verify, forward while receiving, repair.

A `Relay` accepts one inbound stream per tree of a version's signed route (`broadcast.route`;
one tree down a chain, one per stripe in striped mode), verifies the signed manifest and route,
then each chunk, writes it into a preallocated buffer of the whole version
(`broadcast.store.VersionStore`) and forwards it to its children in that tree as soon as it is
verified (`broadcast.node`). Receiving never waits for forwarding: forwarders read verified
chunks from the buffer at their own pace, so chunk k+1 arrives while chunk k leaves, a slow
child delays no one upstream, and memory is bounded by the one buffer.

Repair: when an inbound stream breaks, stalls past `stall_timeout` or delivers a corrupt chunk,
the relay pulls the rest of that span (from its first missing chunk, never from zero) from the
nearest ancestor in that tree other than the failed one, walking up to the source. A span no
stream arrives for within `stall_timeout` is pulled the same way. A corrupt chunk is never
committed, so it is never forwarded; its sender is skipped. A version is reported complete only
when every chunk is verified: no node ends with a half-installed version.

Reachability: a relay that cannot accept inbound connections (NAT; the learner probes it at
join, `broadcast.reach`) is marked as pulling in the routes. It follows the learner's route feed
(`follow(source_url)`, an outbound long poll) and pulls each of its spans from its parent over
an outbound connection, with the same verification and repair.

Over libp2p, pushes are authenticated: noise proves the sender's peer ID, which must be the one
the signed route binds to the sender the stream names; otherwise the stream is refused and the
relay pulls from its route parent instead (`broadcast.libp2p_transport`).

This module re-exports what workers import: `Relay`, `Source`, `Received`, `BroadcastError`,
`BroadcastFailed`, `Hop`, `PREFIX`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import ipaddress
import json
import logging
import signal
import time
from typing import Any, Callable, Sequence

import aiohttp

from broadcast.addresses import connection_limits
from broadcast.manifest import BroadcastError
from broadcast.node import MIB, Node
from broadcast.receipts import receipt
from broadcast.route import Place, Route, RouteError, SignedRoute
from broadcast.signing import ChunkCorrupt, SignatureError, SignedManifest, VerifyKey, verify_chunk
from broadcast.source import Source
from broadcast.store import BroadcastFailed, Received, TransferStats, VersionGone, VersionStore
from broadcast.tickets import Readers
from broadcast.transport import (
    PREFIX,
    TRANSPORTS,
    Hop,
    PeerError,
    ProtocolError,
    Refused,
    StallGuard,
    Stalled,
    TokenBucket,
    read_header,
    read_into,
)

log = logging.getLogger("echo.broadcast")
#: Chunks below this size are hashed on the event loop (~30 us per 64 KiB), bigger ones in a thread.
INLINE_VERIFY_BYTES = 1 << 20
MAX_DELIVERIES = 32  # pushes reported per heartbeat (echo.protocol.Report.deliveries: at most 32)
#: Open connections one address (an IPv6 /64) may hold at a relay. A relay's readers are the few
#: children its routes give it and the learner's probe, a connection or two each; with no limit,
#: one address holding thousands idle would take the worker's file descriptors, and its relay
#: would refuse its own children. The worker's own machine (loopback) is not counted.
CONNECTIONS_PER_ADDRESS = 64
LOOPBACK = [ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128")]
#: Errors of a stream to or from one peer: the peer is bad or gone, the relay carries on.
PEER_ERRORS = (ProtocolError, Stalled, Refused, PeerError, aiohttp.ClientError, OSError, asyncio.TimeoutError)

__all__ = ["PREFIX", "BroadcastError", "BroadcastFailed", "Hop", "Received", "Relay", "Source", "TransferStats",
           "VersionGone", "VersionStore", "main"]


class Relay(Node):
    """A worker's relay: receives, verifies and forwards versions; repairs around dead peers.

    `on_complete(received)` is called once per fully verified version (install from
    `received.data`; see `broadcast.delta.decode`). `wait(key)` awaits the same. With
    `source_url` (the learner's broadcast URL, http), the relay follows the learner's route feed,
    so it receives versions even when nobody can connect to it (see the module docstring).
    """

    def __init__(
        self,
        node_id: str,
        verify_key: VerifyKey,
        *,
        on_complete: Callable[[Received], Any] | None = None,
        down_rate: float | None = None,
        max_source_retries: int = 3,
        source_url: str | None = None,
        receipt_key: bytes | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("connection_limits", connection_limits(CONNECTIONS_PER_ADDRESS, LOOPBACK))
        super().__init__(node_id, **kwargs)
        self.verify_key = verify_key
        if self.read_token:  # a relay of a guarded run serves the run's ticket holders only
            self.readers = Readers(verify_key, me=self.id)
        self.on_complete = on_complete
        self.down = TokenBucket(down_rate) if down_rate else None
        self.max_source_retries = max_source_retries
        self.source_url = source_url
        self.receipt_key = receipt_key  # signs the receipts of pushes taken whole (broadcast.receipts)
        self._arrivals: dict[str, asyncio.Future] = {}
        self._follower: asyncio.Task | None = None

    async def start(self) -> str:
        url = await super().start()
        if self.source_url:
            self.follow(self.source_url)
        return url

    async def stop(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            with contextlib.suppress(BaseException):
                await self._follower
        await super().stop()

    # -- waiting for versions ------------------------------------------------------------------
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

    def deliveries(self, limit: int = MAX_DELIVERIES) -> list[tuple[str, str, int, str]]:
        """(version key, child, tree, the child's receipt or "") of the pushes children took
        whole from this relay, and of those they refused or broke (no receipt), newest versions
        first (report them to the learner)."""
        out = []
        for store in reversed(self.stores.values()):
            out += [(store.key, p["to"], p["chain"], p.get("receipt", "")) for p in store.stats.pushes]
            out += [(store.key, p["to"], p["chain"], "") for p in store.stats.refused]  # tried: its word only
        return out[:limit]

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
        signed = None
        for peer in peers:
            try:
                wire = await (await self.transport_for(peer.url)).manifest(peer.url, key)
            except (*PEER_ERRORS, BroadcastError):
                continue
            if wire is not None:
                signed = SignedManifest.from_wire(wire, self.verify_key)
                break
        if signed is None:
            raise BroadcastFailed(f"no peer of {[p.id for p in peers]} serves {key}")
        if signed.manifest.key != key:
            raise BroadcastFailed(f"asked for {key}, got a manifest for {signed.manifest.key}")
        if key in self.stores:  # a push began meanwhile
            return await self.wait(key)
        store = await self._new_store(signed)
        store.inbound[0] = "pull"
        await self._spawn(store, self._fill(store, 0, list(peers), -1, "fetch", repair=False))
        return await self.wait(key)

    def pulled(self, store: VersionStore, holder: str | None, start: int, end: int) -> None:
        """Only the members below this relay in the version's route pull it from here (a NAT
        child, a repair walking up its ancestors), and only the spans of the trees they are
        below it in: 16 sybil identities took their two versions' worth each from an honest
        worker's relay, 157 MB in 75 s of its upload (a tester, 2026-11-28), and a member below
        it in one stripe could still take every stripe. A version this relay got with no route
        (pulled by itself) is served to no ticket holder: nobody can be below it there."""
        if holder is not None and store.route is None:
            raise Refused(403, f"{self.id}: {store.key} came to this relay without a route, so nobody pulls it "
                               "from here; pull from your own parents or from the learner's source")
        if holder is not None:
            if store.below is None:  # once a version: a route of 1,000 workers is walked once, not per pull
                store.below = _below(store.route.route, self.id, store.manifest.num_chunks)
            spans = store.below.get(holder)
            if spans is None:
                raise Refused(403, f"{self.id}: {holder[:64]!r} is not below this relay in {store.key}'s route; "
                                   "pull from your own parents or from the learner's source")
            if not any(a <= start and end <= b for a, b in spans):
                raise Refused(403, f"{self.id}: {holder[:64]!r} is below this relay in {store.key}'s route for "
                                   f"chunks {list(spans)[:4]} only, not [{start}, {end}); pull the rest from its "
                                   "parents there or from the learner's source")
        super().pulled(store, holder, start, end)

    # -- following the learner's route feed (relays nobody can connect to) -------------------------
    def follow(self, source_url: str) -> asyncio.Task:
        """Long-poll the learner's route feed (`broadcast.source`) and pull every version whose
        route marks this relay as pulling. Idempotent; stopped by `stop()`."""
        self.source_url = source_url
        if self._follower is None or self._follower.done():
            self._follower = asyncio.ensure_future(self._follow(source_url.rstrip("/")))
        return self._follower

    async def _follow(self, url: str) -> None:
        try:
            transport = await self.transport_for(url)
        except BroadcastError as e:
            log.warning("%s: cannot follow the route feed of %s: %s", self.id, url, e)
            return
        after = 0
        while True:
            try:
                feed = await transport.route_feed(url, after, self.id)
                if feed["seq"] < after:  # the learner restarted: its sequence began again
                    after = 0
                    continue
                for item in feed["items"]:
                    after = max(after, int(item["seq"]))
                    await self._take_route(item["manifest"], item["route"])
            except asyncio.CancelledError:
                raise
            except NotImplementedError as e:
                log.warning("%s: cannot follow the route feed of %s: %s", self.id, url, e)
                return
            except Exception as e:  # noqa: BLE001 - the learner restarting, a bad item: retry
                log.info("%s: route feed of %s: %s: %s", self.id, url, type(e).__name__, e)
                await asyncio.sleep(1.0)

    async def _take_route(self, manifest_wire: Any, route_wire: Any) -> None:
        try:
            signed = SignedManifest.from_wire(manifest_wire, self.verify_key)
            route = SignedRoute.from_wire(route_wire, self.verify_key)
            route.route.check(signed.manifest)
            places = route.route.places(self.id, signed.manifest.num_chunks)
        except (SignatureError, RouteError) as e:
            self.emit("route_rejected", peer="feed", error=str(e))
            return
        if signed.manifest.key not in self.stores:
            await self._open_version(signed, route, places)

    # -- receiving ----------------------------------------------------------------------------
    async def _new_store(self, signed: SignedManifest, route: SignedRoute | None = None,
                         places: list[Place] | None = None) -> VersionStore:
        store = VersionStore(signed)
        if route is not None:  # before it is registered: a pull waiting for it checks its route
            store.set_spans([p.span for p in places or []])
            store.route, store.route_wire, store.places = route, route.to_wire(), places or []
        store = await self._add_store(store)
        fut = self._arrivals.pop(store.key, None)
        if fut is not None and not fut.done():
            fut.set_result(store)
        return store

    def _received(self, store: VersionStore) -> Received:
        return Received(store.manifest, store.signed, store.buffer, store.stats)

    async def _open_version(self, signed: SignedManifest, route: SignedRoute, places: list[Place]) -> VersionStore:
        """Hold a version received along `route`: one span per tree this relay is in; start
        forwarding each to its children; pull the spans no push will bring."""
        r = route.route
        # Its route set before it is registered: a child's pull waiting for the version woke in
        # between and was refused for "a version that came without a route" (an honest stripe
        # owner, then blamed for its leaf's repair from the source; an API-only tester's run).
        store = await self._new_store(signed, route, places)
        rates = [r.rates[p.tree] for p in places]
        store.stats.offered_rate = None if None in rates else sum(rates)
        pulling = self.id in r.pull
        for p in places:
            for child in p.children:
                if r.chains[p.tree][child].id not in r.pull:
                    self._spawn(store, self._push(store, route, p.tree, child))
            s = store.span_of(p.span[0])
            store.span_rates[s] = r.pace(p.tree)
            if pulling:  # nobody can connect to us: pull this span from our parent
                store.inbound[s] = "pull"
                self._spawn(store, self._fill(store, s, list(p.ancestors), -1, "pull", repair=False))
            else:
                self._spawn(store, self._expect_push(store, s, p))
        return store

    def _known(self, header: dict) -> VersionStore | None:
        """The store whose signed manifest and route are byte for byte the stream's: a striped
        version arrives as one stream per tree, and each need not be verified and parsed again."""
        manifest, route = header.get("manifest"), header.get("route")
        for store in self.stores.values():
            if (store.route is not None and store.places and store.manifest_wire == manifest
                    and store.route_wire == route):
                return store
        return None

    async def _expect_push(self, store: VersionStore, s: int, place: Place) -> None:
        """Pull span `s` from the ancestors if no push for it has begun within twice the stall
        timeout. Twice: a busy parent opens its many stripe streams late, and a pull that
        starts behind can only follow at its tree's rate, never catch up."""
        with contextlib.suppress(asyncio.TimeoutError, BroadcastError):  # ends early once whole (or gone)
            await asyncio.wait_for(asyncio.shield(store.done), 2 * self.stall_timeout)
        if s not in store.inbound and store.gone is None:
            store.inbound[s] = "pull"
            await self._fill(store, s, list(place.ancestors), -1, "no push arrived")

    async def accept_push(self, reader: Any, peer: str | None, identity: Any) -> tuple[int, str]:
        """An inbound push, whatever its transport: verify the signed manifest and route, find
        this node's place in the stream's tree, start forwarding, receive; repair if it fails.

        `identity(sender_hop, route)` (authenticating transports) says why the stream's proven
        peer is not the sender the route names, or None. Returns the reply as (HTTP status,
        text): 200 received all, 409 already held or being pulled, 400/403 refused, 502 the
        stream failed (the rest is being pulled elsewhere).
        """
        step = "manifest"
        try:
            header = await asyncio.wait_for(read_header(reader), self.stall_timeout)
            known = self._known(header)  # the version's other trees: verified and parsed already
            if known is not None:
                signed, route, places = known.signed, known.route, known.places
            else:
                signed = SignedManifest.from_wire(header["manifest"], self.verify_key)
                step = "route"
                route = SignedRoute.from_wire(header["route"], self.verify_key)
                route.route.check(signed.manifest)
                places = route.route.places(self.id, signed.manifest.num_chunks)
            r = route.route
            tree = header.get("tree", places[0].tree)
            place = next((p for p in places if p.tree == tree), None)
            if place is None:
                raise RouteError(f"{self.id} is not in tree {tree!r} of the route of {r.key}")
            # Ancestors start at the sender: the members between it and us were routed around.
            sender = [h.id for h in place.ancestors].index(header.get("from"))  # ValueError: not our upstream
            stranger = identity(place.ancestors[sender], r) if identity is not None else None
        except (SignatureError, RouteError) as e:
            self.emit(f"{step}_rejected", peer=peer, error=str(e))
            return 403 if isinstance(e, SignatureError) else 400, str(e)
        except (ProtocolError, PeerError, KeyError, TypeError, ValueError, asyncio.TimeoutError) as e:
            return 400, f"bad stream header: {type(e).__name__}: {e}"
        key = signed.manifest.key
        store = self.stores.get(key)
        if store is None:
            store = await self._open_version(signed, route, places)
        elif store.route is None or store.route.body != route.body:
            return 409, f"{self.id} already has or is receiving {key}"
        s = store.span_of(place.span[0])
        if s in store.inbound or store.next[s] >= place.span[1]:
            return 409, f"{self.id} already has or is receiving {key}[{place.span[0]}:{place.span[1]}]"
        if stranger is not None:
            # Not the sender the route names: refuse its bytes, pull from our route parent ourselves.
            self.emit("sender_rejected", key=key, peer=peer, error=stranger)
            store.inbound[s] = "pull"
            self._spawn(store, self._fill(store, s, list(place.ancestors), -1, "pull", repair=False))
            return 409, f"refused: {stranger}; pulling from {place.ancestors[0].id} instead"
        store.inbound[s] = "push"
        store.stats.spans.append({"first": place.span[0], "by": "push", "from": header.get("from"), "t": time.time()})
        ancestors = list(place.ancestors[sender:])
        if await self._receive(store, reader, s, ancestors[0]):
            reply: dict[str, Any] = {"have": store.have}
            if self.receipt_key:
                reply["receipt"] = receipt(self.receipt_key, key, place.tree, ancestors[0].id, self.id)
            return 200, json.dumps(reply)
        if store.gone is None:  # a bad upstream, not our own shutdown: fetch the rest elsewhere
            self._spawn(store, self._fill(store, s, ancestors, 0, store.last_failure))
        return 502, f"inbound stream failed at chunk {store.next[s]}"

    async def _receive(self, store: VersionStore, reader: Any, s: int, parent: Hop) -> bool:
        """Read chunk frames of span `s` (from its first missing chunk) until it is whole; False on
        any failure. Failures are reported (events, stats) and never raised: the caller repairs."""
        guard = StallGuard(self.stall_timeout, pace=store.span_rates[s])  # a trickling parent is a stalled one
        if s == store.main_span:
            store.stats.parent = parent.id
        try:
            await guard.run(self._read_chunks(store, reader, guard, s))
        except ChunkCorrupt as e:
            store.stats.corrupt.append({"t": time.time(), "index": e.index, "from": parent.id, "reason": e.reason})
            self.emit("chunk_corrupt", key=store.key, index=e.index, sender=parent.id, reason=e.reason)
            store.last_failure = f"corrupt chunk {e.index} from {parent.id}"
            return False
        except (ProtocolError, Stalled, PeerError, aiohttp.ClientError, OSError) as e:
            store.last_failure = f"{type(e).__name__}: {e}"
            self.emit("inbound_failed", key=store.key, sender=parent.id, have=store.have, error=store.last_failure)
            return False
        if store.complete:
            self._complete(store)
        return True

    async def _read_chunks(self, store: VersionStore, reader: Any, guard: StallGuard, s: int) -> None:
        m = store.manifest
        end = store.spans[s][1]
        while store.next[s] < end:
            header = await read_header(reader)
            guard.touch()
            if store.stats.t_first_chunk is None:
                store.stats.t_first_chunk = time.time()
            try:
                i, n = int(header["i"]), int(header["n"])
            except (KeyError, TypeError, ValueError) as e:
                raise ProtocolError(f"bad chunk header {header!r}") from e
            if i != store.next[s]:  # streams are in order from the first chunk we lack
                raise ProtocolError(f"expected chunk {store.next[s]}, got {i}")
            if n != m.chunks[i].wire_length:
                raise ChunkCorrupt(m.key, i, f"announced {n} B, manifest says {m.chunks[i].wire_length}")
            view = store.view(i)
            await read_into(reader, view, guard, self.down)
            store.stats.bytes_in += n
            if n >= INLINE_VERIFY_BYTES:
                await asyncio.to_thread(verify_chunk, m, i, view)  # blake3 releases the GIL
            else:  # a thread hop costs more than hashing a small chunk
                verify_chunk(m, i, view)
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

    async def _fill(self, store: VersionStore, s: int, ancestors: list[Hop], failed_index: int, reason: str,
                    *, repair: bool = True) -> None:
        """Pull the rest of span `s` from the nearest ancestor after `failed_index`, walking up.

        The last ancestor (the source) is retried with backoff before giving up. `repair=False`:
        a planned pull (a relay nobody can push to, a late joiner), not counted as a repair.
        """
        idx, source_tries = failed_index + 1, 0
        end = store.spans[s][1]
        store.stats.spans.append({"first": store.spans[s][0], "by": reason, "t": time.time()})
        while store.next[s] < end and store.gone is None:
            if idx >= len(ancestors):
                if not ancestors or source_tries >= self.max_source_retries:
                    err = BroadcastFailed(f"{store.key}: no ancestor could deliver the rest ({reason}); "
                                          "staying on the previous version")
                    self.emit("failed", key=store.key, have=store.have, error=str(err))
                    await store.close(err)
                    return
                idx, source_tries = len(ancestors) - 1, source_tries + 1
                await asyncio.sleep(min(0.5 * 2 ** source_tries, 5.0))
            hop, resume = ancestors[idx], store.next[s]
            if repair:
                store.stats.repairs.append({"t": time.time(), "reason": reason, "via": hop.id, "from": resume})
                self.emit("repair", key=store.key, via=hop.id, resume_from=resume, reason=reason)
            try:
                transport = await self.transport_for(hop.url)
                async with transport.pull(hop.url, store.key, resume, end, audience=hop.id) as reader:
                    if await self._receive(store, reader, s, hop):
                        return
                reason = store.last_failure
            except (*PEER_ERRORS, BroadcastError) as e:
                if isinstance(e, VersionGone):
                    return
                reason = f"{hop.id} unreachable: {type(e).__name__}: {e}"
            repair = True  # a planned pull that failed: what follows is repair
            idx += 1


def _below(route: Route, node_id: str, num_chunks: int) -> dict[str, tuple[tuple[int, int], ...]]:
    """The members that have `node_id` among their ancestors in some tree of `route`, each with
    the chunk spans of those trees (adjacent ones merged)."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for t, chain in enumerate(route.chains):
        parents, span = route.parent_list(t), route.span(t, num_chunks)
        mine = {pos for pos, hop in enumerate(chain) if hop.id == node_id}
        for pos, p in enumerate(parents):  # parents come before their children in a tree's list
            if p in mine:
                mine.add(pos)
                spans.setdefault(chain[pos].id, []).append(span)
    out = {}
    for member, held in spans.items():
        merged: list[tuple[int, int]] = []
        for a, b in sorted(held):
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        out[member] = tuple(merged)
    return out


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
    p.add_argument("--source-url", default=None, help="follow the learner's route feed (relays behind NAT)")
    args = p.parse_args(argv)

    def print_event(record: dict) -> None:
        print(json.dumps(record, default=str), flush=True)

    async def run() -> None:
        relay = Relay(args.id, VerifyKey.from_text(args.public_key), host=args.host, port=args.port,
                      up_rate=args.up_rate, down_rate=args.down_rate, stall_timeout=args.stall_timeout,
                      on_event=print_event, transport=args.transport, source_url=args.source_url)
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
