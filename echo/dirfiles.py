"""A model directory as it travels from the learner to a worker: its top-level files, by name.

The learner sends `{name: bytes}` (msgpack), read from disk as it goes (`Packed`); the worker
writes them under its cache in a directory named by their digest, so a second copy of the same
files is the same directory. A task's own model directories (poker's frozen LLM opponent) are
named in the join reply by `digest`: a worker uses its own copy only where it digests the same,
since an opponent that plays differently than the learner's makes every replayed episode a
reward mismatch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack

CHUNK = 1 << 18  # what `Packed.chunks` reads at a time: a slow reader holds this much of the learner, not a file


def listed(path: Path) -> list[Path]:
    """The files a directory travels as: top-level, not hidden, sorted by name."""
    return sorted(p for p in Path(path).iterdir() if p.is_file() and not p.name.startswith("."))


def digest(path: Path, only: Callable[[str], bool] = lambda name: True) -> str:
    """sha256 over a directory's top-level files (name and sha256 of each, sorted; `only` those
    whose name it picks), read in chunks: the same as `files_digest` of what `read` returns."""
    outer = hashlib.sha256()
    for p in (p for p in listed(path) if only(p.name)):
        inner = hashlib.sha256()
        with open(p, "rb") as f:
            while chunk := f.read(1 << 24):
                inner.update(chunk)
        outer.update(p.name.encode() + b"\0" + inner.hexdigest().encode() + b"\n")
    return outer.hexdigest()


def files_digest(files: dict[str, bytes]) -> str:
    outer = hashlib.sha256()
    for name in sorted(files):
        outer.update(name.encode() + b"\0" + hashlib.sha256(files[name]).hexdigest().encode() + b"\n")
    return outer.hexdigest()


def read(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in listed(path)}


class Packed:
    """`paths` as the msgpack map `{name: bytes}` that `msgpack.packb(..., use_bin_type=True)`
    makes of them, byte for byte, read `CHUNK` at a time: served whole, a 2 GiB directory cost the
    learner 4 GiB for each reader at once (the files, then their packing), and a reader that
    stopped reading held it. `size` is known before the first byte, for Content-Length."""

    def __init__(self, paths: list[Path]):
        sizes = [p.stat().st_size for p in paths]
        self.parts = [(msgpack.packb(p.name) + _bin_header(n), p, n) for p, n in zip(paths, sizes)]
        self.head = _map_header(len(paths))
        self.files_size = sum(sizes)  # the files' own bytes, without msgpack's headers
        self.size = len(self.head) + sum(len(header) for header, _, _ in self.parts) + self.files_size

    def chunks(self) -> Iterator[bytes]:
        """The packing, a piece at a time; a file that changed size since `Packed` was made raises."""
        yield self.head
        for header, path, size in self.parts:
            yield header
            left = size
            with open(path, "rb") as f:
                while left:
                    piece = f.read(min(CHUNK, left))
                    if not piece:
                        raise OSError(f"{path} shrank while it was being sent")
                    left -= len(piece)
                    yield piece


def _map_header(n: int) -> bytes:
    return msgpack.Packer().pack_map_header(n)


def _bin_header(n: int) -> bytes:
    """msgpack's bin 8/16/32 header for `n` bytes (msgpack-python packs headers of maps and arrays
    alone, not of bin)."""
    if n < 1 << 8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    if n < 1 << 32:
        return b"\xc6" + n.to_bytes(4, "big")
    raise ValueError(f"a file of {n} bytes is past msgpack's 4 GiB")


def write(files: dict[str, bytes], cache: Path, prefix: str, digest: str | None = None) -> Path:
    """`files` as `cache/<prefix>-<digest>` (`digest`: their `files_digest`, where the caller has
    it already); a name that is not a plain file name is refused."""
    for name in files:
        if not name or "/" in name or "\\" in name or name.startswith(".") or "\0" in name:
            raise ValueError(f"refusing file name {name!r}")
    path = cache / f"{prefix}-{(digest or files_digest(files))[:16]}"
    path.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (path / name).write_bytes(data)
    return path
