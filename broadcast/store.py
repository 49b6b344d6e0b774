"""A version on one node: the signed manifest, one preallocated wire buffer, what is verified.

A node receives a version as one or more **spans** (consecutive chunk ranges: the whole version
down a chain, one stripe per parent in striped mode; `broadcast.route`). Each span fills in
order from its first chunk, so "what is verified" is one counter per span, and a stream or a
repair resumes a span at its first missing chunk.
"""

from __future__ import annotations

import asyncio
import bisect
import mmap
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

from broadcast.manifest import BroadcastError, Buffer, Manifest
from broadcast.route import SignedRoute
from broadcast.signing import SignedManifest


class BroadcastFailed(BroadcastError):
    """A version could not be received from any ancestor; the node stays on its old version."""


class VersionGone(BroadcastError):
    """A version was evicted (superseded) or failed while a stream was waiting for its chunks."""


@dataclass
class TransferStats:
    """Per-version counters of one node; times are wall-clock (time.time()) for cross-host logs."""

    key: str
    parent: str | None = None  # who sent the largest span (the blame partner of a slow download)
    bytes_in: int = 0  # chunk payload bytes received, including any received twice
    bytes_out: int = 0  # chunk payload bytes sent (forwarding and serving pulls)
    chunks_out: int = 0
    forwarded_before_complete: int = 0  # chunks sent while this node was still receiving
    offered_rate: float | None = None  # what the route feeds this node in all (bytes/s); None: unpaced
    t_start: float = field(default_factory=time.time)
    t_first_chunk: float | None = None
    t_first_forward: float | None = None
    t_last_forward: float | None = None
    t_complete: float | None = None
    pushes: list[dict] = field(default_factory=list)  # completed push streams sent: chain, to, seconds, bytes
    refused: list[dict] = field(default_factory=list)  # push streams a child refused or broke: chain, to, status
    repairs: list[dict] = field(default_factory=list)
    spans: list[dict] = field(default_factory=list)  # per span: first chunk, how it came, from whom, when
    corrupt: list[dict] = field(default_factory=list)


class VersionStore:
    """One version on one node.

    Invariant: in span `s`, chunks `spans[s][0] .. next[s]-1` of `buffer` are verified and never
    written again; readers (forwarders, pull servers) only read those, so they never see
    unverified bytes. `have` counts verified chunks over all spans.
    """

    def __init__(self, signed: SignedManifest, wire: Buffer | None = None) -> None:
        m = signed.manifest
        self.signed = signed
        self.manifest: Manifest = m
        n = m.num_chunks
        if wire is not None:
            self.buffer = memoryview(wire).cast("B")
            self.have = n
        else:
            # Anonymous mmap: pages are zeroed lazily by the kernel, so a multi-GB buffer is free
            # to allocate and costs memory only as chunks arrive.
            self.buffer = memoryview(mmap.mmap(-1, m.wire_size)) if m.wire_size else memoryview(bytearray())
            self.have = 0
        if len(self.buffer) != m.wire_size:
            raise BroadcastError(f"{m.key}: wire buffer is {len(self.buffer)} B, manifest says {m.wire_size}")
        self.spans: list[tuple[int, int]] = [(0, n)]
        self.next: list[int] = [self.have]
        self.inbound: dict[int, str] = {}  # span -> "push" | "pull" while something fills it
        self.main_span = 0  # the largest span: its sender is `stats.parent`
        self.stats = TransferStats(m.key)
        self.route: SignedRoute | None = None
        self.manifest_wire = signed.to_wire()  # what streams carry, kept to recognise them cheaply
        self.route_wire: bytes | None = None
        self.below: dict[str, tuple[tuple[int, int], ...]] | None = None  # who may pull what from this relay (`Relay.pulled`)
        self.places: list = []  # this node's `broadcast.route.Place`s in the route
        self.span_rates: list[float | None] = [None]  # per span: its tree's rate, if the route is paced
        self.last_failure = ""  # why the latest inbound stream ended early (for repair events)
        self.pulled_by: dict[str, int] = {}  # ticket holder -> bytes of this version it was served by pull
        self.pulled_from: dict[str, int] = {}  # the holders' address (its /64) -> those bytes, all its holders'
        self.gone: BaseException | None = None
        self.tasks: set[asyncio.Task] = set()
        self._conds = [asyncio.Condition()]  # one per span: a commit wakes only that span's readers
        # Set when the version is whole (its result None: the store as its result made every
        # version a reference cycle, left to the cyclic collector's full passes)
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.complete:
            self.done.set_result(None)

    @property
    def key(self) -> str:
        return self.manifest.key

    def range_bytes(self, start: int, end: int) -> int:
        """Wire bytes of chunks [start, end) (contiguous on the wire)."""
        chunks = self.manifest.chunks
        return chunks[end - 1].wire_offset + chunks[end - 1].wire_length - chunks[start].wire_offset if end > start else 0

    @property
    def complete(self) -> bool:
        return self.have == self.manifest.num_chunks

    @property
    def settled(self) -> bool:
        """Received whole and nothing of it still being forwarded: its link sample is final."""
        return self.complete and all(t.done() for t in self.tasks)

    def set_spans(self, spans: Sequence[tuple[int, int]]) -> None:
        """How this node receives the version (from its route); only before any chunk arrived."""
        spans = sorted(spans)
        if self.have or not spans or spans[0][0] != 0 or spans[-1][1] != self.manifest.num_chunks or any(
                a[1] != b[0] for a, b in zip(spans, spans[1:])):
            raise BroadcastError(f"{self.key}: spans {spans} must tile an empty version")
        self.spans = list(spans)
        self.next = [a for a, _ in spans]
        self.span_rates = [None] * len(spans)
        self._conds = [asyncio.Condition() for _ in spans]
        self.main_span = max(range(len(spans)), key=lambda s: spans[s][1] - spans[s][0])

    def pace(self, index: int) -> float | None:
        """The rate to serve chunk `index` to a pulling child or a repair at: its tree's."""
        return self.span_rates[self.span_of(index)] if self.manifest.num_chunks else None

    def span_of(self, index: int) -> int:
        return bisect.bisect_right(self.spans, (index, float("inf"))) - 1

    def ready(self, index: int) -> bool:
        return self.next[self.span_of(index)] > index

    def view(self, index: int) -> memoryview:
        return self.manifest.wire_view(self.buffer, index)

    async def commit(self, index: int) -> None:
        s = self.span_of(index)
        assert index == self.next[s], f"chunks of a span commit in order ({index} after {self.next[s]})"
        async with self._conds[s]:
            self.next[s] = index + 1
            self.have += 1
            self._conds[s].notify_all()
        if self.complete and not self.done.done():
            self.done.set_result(None)

    async def wait_chunk(self, index: int) -> memoryview:
        """The verified bytes of chunk `index`, waiting until it is verified."""
        cond = self._conds[self.span_of(index)]
        async with cond:
            await cond.wait_for(lambda: self.ready(index) or self.gone is not None)
        if not self.ready(index):
            raise VersionGone(f"{self.key}: {self.gone}")
        return self.view(index)

    async def close(self, reason: BaseException) -> None:
        """Fail or evict: wake every waiter, cancel this version's tasks."""
        self.gone = reason
        for cond in self._conds:
            async with cond:
                cond.notify_all()
        if not self.done.done():
            self.done.set_exception(reason)
            self.done.exception()  # mark retrieved: nobody may be waiting
        for t in list(self.tasks):
            if t is not asyncio.current_task():
                t.cancel()

    def status(self) -> dict:
        from broadcast.links import link_sample

        sample = link_sample(self.stats, self.manifest.wire_size)
        return {"have": self.have, "chunks": self.manifest.num_chunks, "complete": self.complete,
                "spans": [[a, b, n] for (a, b), n in zip(self.spans, self.next)],
                "gone": None if self.gone is None else str(self.gone), **self.manifest.to_dict(),
                **asdict(self.stats), "route": self.route.route.to_dict() if self.route else None,
                "link_sample": sample.to_dict() if sample else None}


@dataclass(frozen=True)
class Received:
    """A fully received and verified version, handed to `on_complete` (install it from `data`)."""

    manifest: Manifest
    signed: SignedManifest
    data: memoryview  # the wire buffer: the blob itself for a raw version (see broadcast.delta)
    stats: TransferStats
