"""Snapshot dissemination: versioned byte blobs as signed manifests + chunks, moved by chains.

Knows nothing of RL and never imports torch. Modules, one job each:
- `manifest`  — a version's manifest (chunks, hashes, tensor index) and its canonical bytes.
- `signing`   — ed25519 keys, signed manifests, `verify_chunk`.
- `delta`     — XOR+zstd deltas against the previous version, and decoding them.
- `links`     — link estimates: declared at join, refreshed by each transfer's goodput and RTT.
- `planner`   — predicted star / K-chain times from those links; picks the fastest plan.
- `route`     — the chosen plan as the version's signed route (who forwards to whom, how fast).
- `transport` — the wire format (msgpack header + raw payload), token bucket, stall guard.
- `relay`     — `Source` (learner) and `Relay` (worker): forward while receiving, verify, repair.
- `star`      — the plain star download (baseline).

Typical use. Learner::

    source = Source(SigningKey.load_or_generate(path)); await source.start()
    full, delta = await source.publish(blob, version, base=(prev_blob, prev_manifest))
    plan = plan_broadcast(len(blob), links.uplink.rate, [links.link(w) for w in ids], chunk_size)
    await source.push_plan(delta.manifest.key if delta else full.manifest.key, plan, hops)  # signs the route
    links.observe(worker_id, sample)  # each worker's relay.link_samples(), after the version

Worker::

    relay = Relay(worker_id, VerifyKey.from_text(learner_public_key), on_complete=install)
    await relay.start()   # advertise relay.url to the learner
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
    "Source": "broadcast.relay",
    "Relay": "broadcast.relay",
    "Received": "broadcast.relay",
    "BroadcastFailed": "broadcast.relay",
    "Hop": "broadcast.transport",
    "LinkTable": "broadcast.links",
    "LinkSample": "broadcast.links",
    "Route": "broadcast.route",
    "SignedRoute": "broadcast.route",
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
