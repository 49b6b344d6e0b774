"""The publisher: snapshot v → signed manifest + chunks → K chains (or the star download).

`star`: workers download each version over HTTP from the learner (`broadcast.star`), verified
by size and sha256. `chain`: each version is signed (ed25519) and chunked (`broadcast.Source`),
encoded as an XOR+zstd delta on the previous version when that is smaller, planned from the
workers' links (star push or K bandwidth-sorted chains, whichever is predicted faster;
`broadcast.planner`), and pushed with its plan as the signed route (`broadcast.route`): every
worker verifies each chunk, forwards it downstream at once and installs when the version is
complete. Links are what workers declared at join until their transfers measure them: each
worker reports its goodput per version and its heartbeat round trip, and each push measures
the learner's own uplink (`broadcast.links.LinkTable`). Workers that miss a push (late
joiners, a version they lack the base for) pull the full version from the source.

The star store is kept in both modes: it serves the `/v1/snapshots` fallback and the tests.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from broadcast.links import MBIT, LinkTable, uplink_sample
from broadcast.manifest import Manifest
from broadcast.planner import plan_broadcast
from broadcast.relay import Source
from broadcast.signing import SigningKey
from broadcast.transport import Hop
from broadcast.star import BlobStore

log = logging.getLogger("echo.learner.publisher")
#: Plan every upload at this share of its rate: a relay uploading at full rate slows its own
#: download (its ACKs queue behind its data); measured in `broadcast.planner.plan_broadcast`.
HEADROOM = 0.95


class Publisher:
    def __init__(self, blobs: BlobStore, mode: str, *, chunk_bytes: int, deltas: bool, links: LinkTable,
                 key_file: Path, host: str):
        self.blobs, self.mode = blobs, mode
        self.chunk_bytes, self.deltas, self.links = chunk_bytes, deltas, links
        self.key_file, self.host = key_file, host
        self.source: Source | None = None
        self.public_key = ""
        self._previous: tuple[int, bytes, Manifest] | None = None
        self.pushes: set[asyncio.Task] = set()
        self.wire_bytes: dict[int, dict] = {}  # version -> {"raw", "full", "delta", "plans"}

    async def start(self) -> str | None:
        if self.mode != "chain":
            return None
        key = SigningKey.load_or_generate(self.key_file)
        self.public_key = key.public_key().to_text()
        self.source = Source(key, host=self.host, port=0, up_rate=self.links.uplink.rate)
        return await self.source.start()

    async def publish(self, version: int, blob: bytes, workers: list) -> dict:
        """Publish `version` and start pushing it; returns what to announce to workers."""
        info = self.blobs.add(version, blob)
        announcement = info.to_json()
        if self.source is None:
            return announcement
        same_layout = self._previous is not None and len(self._previous[1]) == len(blob)
        base = (self._previous[1], self._previous[2]) if self.deltas and same_layout else None
        full, delta = await self.source.publish(blob, version, chunk_size=self.chunk_bytes, base=base)
        self._previous = (version, blob, full.manifest)
        # A delta only helps workers that hold its base; anyone else gets the full version.
        base_version = delta.manifest.base_version if delta else None
        on_base = [w for w in workers if w.relay_url and w.version == base_version]
        rest = [w for w in workers if w.relay_url and w.version != base_version]
        plans = {}
        groups = [(key, group, manifest) for key, group, manifest in (
            (delta.manifest.key if delta else None, on_base, delta.manifest if delta else None),
            (full.manifest.key, rest, full.manifest)) if key is not None and group]
        for key, group, manifest in groups:
            peers = [self.links.link(w.id) for w in group]
            plan = plan_broadcast(manifest.wire_size, self.links.uplink.rate, peers, self.chunk_bytes, headroom=HEADROOM)
            hops = {w.id: Hop(w.id, w.relay_url) for w in group}
            # Two groups share the uplink, each planned as if it had it all: only a lone push measures it.
            task = asyncio.create_task(self._push(key, plan, hops, measure_uplink=len(groups) == 1))
            self.pushes.add(task)
            task.add_done_callback(self.pushes.discard)
            plans[key] = {**plan.summary(), "chains": [list(c) for c in plan.chains],
                          "links_mbit": {p.id: [round(p.down / MBIT, 1), round(p.up / MBIT, 1)] for p in peers},
                          "uplink_mbit": round(self.links.uplink.rate / MBIT, 1)}
        self.wire_bytes[version] = {"raw": len(blob), "full": full.manifest.wire_size,
                                    "delta": delta.manifest.wire_size if delta else None, "plans": plans}
        announcement.update(key=full.manifest.key, delta_key=delta.manifest.key if delta else None,
                            source=self.source.url,
                            plan={k: {"kind": v["kind"], "chains": len(v["chains"]), "predicted_s": v["predicted_s"]}
                                  for k, v in plans.items()})
        return announcement

    async def _push(self, key: str, plan, hops: dict, measure_uplink: bool) -> None:
        try:
            await self.source.push_plan(key, plan, hops)
        except Exception as e:  # a failed push is repaired by the workers' fallback pull
            log.warning("push of %s failed: %s", key, e)
            return
        store = self.source.stores.get(key)
        sample = uplink_sample(store.stats, plan.rates) if store is not None and measure_uplink else None
        if sample is not None:  # the pushes measured the learner's own uplink
            self.links.observe_uplink(sample)

    async def stop(self) -> None:
        for task in list(self.pushes):
            task.cancel()
        if self.source is not None:
            await self.source.stop()
