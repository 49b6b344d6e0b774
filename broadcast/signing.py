"""Signing manifests (learner) and verifying manifests and chunks (every receiver).

Trust model: the learner holds an ed25519 private key; each worker gets the public key as a
line of text when it joins. The learner signs each manifest's canonical bytes; peers are
untrusted, so a relay verifies the manifest signature before accepting a stream and verifies
every chunk against the signed manifest before forwarding or installing it.
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass
from pathlib import Path

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from broadcast.manifest import (
    BroadcastError,
    Buffer,
    Manifest,
    ManifestError,
    chunk_hash,
)

PUBLIC_KEY_PREFIX = "ed25519:"
#: Domain separation: a signature over one kind of document can never pass for another kind.
MANIFEST_CONTEXT = b"echo-manifest-v1\0"
ROUTE_CONTEXT = b"echo-route-v1\0"


class SignatureError(BroadcastError):
    """A manifest's signature does not verify under the learner's public key (or is malformed)."""


class KeyFileError(BroadcastError):
    """A key file or public-key text cannot be read."""


class ChunkCorrupt(BroadcastError):
    """A chunk's bytes do not match the signed manifest; never forward or install it."""

    def __init__(self, key: str, index: int, reason: str) -> None:
        super().__init__(f"chunk {index} of {key} is corrupt ({reason}); dropping it and "
                         "fetching it again from another peer")
        self.key = key
        self.index = index
        self.reason = reason


class VerifyKey:
    """The learner's public key, as held by workers (or a worker's, in its read ticket)."""

    def __init__(self, key: Ed25519PublicKey) -> None:
        self._key = key

    @classmethod
    def from_text(cls, text: str) -> "VerifyKey":
        """Parse `ed25519:<base64 of the 32 raw bytes>` (what `to_text` prints)."""
        text = text.strip()
        if not text.startswith(PUBLIC_KEY_PREFIX):
            raise KeyFileError(f"public key {text[:20]!r}... must start with {PUBLIC_KEY_PREFIX!r}; "
                            "copy it from `SigningKey.public_key().to_text()` on the learner")
        try:
            raw = base64.b64decode(text[len(PUBLIC_KEY_PREFIX):], validate=True)
            return cls(Ed25519PublicKey.from_public_bytes(raw))
        except ValueError as e:
            raise KeyFileError(f"public key text is not base64 of 32 bytes: {e}") from e

    @classmethod
    def from_raw(cls, raw: bytes) -> "VerifyKey":
        """The key of its 32 raw bytes; `ValueError` if they are not one."""
        return cls(Ed25519PublicKey.from_public_bytes(raw))

    def raw(self) -> bytes:
        return self._key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    def to_text(self) -> str:
        return PUBLIC_KEY_PREFIX + base64.b64encode(self.raw()).decode("ascii")

    def verify(self, data: Buffer, signature: bytes, context: bytes = MANIFEST_CONTEXT) -> None:
        """Raise `SignatureError` unless `signature` signs `data` (a `context` document) under this key."""
        try:
            self._key.verify(bytes(signature), context + bytes(data))
        except (InvalidSignature, ValueError, TypeError) as e:
            what = context.split(b"-")[1].decode()
            raise SignatureError(f"{what} signature does not verify under the learner's public key: "
                                 f"the {what} was altered or signed by another key; discard it") from e


class SigningKey:
    """The learner's private ed25519 key."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key

    @classmethod
    def generate(cls) -> "SigningKey":
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> "SigningKey":
        """The key of a 32-byte seed (a worker's proof key, derived from its credential: `broadcast.tickets`)."""
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SigningKey":
        """Load a PEM (PKCS#8, unencrypted) private key written by `save`."""
        path = Path(path)
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as e:
            raise KeyFileError(f"cannot load the signing key from {path}: {e}; generate one with "
                            "SigningKey.generate().save(path)") from e
        if not isinstance(key, Ed25519PrivateKey):
            raise KeyFileError(f"{path} holds a {type(key).__name__}, not an ed25519 private key")
        return cls(key)

    @classmethod
    def load_or_generate(cls, path: str | os.PathLike) -> "SigningKey":
        """The key at `path`, created (mode 0600) if the file does not exist yet."""
        if Path(path).exists():
            return cls.load(path)
        key = cls.generate()
        key.save(path)
        return key

    def save(self, path: str | os.PathLike) -> None:
        """Write the key as PEM, readable only by its owner (0600), even if the file existed."""
        pem = self._key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption())
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # O_CREAT's mode does not apply to a file that already existed
            os.write(fd, pem)
        finally:
            os.close(fd)

    def public_key(self) -> VerifyKey:
        return VerifyKey(self._key.public_key())

    def sign(self, data: Buffer, context: bytes = MANIFEST_CONTEXT) -> bytes:
        return self._key.sign(context + bytes(data))


def pack_signed(body: bytes, signature: bytes) -> bytes:
    """The wire form of a signed document (manifest or route): `[body, signature]` in msgpack."""
    return msgpack.packb([body, signature], use_bin_type=True)


def unpack_signed(data: Buffer, what: str) -> tuple[bytes, bytes]:
    """`(body, signature)` of a signed document's wire form; `SignatureError` if it is not one."""
    try:
        body, signature = msgpack.unpackb(data, raw=False)
        return bytes(body), bytes(signature)
    except Exception as e:
        raise SignatureError(f"signed {what} is not [body, signature]: {e}") from e


@dataclass(frozen=True)
class SignedManifest:
    """A manifest with the exact bytes that were signed; forwarded verbatim by relays."""

    manifest: Manifest
    body: bytes
    signature: bytes

    def to_wire(self) -> bytes:
        return pack_signed(self.body, self.signature)

    @classmethod
    def from_wire(cls, data: Buffer, key: VerifyKey) -> "SignedManifest":
        """Parse, verify the signature, then parse the manifest; raises `SignatureError`."""
        body, signature = unpack_signed(data, "manifest")
        return cls(verify_manifest(key, body, signature), body, signature)


def sign_manifest(key: SigningKey, manifest: Manifest) -> SignedManifest:
    body = manifest.to_bytes()
    return SignedManifest(manifest, body, key.sign(body))


def verify_manifest(key: VerifyKey, body: Buffer, signature: bytes) -> Manifest:
    """Check the signature first, then parse: unsigned bytes are never even parsed."""
    key.verify(body, signature)
    try:
        return Manifest.from_bytes(body)
    except ManifestError as e:
        # Signed but malformed means a learner bug, not tampering; say so.
        raise SignatureError(f"signed manifest is malformed (learner bug?): {e}") from e


def verify_chunk(manifest: Manifest, index: int, data: Buffer) -> None:
    """Raise `ChunkCorrupt` unless `data` is exactly chunk `index`'s wire bytes."""
    if not 0 <= index < manifest.num_chunks:
        raise ChunkCorrupt(manifest.key, index, f"no such chunk (version has {manifest.num_chunks})")
    entry = manifest.chunks[index]
    if len(data) != entry.wire_length:
        raise ChunkCorrupt(manifest.key, index, f"{len(data)} bytes, manifest says {entry.wire_length}")
    if chunk_hash(data) != entry.hash:
        raise ChunkCorrupt(manifest.key, index, "blake3 mismatch")
