"""Snapshot dissemination: versioned byte blobs as signed manifests + chunks, moved by stripes,
chains or a star, whichever is predicted fastest.

Knows nothing of RL and never imports torch. Modules, one job each:
- `manifest`  — a version's manifest (chunks, hashes, tensor index) and its canonical bytes.
- `signing`   — ed25519 keys, the signed envelope, signed manifests, `verify_chunk`.
- `delta`     — XOR+zstd deltas against the previous version, and decoding them.
- `links`     — link estimates: declared at join, refreshed by each transfer's goodput and RTT.
- `planner`   — predicted star / K-chain / stripe times from those links; the chunk size; picks.
- `route`     — the chosen plan as the version's signed route (trees, their chunk spans, rates).
- `transport` — the wire format (msgpack header + raw payload), token bucket, stall guard, and
  the `Transport` interface; `http_transport` and `libp2p_transport` implement it by URL scheme.
- `store`     — one version on one node: the buffer, what is verified per span.
- `node`      — what every node does: serve versions, push along a route's trees.
- `source`    — the learner's node: publish, push a plan, the route feed for unreachable relays.
- `relay`     — the worker's node: receive, verify, forward while receiving, repair, pull.
- `reach`     — can the learner connect to a relay (the join probe)?
- `star`      — the plain star download (baseline).
- `bench/`    — the benchmark drivers (`echo-rl bench broadcast`), not library code.

Typical use. Learner::

    source = Source(SigningKey.load_or_generate(path)); await source.start()
    full, delta = await source.publish(blob, version, base=(prev_blob, prev_manifest))
    plan = plan_broadcast(len(blob), links.uplink.rate, [links.link(w) for w in ids])  # picks the chunk too
    await source.push_plan(delta.manifest.key if delta else full.manifest.key, plan, hops)  # signs the route
    links.observe(worker_id, sample)  # each worker's relay.link_samples(), after the version

Worker::

    relay = Relay(worker_id, VerifyKey.from_text(learner_public_key), on_complete=install,
                  source_url=learner_broadcast_url)  # follows the route feed: works behind NAT
    await relay.start()   # advertise relay.url to the learner, which probes it (`reach.probe_relay`)
"""

from broadcast.manifest import (
    DEFAULT_CHUNK_SIZE,
    BroadcastError,
    ChunkEntry,
    Manifest,
    ManifestError,
    TensorEntry,
    build_manifest,
)
from broadcast.planner import PeerLink, Plan, PlanError, plan_broadcast
from broadcast.signing import (
    ChunkCorrupt,
    SignatureError,
    SignedManifest,
    SigningKey,
    VerifyKey,
    sign_manifest,
    verify_chunk,
)

_LAZY = {  # heavier imports (aiohttp, numpy) load on first use
    "Source": "broadcast.source",
    "Relay": "broadcast.relay",
    "Received": "broadcast.relay",
    "BroadcastFailed": "broadcast.relay",
    "Hop": "broadcast.transport",
    "LinkTable": "broadcast.links",
    "LinkSample": "broadcast.links",
    "Route": "broadcast.route",
    "SignedRoute": "broadcast.route",
    "probe_relay": "broadcast.reach",
    "encode_delta": "broadcast.delta",
    "decode": "broadcast.delta",
    "BaseMismatch": "broadcast.delta",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'broadcast' has no attribute {name!r}")


__all__ = [
    "DEFAULT_CHUNK_SIZE", "BroadcastError", "ChunkEntry", "Manifest", "ManifestError", "TensorEntry",
    "build_manifest", "PeerLink", "Plan", "PlanError", "plan_broadcast", "ChunkCorrupt", "SignatureError",
    "SignedManifest", "SigningKey", "VerifyKey", "sign_manifest", "verify_chunk", *_LAZY,
]
