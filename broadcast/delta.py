"""XOR deltas: send a version as its byte-wise XOR against the previous one, zstd-compressed.

Between consecutive snapshots only a few percent of the elements change, so `new XOR base` is
mostly zero bytes and zstd shrinks it 5–80× (see the measurements in tests and the report).

Choices, and why:
- **Per-chunk choice.** Each chunk travels as the smaller of its raw bytes and its compressed
  XOR. Updates concentrate in some tensors (embeddings, norms), so a whole-version switch would
  waste what the sparse parts save; the chunk entry already carries its encoding, so the choice
  costs nothing. On top of that, `encode_delta` returns None when the whole delta would save
  less than `min_saving` — then the learner publishes only the full version.
- **Same chunk layout as the full version.** A delta chunk decodes to exactly the content of the
  full version's chunk `i` (`content_hash` is shared), so full and delta share one `root`, and a
  receiver checks each decoded chunk against it.
- **Exact base.** A delta names its base by version and root; decoding checks the receiver's base
  manifest root first (`BaseMismatch` otherwise) — a receiver without that base (late joiner,
  missed version) fetches the full version instead (key "v{version}").
- Plain XOR bytes, no byte-plane shuffle: measured on synthetic float32/bf16 updates, shuffling
  helped bf16 a little and hurt float32, so it is not worth a third encoding.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
import zstandard as zstd

from broadcast.manifest import (
    BroadcastError,
    Buffer,
    ChunkEntry,
    Manifest,
    _as_bytes_view,
    chunk_hash,
)
from broadcast.signing import ChunkCorrupt

DEFAULT_LEVEL = 1  # level 3 compressed no better on XOR deltas and was slower at 20% changes
DEFAULT_MIN_SAVING = 0.10


class DeltaError(BroadcastError):
    """A delta cannot be built or applied (layouts differ, wrong buffer sizes)."""


class BaseMismatch(DeltaError):
    """The receiver's base is not the exact base the delta was made against."""


def _xor(a: Buffer, b: Buffer, out: Buffer | None = None) -> np.ndarray:
    """Byte-wise XOR of two equal-length buffers (numpy releases the GIL for this)."""
    x = np.frombuffer(a, dtype=np.uint8)
    y = np.frombuffer(b, dtype=np.uint8)
    if out is None:
        return np.bitwise_xor(x, y)
    return np.bitwise_xor(x, y, out=np.frombuffer(out, dtype=np.uint8))


def _threads(n_chunks: int) -> int:
    return max(1, min(n_chunks, os.cpu_count() or 1))


def encode_delta(
    blob: Buffer,
    base_blob: Buffer,
    full: Manifest,
    base: Manifest,
    *,
    level: int = DEFAULT_LEVEL,
    min_saving: float = DEFAULT_MIN_SAVING,
) -> tuple[Manifest, list[Buffer]] | None:
    """Encode `blob` (whose full manifest is `full`) as a delta on `base_blob` (manifest `base`).

    Returns the delta manifest and the wire payload of each chunk (compressed bytes, or a view
    of `blob` where raw is smaller), or None when the delta saves less than `min_saving` of the
    full size. Blocking and CPU-bound (zstd and XOR run in a thread pool, GIL released): call it
    via `asyncio.to_thread` from async code.
    """
    view, base_view = _as_bytes_view(blob), _as_bytes_view(base_blob)
    if full.base_version is not None or base.base_version is not None:
        raise DeltaError("encode_delta takes the full (raw) manifests of the new version and of its base")
    if full.total_size != base.total_size or full.chunk_size != base.chunk_size:
        raise DeltaError(f"v{full.version} ({full.total_size} B, chunks of {full.chunk_size}) and base "
                         f"v{base.version} ({base.total_size} B, chunks of {base.chunk_size}) differ in "
                         "layout; publish the full version instead")
    if len(view) != full.total_size or len(base_view) != base.total_size:
        raise DeltaError("blob sizes do not match their manifests")

    def encode(c: ChunkEntry) -> tuple[Buffer, ChunkEntry]:
        raw = view[c.offset:c.offset + c.length]
        if c.content_hash == base.chunks[c.index].content_hash:
            xored = bytes(c.length)  # unchanged chunk: XOR is all zeros, skip the arithmetic
        else:
            xored = _xor(raw, base_view[c.offset:c.offset + c.length])
        packed = zstd.ZstdCompressor(level=level).compress(xored)
        if len(packed) >= c.length:
            return raw, c  # incompressible change: the chunk travels raw (wire offset fixed below)
        return packed, ChunkEntry(c.index, c.offset, c.length, 0, len(packed), "xor-zstd",
                                  chunk_hash(packed), c.content_hash)

    with ThreadPoolExecutor(_threads(full.num_chunks)) as pool:
        encoded = list(pool.map(encode, full.chunks))
    wire_size = sum(len(p) for p, _ in encoded)
    if wire_size > (1.0 - min_saving) * full.total_size:
        return None
    payloads, chunks, pos = [], [], 0
    for p, c in encoded:
        payloads.append(p)
        chunks.append(ChunkEntry(c.index, c.offset, c.length, pos, c.wire_length, c.encoding,
                                 c.hash, c.content_hash))
        pos += c.wire_length
    manifest = Manifest(version=full.version, total_size=full.total_size, chunk_size=full.chunk_size,
                        root=full.root, chunks=tuple(chunks), tensors=full.tensors, encoding="xor-zstd",
                        base_version=base.version, base_root=base.root)
    return manifest, payloads


def join_payloads(manifest: Manifest, payloads: Sequence[Buffer]) -> bytearray:
    """The payloads in one wire buffer laid out by `manifest` (what a relay holds and serves).

    For a raw full version the blob itself is already that buffer; do not call this for it.
    """
    if len(payloads) != manifest.num_chunks:
        raise DeltaError(f"{len(payloads)} payloads for {manifest.num_chunks} chunks of {manifest.key}")
    out = bytearray(manifest.wire_size)
    for c, p in zip(manifest.chunks, payloads):
        out[c.wire_offset:c.wire_offset + c.wire_length] = p
    return out


def check_base(manifest: Manifest, base: Manifest | None) -> None:
    """Raise `BaseMismatch` unless `base` is the exact base `manifest` was encoded against."""
    if manifest.base_version is None:
        return
    if base is None:
        raise BaseMismatch(f"{manifest.key} is a delta on v{manifest.base_version} and this node has no "
                           f"base; fetch the full version v{manifest.version} instead")
    if base.version != manifest.base_version or base.root != manifest.base_root:
        raise BaseMismatch(f"{manifest.key} needs base v{manifest.base_version} "
                           f"(root {manifest.base_root.hex()[:12]}), this node holds v{base.version} "
                           f"(root {base.root.hex()[:12]}); fetch the full version v{manifest.version}")


def decode(
    manifest: Manifest,
    wire: Buffer,
    base_blob: Buffer | None = None,
    base: Manifest | None = None,
    out: Buffer | None = None,
) -> memoryview:
    """Materialise the content blob of `manifest` from its wire buffer.

    A raw version is returned as a view of `wire` (no copy). A delta needs the exact base (its
    manifest `base` and bytes `base_blob`); each decoded chunk is checked against the signed
    content hash (`ChunkCorrupt`), so a wrong base blob cannot slip through even if its manifest
    matched. `out` may be a preallocated writable buffer of `total_size` bytes. Blocking: run it
    via `asyncio.to_thread` (or `decode_async`).
    """
    wire_view = _as_bytes_view(wire)
    if len(wire_view) != manifest.wire_size:
        raise DeltaError(f"wire buffer is {len(wire_view)} B, {manifest.key} needs {manifest.wire_size}")
    if manifest.encoding == "raw":
        return wire_view
    check_base(manifest, base)
    assert base_blob is not None, "a delta needs base_blob"
    base_view = _as_bytes_view(base_blob)
    if len(base_view) != manifest.total_size:
        raise DeltaError(f"base blob is {len(base_view)} B, expected {manifest.total_size}")
    out_view = _as_bytes_view(out) if out is not None else memoryview(bytearray(manifest.total_size))
    if len(out_view) != manifest.total_size or out_view.readonly:
        raise DeltaError(f"out must be a writable buffer of {manifest.total_size} bytes")

    def decode_one(c: ChunkEntry) -> None:
        src = wire_view[c.wire_offset:c.wire_offset + c.wire_length]
        dst = out_view[c.offset:c.offset + c.length]
        if c.encoding == "raw":
            dst[:] = src
        else:
            try:
                xored = zstd.ZstdDecompressor().decompress(src, max_output_size=c.length)
            except zstd.ZstdError as e:
                raise ChunkCorrupt(manifest.key, c.index, f"zstd: {e}") from e
            if len(xored) != c.length:
                raise ChunkCorrupt(manifest.key, c.index, f"decompressed to {len(xored)} B, expected {c.length}")
            _xor(xored, base_view[c.offset:c.offset + c.length], out=dst)
        if chunk_hash(dst) != c.content_hash:
            raise ChunkCorrupt(manifest.key, c.index, "decoded content does not match (wrong base bytes?)")

    with ThreadPoolExecutor(_threads(manifest.num_chunks)) as pool:
        list(pool.map(decode_one, manifest.chunks))
    return out_view


async def decode_async(manifest: Manifest, wire: Buffer, base_blob: Buffer | None = None,
                       base: Manifest | None = None, out: Buffer | None = None) -> memoryview:
    """`decode` off the event loop."""
    return await asyncio.to_thread(decode, manifest, wire, base_blob, base, out)
