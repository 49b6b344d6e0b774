"""The publisher: snapshot v → signed manifest + chunks → K chains (or the star download).

`star`: workers download each version over HTTP from the learner (`broadcast.star`), verified
by size and sha256. `chain`: each version is signed (ed25519) and chunked (`broadcast.Source`),
encoded as an XOR+zstd delta on the previous version when that is smaller, planned from the
workers' declared links (star push or K bandwidth-sorted chains, whichever is predicted
faster; `broadcast.planner`), and pushed: every worker verifies each chunk, forwards it
downstream at once and installs when the version is complete. Workers that miss a push (late
joiners, a version they lack the base for) pull the full version from the source.

The star store is kept in both modes: it serves the `/v1/snapshots` fallback and the tests.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from broadcast.manifest import Manifest
from broadcast.planner import PeerLink, plan_broadcast
from broadcast.relay import Source
from broadcast.signing import SigningKey
from broadcast.transport import Hop
from broadcast.star import BlobStore

log = logging.getLogger("echo.learner.publisher")
MBIT = 1e6 / 8  # bytes/s per Mbit/s
UNKNOWN_LINK_MBIT = 1000.0  # planning assumption for a worker that declared no bandwidth


class Publisher:
    def __init__(self, blobs: BlobStore, mode: str, *, chunk_bytes: int, deltas: bool, uplink_mbit: float,
                 key_file: Path, host: str):
        self.blobs, self.mode = blobs, mode
        self.chunk_bytes, self.deltas, self.uplink = chunk_bytes, deltas, uplink_mbit * MBIT
        self.key_file, self.host = key_file, host
        self.source: Source | None = None
        self.public_key = ""
        self._previous: tuple[int, bytes, Manifest] | None = None
        self.pushes: set[asyncio.Task] = set()
        self.wire_bytes: dict[int, dict] = {}  # version -> {"raw", "full", "delta", "sent", "plan"}

    async def start(self) -> str | None:
        if self.mode != "chain":
            return None
        key = SigningKey.load_or_generate(self.key_file)
        self.public_key = key.public_key().to_text()
        self.source = Source(key, host=self.host, port=0, up_rate=self.uplink)
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
        sent = 0
        plans = {}
        for key, group, manifest in ((delta.manifest.key if delta else None, on_base, delta.manifest if delta else None),
                                     (full.manifest.key, rest, full.manifest)):
            if key is None or not group:
                continue
            peers = [PeerLink(w.id, (w.download_mbit or UNKNOWN_LINK_MBIT) * MBIT,
                              (w.upload_mbit or UNKNOWN_LINK_MBIT) * MBIT) for w in group]
            # Plan at 95% of the links: a relay uploading at full rate slows its own download (ACKs).
            plan = plan_broadcast(manifest.wire_size, self.uplink, peers, self.chunk_bytes, headroom=0.95)
            hops = {w.id: Hop(w.id, w.relay_url) for w in group}
            task = asyncio.create_task(self._push(key, plan, hops))
            self.pushes.add(task)
            task.add_done_callback(self.pushes.discard)
            sent += manifest.wire_size * len(group)
            plans[key] = {"kind": plan.kind, "chains": len(plan.chains), "predicted_s": round(plan.predicted_s, 4)}
        self.wire_bytes[version] = {"raw": len(blob), "full": full.manifest.wire_size,
                                    "delta": delta.manifest.wire_size if delta else None, "plans": plans}
        announcement.update(key=full.manifest.key, delta_key=delta.manifest.key if delta else None,
                            source=self.source.url)
        return announcement

    async def _push(self, key: str, plan, hops: dict) -> None:
        try:
            await self.source.push_plan(key, plan, hops)
        except Exception as e:  # a failed push is repaired by the workers' fallback pull
            log.warning("push of %s failed: %s", key, e)

    async def stop(self) -> None:
        for task in list(self.pushes):
            task.cancel()
        if self.source is not None:
            await self.source.stop()
