"""A model directory as it travels from the learner to a worker: its top-level files, by name.

The learner sends `{name: bytes}` (msgpack); the worker writes them under its cache in a
directory named by their digest, so a second copy of the same files is the same directory. A
task's own model directories (poker's frozen LLM opponent) are named in the join reply by
`digest`: a worker uses its own copy only where it digests the same, since an opponent that
plays differently than the learner's makes every replayed episode a reward mismatch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path


def _listed(path: Path) -> list[Path]:
    return sorted(p for p in Path(path).iterdir() if p.is_file() and not p.name.startswith("."))


def digest(path: Path, only: Callable[[str], bool] = lambda name: True) -> str:
    """sha256 over a directory's top-level files (name and sha256 of each, sorted; `only` those
    whose name it picks), read in chunks: the same as `files_digest` of what `read` returns."""
    outer = hashlib.sha256()
    for p in (p for p in _listed(path) if only(p.name)):
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


def size(path: Path) -> int:
    return sum(p.stat().st_size for p in _listed(path))


def read(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in _listed(path)}


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
