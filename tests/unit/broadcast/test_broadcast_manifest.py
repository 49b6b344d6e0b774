"""Manifests, signing, chunk verification."""

import os
import stat

import pytest

from broadcast.manifest import (
    MIB,
    Manifest,
    ManifestError,
    TensorEntry,
    build_manifest,
)
from broadcast.signing import (
    ChunkCorrupt,
    KeyFileError,
    SignatureError,
    SignedManifest,
    SigningKey,
    VerifyKey,
    sign_manifest,
    verify_chunk,
)

CHUNK = 1 * MIB


def blob(n: int, seed: int = 0) -> bytearray:
    import numpy as np

    return bytearray(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes())


def test_build_chunks_cover_blob_and_roundtrip():
    data = blob(3 * CHUNK + 123)
    tensors = [TensorEntry("w", "float32", (3, CHUNK // 4), 0, 3 * CHUNK),
               TensorEntry("b", "bf16", (61,), 3 * CHUNK, 122)]
    m = build_manifest(data, 7, tensors=tensors, chunk_size=CHUNK)
    assert m.key == "v7" and m.num_chunks == 4 and m.total_size == m.wire_size == len(data)
    assert [c.length for c in m.chunks] == [CHUNK, CHUNK, CHUNK, 123]
    assert bytes(m.wire_view(data, 3)) == bytes(data[3 * CHUNK:])
    again = Manifest.from_bytes(m.to_bytes())
    assert again == m and again.to_bytes() == m.to_bytes()  # canonical
    assert again.tensors[0].shape == (3, CHUNK // 4)
    # same content -> same root; one byte changed -> different root and one different chunk hash
    data2 = bytearray(data)
    data2[CHUNK + 5] ^= 1
    m2 = build_manifest(data2, 8, chunk_size=CHUNK)
    assert m2.root != m.root
    assert [a.hash != b.hash for a, b in zip(m.chunks, m2.chunks)] == [False, True, False, False]


def test_build_rejects_bad_chunk_size_and_tensor_outside_blob():
    with pytest.raises(ManifestError, match="chunk_size"):
        build_manifest(b"x" * 10, 1, chunk_size=100)
    with pytest.raises(ManifestError, match="outside the blob"):
        build_manifest(b"x" * 10, 1, chunk_size=CHUNK, tensors=[TensorEntry("t", "f32", (4,), 8, 16)])


def test_from_bytes_rejects_garbage_and_inconsistency():
    with pytest.raises(ManifestError):
        Manifest.from_bytes(b"\xc1not msgpack")
    m = build_manifest(blob(2 * CHUNK), 1, chunk_size=CHUNK)
    import msgpack

    doc = msgpack.unpackb(m.to_bytes())
    assert all(isinstance(c, bytes) for c in doc["chunks"])  # raw chunks travel as their hash alone
    doc["chunks"][1] = m.chunks[1].to_wire()
    doc["chunks"][1][2] = 5  # length no longer matches the layout
    with pytest.raises(ManifestError, match="out of place"):
        Manifest.from_bytes(msgpack.packb(doc))
    del doc["root"]
    with pytest.raises(ManifestError, match="root"):
        Manifest.from_bytes(msgpack.packb(doc))


def test_sign_verify_and_tampered_manifest_rejected():
    key = SigningKey.generate()
    pub = VerifyKey.from_text(key.public_key().to_text())
    m = build_manifest(blob(2 * CHUNK), 3, chunk_size=CHUNK)
    signed = sign_manifest(key, m)
    assert SignedManifest.from_wire(signed.to_wire(), pub).manifest == m
    # a manifest altered after signing (one byte of a chunk hash) is rejected
    body = bytearray(signed.body)
    body[body.index(m.chunks[1].hash) + 3] ^= 0x40
    with pytest.raises(SignatureError, match="does not verify"):
        SignedManifest.from_wire(SignedManifest(m, bytes(body), signed.signature).to_wire(), pub)
    # a manifest signed by another key is rejected
    other = sign_manifest(SigningKey.generate(), m)
    with pytest.raises(SignatureError):
        SignedManifest.from_wire(other.to_wire(), pub)
    with pytest.raises(SignatureError):
        SignedManifest.from_wire(b"junk", pub)


def test_key_save_load_permissions(tmp_path):
    path = tmp_path / "learner.key"
    path.write_text("old")
    os.chmod(path, 0o644)
    key = SigningKey.generate()
    key.save(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    loaded = SigningKey.load(path)
    assert loaded.public_key().to_text() == key.public_key().to_text()
    assert SigningKey.load_or_generate(path).public_key().to_text() == key.public_key().to_text()
    fresh = SigningKey.load_or_generate(tmp_path / "new.key")
    assert stat.S_IMODE(os.stat(tmp_path / "new.key").st_mode) == 0o600
    assert fresh.public_key().to_text().startswith("ed25519:")
    with pytest.raises(KeyFileError):
        SigningKey.load(tmp_path / "missing.key")
    with pytest.raises(KeyFileError):
        VerifyKey.from_text("rsa:AAAA")


def test_verify_chunk_catches_flipped_byte_and_wrong_length():
    data = blob(2 * CHUNK + 10)
    m = build_manifest(data, 1, chunk_size=CHUNK)
    for i in range(m.num_chunks):
        verify_chunk(m, i, m.wire_view(data, i))
    bad = bytearray(m.wire_view(data, 1))
    bad[12345] ^= 1
    with pytest.raises(ChunkCorrupt, match="chunk 1 of v1") as e:
        verify_chunk(m, 1, bad)
    assert e.value.index == 1
    with pytest.raises(ChunkCorrupt, match="bytes"):
        verify_chunk(m, 2, b"short")
    with pytest.raises(ChunkCorrupt, match="no such chunk"):
        verify_chunk(m, 3, b"")
