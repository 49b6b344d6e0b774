"""The publisher: snapshot v → signed manifest + chunks → stripes, chains or a star push.

`star`: workers download each version over HTTP from the learner (`broadcast.star`), verified
by size and sha256. `chain`: each version is signed (ed25519) and chunked (`broadcast.Source`)
in chunks sized for it (`broadcast.planner.choose_chunk`: the snapshot size, the rates and the
hop count of the plan, at most `[broadcast] chunk_mib`), encoded as an XOR+zstd delta on the
previous version when that is smaller, planned from the workers' links (star push, K
bandwidth-sorted chains or stripes sized to uploads, whichever is predicted fastest;
`broadcast.planner`), and pushed with its plan as the signed route (`broadcast.route`): every
worker verifies each chunk, forwards it downstream at once and installs when the version is
complete. Workers the learner could not connect to at join (`WorkerInfo.reachable` False,
`broadcast.reach.probe_relay`; None, not probed yet, counts as reachable) are leaves of every
plan: they pull their share from a reachable parent over their own outbound connection (their
relays follow the learner's route feed), and their upload is not counted. Workers not trusted
with children (`broadcast.forwarding`: one whose work the learner never accepted, one whose
children pulled from the learner what it should have forwarded) are pushed to and forward to
nobody, for 2, 4, 8, ... versions. Links are what workers declared at join until their
transfers measure them: each worker reports its goodput per version and its heartbeat round
trip, and each push measures the learner's own uplink (`broadcast.links.LinkTable`). Workers
that miss a push (late joiners, a version they lack the base for) pull the full version from
the source.

The star store is kept in both designs: it serves the `/v1/snapshots` fallback and the tests.
`make_publisher` picks the design once from `[broadcast]` (a tagged union on `mode`). Both
designs speak the typed messages workers read (`echo.protocol`): `info`, the `BroadcastInfo`
told at join (final once `start()` returned), and `publish() -> Announcement`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import replace
from pathlib import Path

from broadcast.forwarding import Forwarding
from broadcast.links import MBIT, LinkTable, uplink_sample
from broadcast.manifest import MIN_CHUNK_SIZE, BroadcastError, Manifest
from broadcast.planner import PeerLink, plan_broadcast
from broadcast.route import Route
from broadcast.signing import SigningKey
from broadcast.source import Source
from broadcast.star import BlobStore
from broadcast.tickets import LEARNER, TICKET_S, TicketOffice
from broadcast.tickets import issue as issue_ticket
from broadcast.transport import Hop
from echo.protocol import Announcement, BroadcastInfo, PlanBrief, PushAnnouncement
from learner.config import ChainBroadcast, StarBroadcast

log = logging.getLogger("echo.learner.publisher")
#: Plan every upload at this share of its rate: a relay uploading at full rate slows its own
#: download (its ACKs queue behind its data); measured in `broadcast.planner.plan_broadcast`.
HEADROOM = 0.95


def make_publisher(section: ChainBroadcast | StarBroadcast, blobs: BlobStore, links: LinkTable, *,
                   key_file: Path, host: str, connection_limits=None, reports_s: float = 0.0,
                   publish_every: int = 1) -> "StarPublisher":
    """The publisher of the `[broadcast]` design (`learner.config.BroadcastSection`): `key_file`
    is the signing key used when the section names none, `host` where the learner's relay binds,
    `connection_limits` what one address may hold open there (`broadcast.node.ConnectionCap`),
    `reports_s` how long a relay's report of its pushes may take to arrive (a few heartbeats):
    a pull from the source is judged only after it (`broadcast.forwarding`), `publish_every` the
    updates between versions (demotions count published versions)."""
    if section.mode == "star":
        return StarPublisher(blobs)
    return ChainPublisher(blobs, chunk_bytes=int(section.chunk_mib * (1 << 20)), deltas=section.deltas,
                          links=links, key_file=section.key_file or key_file, host=host,
                          fallback_s=section.fallback_s, ticket_s=section.ticket_s,
                          connection_limits=connection_limits, reports_s=reports_s, publish_every=publish_every)


class StarPublisher:
    """`star`: each version is kept in the blob store, and workers download it whole."""

    mode = "star"

    def __init__(self, blobs: BlobStore):
        self.blobs = blobs
        self.wire_bytes: dict[int, dict] = {}  # version -> {"raw", "full", "delta", "plans"} (chain only)
        self.info = BroadcastInfo(mode="star")  # what workers are told at join (after start)
        self.tickets: TicketOffice | None = None  # chain: each worker's read ticket (broadcast.tickets)

    async def start(self) -> str | None:
        """Start serving; returns the learner's relay URL (None: nothing pushes)."""
        return None

    def gate_pulls(self, address_of, copies: int) -> None:
        """Star: the control API's downloads are counted per address there (`learner.api.status`)."""

    async def publish(self, version: int, blob: bytes, workers: list) -> Announcement:
        """Publish `version`; returns what to announce to workers."""
        digest = await asyncio.to_thread(lambda: hashlib.sha256(blob).hexdigest())  # not on the event loop
        info = self.blobs.add(version, blob, sha256=digest)
        return Announcement(version=info.version, size=info.size, sha256=info.sha256)

    async def stop(self) -> None:
        pass


class ChainPublisher(StarPublisher):
    """`chain`: signed, chunked versions pushed along planned chains (module docstring); the star
    store still serves the full-version fallback."""

    mode = "chain"

    def __init__(self, blobs: BlobStore, *, chunk_bytes: int, deltas: bool, links: LinkTable, key_file: Path,
                 host: str, fallback_s: float = 10.0, ticket_s: float = TICKET_S, connection_limits=None,
                 reports_s: float = 0.0, publish_every: int = 1):
        super().__init__(blobs)
        self.connection_limits = connection_limits
        self.chunk_bytes, self.deltas, self.links = chunk_bytes, deltas, links
        self.key_file, self.host, self.fallback_s, self.ticket_s = key_file, host, fallback_s, ticket_s
        self.source: Source | None = None
        self.public_key = ""
        self._previous: tuple[int, bytes, Manifest] | None = None
        self.pushes: set[asyncio.Task] = set()
        self.forwarding = Forwarding(grace_s=reports_s, keep_s=2 * fallback_s + 2 * reports_s, every=publish_every)
        self._planned: dict = {}  # the workers of the latest plans, by id (the registry's live records)
        self.routed: frozenset[str] = frozenset()  # who the latest version's pushes go to (or pull along)

    async def start(self) -> str | None:
        key = SigningKey.load_or_generate(self.key_file)
        self.public_key = key.public_key().to_text()
        # The source guards the versions with read tickets: each worker gets its own at join and
        # in heartbeat replies (the registry's `tickets`); on its pushes the source presents one
        # good at the relay pushed to only (`Source.push_ticket`).
        self.source = Source(key, host=self.host, port=0, up_rate=self.links.uplink.rate,
                             read_token=issue_ticket(key, LEARNER), connection_limits=self.connection_limits)
        assert self.source.readers is not None
        self.source.readers.skew = 0.0  # the source's clock is the one that issued them
        self.tickets = TicketOffice(key, self.source.readers, lifetime=self.ticket_s)
        self.source.on_pull = self._pulled
        self.source.on_pushed = self.forwarding.pushed
        url = await self.source.start()
        self.info = BroadcastInfo(mode="chain", public_key=self.public_key, source=url, fallback_s=self.fallback_s)
        return url

    async def publish(self, version: int, blob: bytes, workers: list) -> PushAnnouncement:
        """Publish `version` and start pushing it; returns what to announce to workers."""
        star = await super().publish(version, blob, workers)
        assert self.source is not None and self.tickets is not None, "start() the publisher first"
        for worker, until in self.forwarding.settle(version):
            log.warning("%s: children it was to forward to pulled from the learner instead; it is a leaf "
                        "(forwards to nobody) until v%d", worker, until)
        self._planned = {w.id: w for w in workers}
        chunk = self.chunk_for(len(blob), [w for w in workers if w.relay_url], version)
        # A delta needs its base's chunk layout: when the plan's chunk size changed, this version
        # goes out full once and the next ones are deltas on it again.
        same_layout = (self._previous is not None and len(self._previous[1]) == len(blob)
                       and self._previous[2].chunk_size == chunk)
        base = (self._previous[1], self._previous[2]) if self.deltas and same_layout else None
        full, delta = await self.source.publish(blob, version, chunk_size=chunk, base=base)
        self._previous = (version, blob, full.manifest)
        # A delta only helps workers that hold its base; anyone else gets the full version.
        base_version = delta.manifest.base_version if delta else None
        on_base = [w for w in workers if w.relay_url and w.version == base_version]
        rest = [w for w in workers if w.relay_url and w.version != base_version]
        plans, routed = {}, set()
        groups = [(key, group, manifest) for key, group, manifest in (
            (delta.manifest.key if delta else None, on_base, delta.manifest if delta else None),
            (full.manifest.key, rest, full.manifest)) if key is not None and group]
        for key, group, manifest in groups:
            peers = self.peers(group, version)
            plan = plan_broadcast(manifest.wire_size, self.links.uplink.rate, peers, chunk, headroom=HEADROOM)
            try:
                route = self.source.route_of(key, plan, {w.id: Hop(w.id, w.relay_url) for w in group})
            except BroadcastError as e:  # nothing pushed: the workers' fallback pull repairs it
                log.warning("no route for %s: %s", key, e)
                continue
            self.forwarding.planned(route)  # before the push: its pulls are blamed on this route
            routed.update(w.id for w in group)
            # Two groups share the uplink, each planned as if it had it all: only a lone push measures it.
            task = asyncio.create_task(self._push(key, route, measure_uplink=len(groups) == 1))
            self.pushes.add(task)
            task.add_done_callback(self.pushes.discard)
            plans[key] = {**plan.summary(), "chains": [list(c) for c in plan.chains], "pull": list(plan.pull),
                          "bytes": manifest.wire_size, "parents": [list(p) for p in plan.parents],
                          "shares": list(plan.shares),
                          "links_mbit": {p.id: [round(p.down / MBIT, 1), round(p.up / MBIT, 1)] for p in peers},
                          "uplink_mbit": round(self.links.uplink.rate / MBIT, 1)}
        self.wire_bytes[version] = {"raw": len(blob), "chunk": chunk, "full": full.manifest.wire_size,
                                    "delta": delta.manifest.wire_size if delta else None, "plans": plans,
                                    "demoted": self.forwarding.leaves(version)}
        self.routed = frozenset(routed)
        return PushAnnouncement(
            **star.model_dump(), key=full.manifest.key, delta_key=delta.manifest.key if delta else None,
            source=self.source.url,
            plan={k: PlanBrief(kind=v["kind"], chains=len(v["chains"]), predicted_s=v["predicted_s"])
                  for k, v in plans.items()})

    def gate_pulls(self, address_of, copies: int) -> None:
        """At most `copies` of each version by pull from the source to the workers of one address
        (`address_of`: a worker id's address key, None for one the learner does not know)."""
        assert self.source is not None, "start() the publisher first"
        self.source.address_of, self.source.copies_per_address = address_of, copies

    def _pulled(self, key: str, holder: str, start: int, end: int) -> None:
        """A pull from the source blames the puller's parent only if the learner accepted the
        puller's work: a fresh identity placed as a tail cannot demote the relay above it."""
        w = self._planned.get(holder)
        if w is not None and w.groups_accepted > 0:
            self.forwarding.pulled(key, holder, start, end)

    def peers(self, workers: list, version: int) -> list[PeerLink]:
        """The planner's view of `workers` for `version`: measured links and whether they accept
        connections. A worker not trusted with children (its work never accepted, or a leaf for
        failing to forward: `broadcast.forwarding`) is planned with no upload: pushed to, as a
        chain's tail or a stripe's receiver, and forwarding to nobody."""
        out = []
        for w in workers:
            link = self.links.link(w.id)
            trusted = w.groups_accepted > 0 and self.forwarding.may_forward(w.id, version)
            out.append(replace(link, up=link.up if trusted else 0.0, reachable=w.reachable is not False))
        return out

    def chunk_for(self, size: int, workers: list, version: int) -> int:
        """This version's chunk size: what the fastest plan for all workers wants, at most the
        configured `chunk_bytes` (the planner's pick is bounded by `broadcast.planner.choose_chunk`)."""
        if not workers:
            return self.chunk_bytes
        plan = plan_broadcast(size, self.links.uplink.rate, self.peers(workers, version), None, headroom=HEADROOM)
        return max(MIN_CHUNK_SIZE, min(plan.chunk_bytes, self.chunk_bytes))

    async def _push(self, key: str, route: Route, measure_uplink: bool) -> None:
        try:
            await self.source.push_route(key, route)
        except Exception as e:  # a failed push is repaired by the workers' fallback pull
            log.warning("push of %s failed: %s", key, e)
            return
        store = self.source.stores.get(key)
        route = store.route.route if store is not None and store.route is not None else None
        sample = uplink_sample(store.stats, route.rates) if route is not None and measure_uplink else None
        if sample is not None:  # the pushes measured the learner's own uplink
            self.links.observe_uplink(sample)

    async def stop(self) -> None:
        for task in list(self.pushes):
            task.cancel()
        if self.source is not None:
            await self.source.stop()
