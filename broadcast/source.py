"""The learner's node: publish signed versions, push them along a plan's trees, and keep the
signed routes where relays that cannot be pushed to (behind NAT) fetch them.

`GET /bcast/v1/routes?after=<seq>&id=<node>` is that feed: a long poll answering, as soon as
there is one, every signed route newer than `seq` in which `node` pulls, each with its signed
manifest (msgpack list of `{"seq", "manifest", "route"}`; empty after `wait` seconds). The
relay verifies both signatures; the feed is a convenience, not trusted.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, Callable, Mapping, Sequence

import msgpack
from aiohttp import web

from broadcast.manifest import DEFAULT_CHUNK_SIZE, BroadcastError, Buffer, Manifest, TensorEntry, build_manifest
from broadcast.node import Node
from broadcast.planner import Plan
from broadcast.route import Route, SignedRoute, chunk_spans, route_for, sign_route
from broadcast.signing import SignedManifest, SigningKey, sign_manifest
from broadcast.store import VersionStore
from broadcast.tickets import LEARNER, Readers, issue
from broadcast.transport import PREFIX, Hop, Refused, bearer

FEED_WAIT_S = 20.0  # how long one long poll of the route feed waits for a route
FEED_KEEP = 16  # routes the feed remembers
COPIES_PER_ADDRESS = 32  # versions' worth one address's holders may pull (the learner: 2 × max_workers_per_address)


class Source(Node):
    """The learner side: publish signed versions and push them down the trees of a route."""

    def __init__(self, signing_key: SigningKey, node_id: str = "source", **kwargs: Any) -> None:
        kwargs.setdefault("keep_versions", 4)  # current and previous version, full and delta each
        # The learner's libp2p identity is its signing key: workers derive its peer ID from the
        # public key they already hold (`libp2p_transport.peer_id`), and noise proves it.
        kwargs.setdefault("p2p_key", signing_key)
        super().__init__(node_id, **kwargs)
        self.signing_key = signing_key
        self.verify_key = signing_key.public_key()
        if self.read_token:  # guarded: the learner revokes a quarantined worker here (readers.revoke)
            self.readers = Readers(self.verify_key, me=self.id)
        # Per address, what all its ticket holders pulled of a version (`pulled`): a holder's share
        # alone was renewed by each identity the address joined as.
        self.address_of: Callable[[str], str | None] | None = None  # a holder's address key (the learner's registry)
        self.copies_per_address = COPIES_PER_ADDRESS
        self._feed: deque[tuple[int, SignedManifest, SignedRoute]] = deque(maxlen=FEED_KEEP)
        self._seq = 0
        self._feed_changed: asyncio.Condition | None = None
        self._closing = False

    def pulled(self, store: VersionStore, holder: str | None, start: int, end: int) -> None:
        """As every node (a holder's share of the version), and at most `copies_per_address` of the
        version by pull to all the holders of one address: an address that joined as a new
        identity for each copy took the whole model from the learner's uplink without end."""
        address = self.address_of(holder) if holder is not None and self.address_of is not None else None
        if address is None:
            return super().pulled(store, holder, start, end)
        streams, size, version = self.version_streams(store)
        served, wanted = sum(s.pulled_from.get(address, 0) for s in streams), store.range_bytes(start, end)
        if served + wanted > self.copies_per_address * size:
            raise Refused(429, f"{self.id}: the workers at {address} were served {served} B of version {version} by "
                               f"pull already, {self.copies_per_address} copies of its {size} B; pull it from a "
                               "peer, or wait for the next version")
        super().pulled(store, holder, start, end)
        store.pulled_from[address] = store.pulled_from.get(address, 0) + wanted

    def push_ticket(self, child: str) -> str | None:
        """A ticket good at `child` only (`broadcast.tickets`): the learner's own would read the
        weights here for any relay that copied it from a push."""
        if not self.read_token:
            return None
        return issue(self.signing_key, LEARNER, audience=child)

    async def stop(self) -> None:
        self._closing = True  # long polls of the route feed answer now, so the server can close
        if self._feed_changed is not None:
            async with self._feed_changed:
                self._feed_changed.notify_all()
        await super().stop()

    def _routes(self) -> list[web.RouteDef]:
        return super()._routes() + [web.get(PREFIX + "/routes", self._handle_routes, allow_head=False)]

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
            from broadcast.delta import encode_delta, join_payloads  # numpy/zstd only when deltas are used

            encoded = await asyncio.to_thread(encode_delta, blob, base[0], full_m, base[1])
            if encoded is not None:
                delta = sign_manifest(self.signing_key, encoded[0])
                await self.add(delta, join_payloads(*encoded))
        return full, delta

    async def push(self, key: str, chains: Sequence[Sequence[Hop]], rates: Sequence[float | None] | None = None,
                   *, paced: bool | None = None, plan: Mapping[str, Any] | None = None) -> list[bool]:
        """Push version `key` down K chains (one stream to each head), at `rates` per chain.

        `paced` (default: whenever rates are given) makes every member forward at its chain's
        rate. Returns once every head stream has ended: True per chain whose head received it all.
        """
        store = self._store(key)
        chains = [list(c) for c in chains if c]
        if rates is not None and len(rates) != len(chains):
            raise BroadcastError(f"{len(rates)} rates for {len(chains)} chains")
        paced = rates is not None if paced is None else paced
        return await self.push_route(key, route_for(store.manifest, self.hop, chains, rates, paced=paced,
                                                    plan=dict(plan or {})))

    async def push_route(self, key: str, route: Route) -> list[bool]:
        """Sign `route` (it travels with every stream and is what each relay forwards by), publish
        it on the route feed, and push each tree to its members whose parent is the source.
        Returns once those streams have ended: True per stream whose receiver took it all
        (members that pull fetch their spans themselves). The rest completes on its own."""
        store = self._store(key)
        signed = sign_route(self.signing_key, route)
        store.route = signed
        if route.pull:
            await self._announce(store.signed, signed)
        pushes = [self._spawn(store, self._push(store, signed, t, m)) for t in range(len(route.chains))
                  for m in route.roots(t) if route.chains[t][m].id not in route.pull]
        return list(await asyncio.gather(*pushes))

    async def push_plan(self, key: str, plan: Plan, hops: Mapping[str, Hop], *, pace: bool = True) -> list[bool]:
        """Push version `key` along a `broadcast.planner.Plan`; `hops` maps worker id → Hop.

        With `pace`, every tree is fed at the plan's rate for it (so a slow tree cannot take
        uplink a faster one could use) and its relays forward at that rate too; plan with
        `headroom` < 1 (e.g. 0.95) so that rate stays below the links' capacity. A star is never
        paced (TCP shares the uplink fairly). The plan's summary is signed into the route.
        """
        return await self.push_route(key, self.route_of(key, plan, hops, pace=pace))

    def route_of(self, key: str, plan: Plan, hops: Mapping[str, Hop], *, pace: bool = True) -> Route:
        """The route of version `key` along `plan`: stripe shares become chunk spans."""
        store = self._store(key)
        missing = sorted({w for tree in plan.chains for w in tree if w not in hops})
        if missing:
            raise BroadcastError(f"plan names workers with no known address: {missing}; re-plan without them")
        trees = [[hops[w] for w in tree] for tree in plan.chains]
        rates, parents, spans = list(plan.rates), plan.parents or None, None
        if plan.shares:  # each group of trees splits the whole version by its shares
            groups = plan.groups or (0,) * len(trees)
            spans = [(0, 0)] * len(trees)
            for g in sorted(set(groups)):
                mine = [t for t in range(len(trees)) if groups[t] == g]
                for t, span in zip(mine, chunk_spans(store.manifest.num_chunks, [plan.shares[t] for t in mine])):
                    spans[t] = span
            keep = [t for t, (a, b) in enumerate(spans) if b > a]  # stripes too small for one chunk
            trees, rates, spans = [trees[t] for t in keep], [rates[t] for t in keep], [spans[t] for t in keep]
            parents = [parents[t] for t in keep] if parents else None
        return route_for(store.manifest, self.hop, trees, rates, paced=pace and plan.kind != "star",
                         plan=plan.summary(), spans=spans, parents=parents, pull=plan.pull)

    def _store(self, key: str) -> VersionStore:
        store = self.stores.get(key)
        if store is None:
            raise BroadcastError(f"{key} is not published here; publish() it first")
        return store

    # -- the route feed -----------------------------------------------------------------------------
    async def _announce(self, manifest: SignedManifest, route: SignedRoute) -> None:
        if self._feed_changed is None:
            self._feed_changed = asyncio.Condition()
        async with self._feed_changed:
            self._seq += 1
            self._feed.append((self._seq, manifest, route))
            self._feed_changed.notify_all()

    async def _handle_routes(self, request: web.Request) -> web.Response:
        self.require_read(bearer(request))
        try:
            after = int(request.query.get("after", "0"))
            wait = float(request.query.get("wait", FEED_WAIT_S))
            if not wait >= 0.0:  # NaN too: asyncio's timer made it a 500 and a traceback, each request
                raise ValueError
            wait = min(wait, 60.0)
        except ValueError:
            raise web.HTTPBadRequest(text="`after` is a sequence number, `wait` seconds (at least 0)") from None
        node = request.query.get("id", "")
        if self._feed_changed is None:
            self._feed_changed = asyncio.Condition()

        def news() -> list[dict]:
            return [{"seq": seq, "manifest": m.to_wire(), "route": r.to_wire()} for seq, m, r in self._feed
                    if seq > after and node in r.route.pull]

        async with self._feed_changed:
            try:
                await asyncio.wait_for(self._feed_changed.wait_for(lambda: news() or self._seq < after or self._closing), wait)
            except asyncio.TimeoutError:
                pass
            items = news()
        # `seq` tells the follower where the feed stands (and if the learner restarted: it went back).
        return web.Response(body=msgpack.packb({"seq": self._seq, "items": items}, use_bin_type=True),
                            content_type="application/msgpack")
