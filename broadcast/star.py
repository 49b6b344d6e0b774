"""The star baseline: every receiver downloads each version straight from the source over HTTP.

`BlobStore` keeps the last few immutable versions (bytes + sha256); `add_star_routes` serves
them on an aiohttp app; `fetch_blob` downloads one version, streaming, and refuses it unless
its size and sha256 match what the source announced. Knows nothing of what the bytes mean.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections import OrderedDict
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

import aiohttp
from aiohttp import web


class BlobError(Exception):
    """A download did not produce the announced bytes."""


@dataclass(frozen=True)
class BlobInfo:
    version: int
    size: int
    sha256: str

    def to_json(self) -> dict:
        return {"version": self.version, "size": self.size, "sha256": self.sha256}


PUBLISHED_KEPT = 4096  # version numbers remembered as published (ints: a week of versions)


class BlobStore:
    """Immutable versions, newest last; the oldest are forgotten beyond `keep` (their numbers
    are remembered longer: `never_published`)."""

    def __init__(self, keep: int = 4):
        self.keep = keep
        self._blobs: OrderedDict[int, tuple[BlobInfo, bytes]] = OrderedDict()
        self._published: OrderedDict[int, None] = OrderedDict()

    def add(self, version: int, blob: bytes, sha256: str | None = None) -> BlobInfo:
        """Keep `version`; pass its `sha256` when it was computed off the event loop (a 16 GB
        snapshot takes half a minute to hash)."""
        if version in self._blobs:
            raise ValueError(f"version {version} is already published; versions are immutable")
        if self._blobs and version < next(reversed(self._blobs)):
            raise ValueError(f"version {version} is older than the newest published one")
        info = BlobInfo(version, len(blob), sha256 or hashlib.sha256(blob).hexdigest())
        self._blobs[version] = (info, blob)
        while len(self._blobs) > self.keep:
            self._blobs.popitem(last=False)
        self._published[version] = None
        while len(self._published) > PUBLISHED_KEPT:
            self._published.popitem(last=False)
        return info

    def never_published(self, version: int) -> bool:
        """`version` lies among the versions published here and is none of them: no snapshot had
        that number (with `[publish] every` > 1 most numbers are never published), so no worker
        generated with it. Numbers before the first remembered (a resumed run's) are not judged."""
        return bool(self._published) and next(iter(self._published)) <= version and version not in self._published

    @property
    def latest(self) -> BlobInfo | None:
        return next(reversed(self._blobs.values()))[0] if self._blobs else None

    def get(self, version: int) -> tuple[BlobInfo, bytes] | None:
        return self._blobs.get(version)


def parse_version(text: str) -> int:
    """A version number as a path spells it: ASCII digits only, else 400. `int` also reads `+9`,
    `9_2` and every script's digits (`٩`, `９`): each spelling was counted apart, and one worker
    downloaded one version 504 times in 10.7 s (454 Mbit/s) past its cap of 4 (a tester, 2026-11-29)."""
    if not (text.isascii() and text.isdigit() and len(text) <= 12):
        raise web.HTTPBadRequest(text=f"version must be a number in ASCII digits, not {text[:32]!r}")
    return int(text)


WRITE_PIECE = 1 << 20  # a blob is written a piece at a time, each after the last drained
WRITE_STALL_S = 30.0  # a reader that takes none of a piece for this long loses the stream (and its turn)


async def write_in_time(request: web.Request, resp: web.StreamResponse, piece) -> bool:
    """Write `piece`; False, the connection closed, if the reader took none of it for
    `WRITE_STALL_S`: a reader that stops reading kept its stream, and with it one of the turns
    its address's workers share at the weights, for as long as it liked."""
    try:
        await asyncio.wait_for(resp.write(piece), WRITE_STALL_S)
        return True
    except asyncio.TimeoutError:
        if request.transport is not None:
            request.transport.abort()
        return False


def add_star_routes(app: web.Application, store: BlobStore, prefix: str,
                    authorize: Callable[[web.Request], None] = lambda r: None,
                    gate: Callable[[web.Request], AbstractAsyncContextManager] | None = None) -> None:
    """GET {prefix}/latest -> info JSON; GET {prefix}/{version} -> the bytes (X-Sha256 header),
    sent within `gate(request)` (a turn among its address's streams) when given."""

    async def latest(request: web.Request) -> web.Response:
        authorize(request)
        info = store.latest
        if info is None:
            raise web.HTTPNotFound(text="nothing published yet")
        return web.json_response(info.to_json())

    async def blob(request: web.Request) -> web.StreamResponse:
        authorize(request)
        version = parse_version(request.match_info["version"])
        found = store.get(version)
        if found is None:
            newest = store.latest.version if store.latest else None
            raise web.HTTPNotFound(text=f"version {version} is not held (newest: {newest}); fetch {prefix}/latest")
        info, data = found
        async with gate(request) if gate else contextlib.nullcontext():
            resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream",
                                               "X-Sha256": info.sha256, "X-Version": str(version)})
            resp.content_length = info.size
            await resp.prepare(request)
            view = memoryview(data)
            try:
                for at in range(0, info.size, WRITE_PIECE):
                    if not await write_in_time(request, resp, view[at : at + WRITE_PIECE]):
                        return resp
                await resp.write_eof()
            except ConnectionResetError:  # the reader went away: its turn ends
                pass
            return resp

    app.router.add_get(f"{prefix}/latest", latest, allow_head=False)  # no HEAD: no client sends one
    app.router.add_get(f"{prefix}/{{version}}", blob, allow_head=False)


async def fetch_blob(session: aiohttp.ClientSession, url: str, expect: BlobInfo,
                     progress: Callable[[int], None] | None = None, headers: dict | None = None) -> bytes:
    """Download `url` into a preallocated buffer, verifying size and sha256 before returning."""
    buf = bytearray(expect.size)
    digest = hashlib.sha256()
    got = 0
    async with session.get(url, headers=headers) as resp:
        if resp.status != 200:
            raise BlobError(f"GET {url}: HTTP {resp.status}: {(await resp.text())[:200]}")
        async for piece in resp.content.iter_chunked(1 << 20):
            if got + len(piece) > expect.size:
                raise BlobError(f"GET {url}: more than the announced {expect.size} bytes")
            buf[got : got + len(piece)] = piece
            digest.update(piece)
            got += len(piece)
            if progress:
                progress(got)
    if got != expect.size or digest.hexdigest() != expect.sha256:
        raise BlobError(f"GET {url}: {got} bytes with sha256 {digest.hexdigest()[:12]}…, "
                        f"expected {expect.size} bytes with {expect.sha256[:12]}…; refusing to install")
    return bytes(buf)
