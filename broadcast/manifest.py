"""Manifests: what a published snapshot version is, chunk by chunk.

A snapshot is one opaque byte blob (the caller decides what is in it; the tensor index below is
metadata we carry, never interpret). The blob is cut into fixed-size chunks; each chunk is what
the relay moves, verifies and forwards as one unit. The manifest lists every chunk with a fast
hash (blake3) so a receiver can check each chunk before forwarding or installing it; the
learner signs the manifest's canonical bytes (`broadcast.signing`).

Two layouts matter:
- the *content* layout: chunk `i` covers `blob[offset : offset + length]`;
- the *wire* layout: chunk `i` travels as `wire_length` bytes (equal to `length` for "raw",
  smaller for "xor-zstd" deltas, see `broadcast.delta`). A receiver stores the wire bytes of
  chunk `i` at `wire_offset` in one preallocated buffer of `wire_size` bytes, so a relay never
  needs to decode to forward, and for a raw version that buffer *is* the blob.

Identity: `root` is a hash over the chunk content hashes (a one-level Merkle root), so the full
and the delta encodings of the same version share it, and a delta names its exact base by the
base's root without anyone re-hashing gigabytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Literal, Sequence

import blake3
import msgpack

Encoding = Literal["raw", "xor-zstd"]
ENCODINGS: tuple[str, ...] = ("raw", "xor-zstd")

MIB = 1 << 20
DEFAULT_CHUNK_SIZE = 4 * MIB
#: Chunks of 1–4 MiB are the intended range; the wider bounds let tests use small blobs and
#: keep a manifest (about 100 bytes per chunk) far below the frame-header limit of the relay.
MIN_CHUNK_SIZE = 64 * 1024
MAX_CHUNK_SIZE = 64 * MIB
HASH_BYTES = 32
FORMAT = 2  # 2: a raw chunk travels as its hash alone (its offsets and length follow from its index)

Buffer = bytes | bytearray | memoryview


class BroadcastError(Exception):
    """Base of every error raised by `broadcast`."""


class ManifestError(BroadcastError, ValueError):
    """A manifest is malformed or inconsistent (bad field, wrong sizes, unknown encoding)."""


def chunk_hash(data: Buffer) -> bytes:
    """The fast chunk hash used everywhere in `broadcast` (blake3, 32 bytes).

    blake3 releases the GIL, so callers hashing big buffers can run this in a thread.
    """
    return blake3.blake3(data).digest()


def content_root(total_size: int, chunk_size: int, content_hashes: Iterable[bytes]) -> bytes:
    """Identity of a blob: blake3 over its size, chunking and per-chunk content hashes."""
    h = blake3.blake3(b"echo-root-v1\0")
    h.update(total_size.to_bytes(8, "big"))
    h.update(chunk_size.to_bytes(8, "big"))
    for ch in content_hashes:
        h.update(ch)
    return h.digest()


@dataclass(frozen=True)
class TensorEntry:
    """One tensor inside the blob: opaque metadata for the installer (broadcast never reads it)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    length: int

    def to_wire(self) -> list:
        return [self.name, self.dtype, list(self.shape), self.offset, self.length]

    @classmethod
    def from_wire(cls, raw: Sequence) -> "TensorEntry":
        try:
            name, dtype, shape, offset, length = raw
            return cls(str(name), str(dtype), tuple(int(s) for s in shape), int(offset), int(length))
        except (TypeError, ValueError) as e:
            raise ManifestError(f"bad tensor entry {raw!r}: expected [name, dtype, shape, offset, length]") from e


@dataclass(frozen=True)
class ChunkEntry:
    """One chunk: where its content lives in the blob, and how it travels on the wire.

    `hash` is blake3 of the wire bytes (checked before forwarding); `content_hash` is blake3 of
    the decoded bytes (equal to `hash` for raw chunks; checked after decoding a delta).
    """

    index: int
    offset: int
    length: int
    wire_offset: int
    wire_length: int
    encoding: Encoding
    hash: bytes
    content_hash: bytes

    def to_wire(self) -> list:
        return [self.index, self.offset, self.length, self.wire_offset, self.wire_length,
                self.encoding, self.hash, self.content_hash]

    @classmethod
    def from_wire(cls, raw: Sequence) -> "ChunkEntry":
        try:
            index, offset, length, wire_offset, wire_length, encoding, h, ch = raw
            return cls(int(index), int(offset), int(length), int(wire_offset), int(wire_length),
                       str(encoding), bytes(h), bytes(ch))  # type: ignore[arg-type]
        except (TypeError, ValueError) as e:
            raise ManifestError(f"bad chunk entry {raw!r}: expected 8 fields") from e


def _chunks_from_wire(raw: Sequence, chunk_size: int, total_size: int) -> tuple[ChunkEntry, ...]:
    """Chunk entries from their wire form: a raw chunk as its hash, others as full entries
    (`Manifest._validate` then checks the whole layout)."""
    out, wire = [], 0
    for i, c in enumerate(raw):
        if isinstance(c, bytes):
            offset = i * chunk_size
            length = max(0, min(chunk_size, total_size - offset))
            entry = ChunkEntry(i, offset, length, wire, length, "raw", c, c)
        else:
            entry = ChunkEntry.from_wire(c)
        out.append(entry)
        wire = entry.wire_offset + entry.wire_length
    return tuple(out)


@dataclass(frozen=True)
class Manifest:
    """Everything a receiver needs to fetch, verify and install one version.

    Invariants (checked in `__post_init__`, so a parsed manifest is always consistent):
    chunk `i` has index `i`; content offsets are `i * chunk_size` and lengths `chunk_size`
    except the last; wire offsets are contiguous; raw chunks have `wire_length == length` and
    `hash == content_hash`; `encoding` is "raw" iff `base_version` is None.
    """

    version: int
    total_size: int
    chunk_size: int
    root: bytes
    chunks: tuple[ChunkEntry, ...]
    tensors: tuple[TensorEntry, ...] = ()
    encoding: Encoding = "raw"
    base_version: int | None = None
    base_root: bytes | None = None
    format: int = FORMAT
    _wire_size: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._validate()
        last = self.chunks[-1] if self.chunks else None
        object.__setattr__(self, "_wire_size", last.wire_offset + last.wire_length if last else 0)

    # -- identity and sizes -------------------------------------------------------------
    @property
    def key(self) -> str:
        """Stream key: "v7" for a full version, "v7-d6" for version 7 as a delta on 6."""
        return f"v{self.version}" if self.base_version is None else f"v{self.version}-d{self.base_version}"

    @property
    def wire_size(self) -> int:
        """Bytes that travel (sum of wire lengths); equals `total_size` for a raw version."""
        return self._wire_size

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    # -- canonical serialization ----------------------------------------------------------
    def to_bytes(self) -> bytes:
        """Canonical bytes (msgpack, fixed field order): the exact bytes the learner signs."""
        doc = {
            "format": self.format,
            "version": self.version,
            "base_version": self.base_version,
            "base_root": self.base_root,
            "encoding": self.encoding,
            "total_size": self.total_size,
            "chunk_size": self.chunk_size,
            "root": self.root,
            "tensors": [t.to_wire() for t in self.tensors],
            # A raw chunk is just its hash: everything else follows from its index, the chunk size
            # and the contiguous wire layout. A 16 GB version in 4 MiB chunks: 130 KB instead of 370.
            "chunks": [c.hash if c.encoding == "raw" else c.to_wire() for c in self.chunks],
        }
        return msgpack.packb(doc, use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: Buffer) -> "Manifest":
        """Parse and validate; raises `ManifestError` on anything malformed."""
        try:
            doc = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as e:  # msgpack raises several unrelated types
            raise ManifestError(f"manifest is not valid msgpack: {e}") from e
        if not isinstance(doc, dict):
            raise ManifestError("manifest must be a msgpack map")
        try:
            if doc["format"] != FORMAT:
                raise ManifestError(f"manifest format {doc['format']} unsupported (this code reads {FORMAT}); "
                                    "upgrade the worker to the learner's echo version")
            return cls(
                version=int(doc["version"]),
                total_size=int(doc["total_size"]),
                chunk_size=int(doc["chunk_size"]),
                root=bytes(doc["root"]),
                chunks=_chunks_from_wire(doc["chunks"], int(doc["chunk_size"]), int(doc["total_size"])),
                tensors=tuple(TensorEntry.from_wire(t) for t in doc["tensors"]),
                encoding=doc["encoding"],
                base_version=None if doc["base_version"] is None else int(doc["base_version"]),
                base_root=None if doc["base_root"] is None else bytes(doc["base_root"]),
            )
        except KeyError as e:
            raise ManifestError(f"manifest lacks field {e.args[0]!r}") from e
        except (TypeError, ValueError) as e:
            if isinstance(e, ManifestError):
                raise
            raise ManifestError(f"manifest has a field of the wrong type: {e}") from e

    def to_dict(self) -> dict:
        """Readable summary (hex hashes, no chunk list) for logs and status pages."""
        return {"key": self.key, "version": self.version, "base_version": self.base_version,
                "encoding": self.encoding, "total_size": self.total_size, "wire_size": self.wire_size,
                "chunk_size": self.chunk_size, "chunks": self.num_chunks, "root": self.root.hex()}

    # -- validation -----------------------------------------------------------------------
    def _validate(self) -> None:
        def bad(msg: str) -> ManifestError:
            return ManifestError(f"manifest v{self.version}: {msg}")

        if self.version < 0:
            raise bad("version must be >= 0")
        if self.encoding not in ENCODINGS:
            raise bad(f"unknown encoding {self.encoding!r}; expected one of {ENCODINGS}")
        has_base = self.base_version is not None
        if (self.encoding == "raw") == has_base or has_base != (self.base_root is not None):
            raise bad("a 'raw' version has no base; an 'xor-zstd' version names base_version and base_root")
        if not MIN_CHUNK_SIZE <= self.chunk_size <= MAX_CHUNK_SIZE:
            raise bad(f"chunk_size {self.chunk_size} outside [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}]")
        if self.total_size < 0 or len(self.chunks) != math.ceil(self.total_size / self.chunk_size):
            raise bad(f"{len(self.chunks)} chunks cannot cover {self.total_size} bytes in chunks of {self.chunk_size}")
        if len(self.root) != HASH_BYTES or (self.base_root is not None and len(self.base_root) != HASH_BYTES):
            raise bad("root hashes must be 32 bytes")
        wire_pos = 0
        for i, c in enumerate(self.chunks):
            want_len = min(self.chunk_size, self.total_size - i * self.chunk_size)
            if c.index != i or c.offset != i * self.chunk_size or c.length != want_len:
                raise bad(f"chunk {i} is out of place (index {c.index}, offset {c.offset}, length {c.length})")
            if c.wire_offset != wire_pos or c.wire_length <= 0:
                raise bad(f"chunk {i} wire offset {c.wire_offset} / length {c.wire_length} not contiguous")
            if c.encoding not in ENCODINGS or (c.encoding == "xor-zstd" and self.encoding == "raw"):
                raise bad(f"chunk {i} has encoding {c.encoding!r} in a {self.encoding!r} version")
            if len(c.hash) != HASH_BYTES or len(c.content_hash) != HASH_BYTES:
                raise bad(f"chunk {i} hashes must be 32 bytes")
            if c.encoding == "raw" and (c.wire_length != c.length or c.hash != c.content_hash):
                raise bad(f"raw chunk {i} must travel as its content")
            wire_pos += c.wire_length
        for t in self.tensors:
            if t.offset < 0 or t.length < 0 or t.offset + t.length > self.total_size:
                raise bad(f"tensor {t.name!r} [{t.offset}, {t.offset + t.length}) lies outside the blob")

    # -- views --------------------------------------------------------------------------------
    def wire_view(self, wire: Buffer, index: int) -> memoryview:
        """Chunk `index`'s wire bytes inside a wire buffer laid out by this manifest (no copy)."""
        c = self.chunks[index]
        return memoryview(wire)[c.wire_offset:c.wire_offset + c.wire_length]


def _as_bytes_view(blob: Buffer) -> memoryview:
    view = memoryview(blob)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")  # accepts e.g. a numpy array's memoryview; still no copy
    if not view.c_contiguous:
        raise ManifestError("snapshot blob must be one contiguous buffer")
    return view


def build_manifest(
    blob: Buffer,
    version: int,
    *,
    tensors: Iterable[TensorEntry] = (),
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Manifest:
    """Manifest of a full ("raw") version of `blob`; chunk `i`'s wire bytes are a view of the blob.

    Hashes every chunk once (blake3, ~3 GB/s a core). Blocking: call it through
    `asyncio.to_thread` from async code for big blobs.
    """
    view = _as_bytes_view(blob)
    if not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
        raise ManifestError(f"chunk_size {chunk_size} outside [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}] bytes; "
                            "use 1-4 MiB")
    total = len(view)
    chunks = []
    for i, off in enumerate(range(0, total, chunk_size)):
        part = view[off:off + chunk_size]
        h = chunk_hash(part)
        chunks.append(ChunkEntry(i, off, len(part), off, len(part), "raw", h, h))
    root = content_root(total, chunk_size, (c.content_hash for c in chunks))
    return Manifest(version=version, total_size=total, chunk_size=chunk_size, root=root,
                    chunks=tuple(chunks), tensors=tuple(tensors))
