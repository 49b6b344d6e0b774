"""Relay chains over py-libp2p on loopback: peer IDs from ed25519 keys, a chain of libp2p relays
forwarding while receiving, a chain crossing transports, repair pulls and tamper detection over
libp2p streams, and a paused reader that outlives yamux's 5 s limit.

Skipped (with the reason) where py-libp2p is not installed: it is the optional extra `p2p`.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

pytest.importorskip("libp2p", reason="py-libp2p is not installed (optional extra: pip install 'echo-rl[p2p]')")

from broadcast.libp2p_transport import (
    PUSH_PROTOCOL,
    Libp2pHost,
    Libp2pStream,
    is_p2p,
    p2p_addr,
    p2p_url,
    peer_id,
)
from broadcast.manifest import build_manifest
from broadcast.relay import Relay, Source
from broadcast.route import route_for, sign_route
from broadcast.signing import SigningKey, VerifyKey, sign_manifest
from broadcast.transport import Hop, frame_header, read_header

KIB = 1 << 10
MIB = 1 << 20


async def stop_all(*nodes) -> None:
    for n in nodes:
        await n.stop()


def test_peer_id_comes_from_the_ed25519_key():
    key = SigningKey.generate()
    pid = peer_id(key)
    assert pid.startswith("12D3KooW")  # an ed25519 key inlined in an identity multihash
    # a worker derives the learner's peer ID from the public key text it got at join
    assert peer_id(VerifyKey.from_text(key.public_key().to_text())) == pid
    assert peer_id(SigningKey.generate()) != pid

    async def run() -> tuple[str, list[str]]:
        async with Libp2pHost(key) as host:
            return host.peer_id, host.addrs

    host_id, addrs = asyncio.run(run())
    assert host_id == pid and addrs[0].endswith(f"/p2p/{pid}") and "/ip4/127.0.0.1/" in addrs[0]


def test_a_chain_of_libp2p_relays_forwards_while_receiving():
    key = SigningKey.generate()
    blob = os.urandom(4 * MIB + 123)

    async def run():
        # 8 MB/s uplinks: each hop takes ~0.5 s, so forwarding overlaps receiving
        src = Source(key, transport="libp2p", up_rate=8e6)
        relays = [Relay(f"r{i}", key.public_key(), transport="libp2p", up_rate=8e6) for i in (1, 2, 3)]
        for n in (src, *relays):
            await n.start()
        try:
            await src.publish(blob, 1, chunk_size=256 * KIB)
            assert await src.push("v1", [[r.hop for r in relays]]) == [True]
            return src.hop, [r.hop for r in relays], [await r.wait("v1", 20) for r in relays]
        finally:
            await stop_all(*relays, src)

    src_hop, hops, got = asyncio.run(run())
    assert all(is_p2p(h.url) for h in (src_hop, *hops))
    assert src_hop.url.endswith(f"/p2p/{peer_id(key)}")  # the learner's peer ID is its signing key's
    assert all(bytes(g.data) == blob for g in got)
    assert [g.stats.parent for g in got] == ["source", "r1", "r2"]
    r1, r2, r3 = (g.stats for g in got)
    assert r1.forwarded_before_complete > 0 and r2.forwarded_before_complete > 0
    assert r3.t_first_chunk < r2.t_complete  # pipelined down the chain
    assert all(g.stats.bytes_in == len(blob) and not g.stats.repairs for g in got)


def test_a_chain_crossing_transports():
    """source (aiohttp) -> r1 (libp2p) -> r2 (aiohttp) -> r3 (libp2p): each sender picks the
    transport from its child's URL; aiohttp nodes dial libp2p peers with a host of their own.
    Then a late joiner (aiohttp) fetches the version from r3 (manifest and chunks over libp2p)."""
    key = SigningKey.generate()
    blob = os.urandom(2 * MIB)

    async def run():
        src = Source(key)
        r1 = Relay("r1", key.public_key(), transport="libp2p")
        r2 = Relay("r2", key.public_key())
        r3 = Relay("r3", key.public_key(), transport="libp2p")
        late = Relay("late", key.public_key())
        for n in (src, r1, r2, r3, late):
            await n.start()
        try:
            await src.publish(blob, 1, chunk_size=256 * KIB)
            hops = [r1.hop, r2.hop, r3.hop]
            assert await src.push("v1", [hops]) == [True]
            got = [await r.wait("v1", 20) for r in (r1, r2, r3)]
            return hops, got, await late.fetch("v1", [r3.hop])
        finally:
            await stop_all(late, r1, r2, r3, src)

    hops, got, fetched = asyncio.run(run())
    assert [is_p2p(h.url) for h in hops] == [True, False, True]
    assert all(bytes(g.data) == blob for g in got)
    assert [g.stats.parent for g in got] == ["source", "r1", "r2"]
    assert all(not g.stats.repairs for g in got)
    assert bytes(fetched.data) == blob and fetched.stats.parent == "r3"


def test_stopped_relay_is_repaired_around_over_libp2p():
    """r1 stops mid-transfer: r2's inbound stream is reset, and r2 resumes from its first missing
    chunk by pulling from the source over libp2p; r3 keeps its parent and completes."""
    key = SigningKey.generate()
    blob = os.urandom(6 * MIB)
    chunk = 256 * KIB

    async def run():
        src = Source(key, transport="libp2p", up_rate=6e6)  # ~1 s for the whole version
        events: list[dict] = []
        relays = [Relay(f"r{i}", key.public_key(), transport="libp2p", stall_timeout=2, on_event=events.append)
                  for i in (1, 2, 3)]
        r1, r2, r3 = relays
        for n in (src, *relays):
            await n.start()
        try:
            await src.publish(blob, 1, chunk_size=chunk)
            push = asyncio.create_task(src.push("v1", [[r.hop for r in relays]]))
            deadline = time.monotonic() + 20
            while not (r2.stores.get("v1") and r2.stores["v1"].have >= 6):  # a quarter of the chunks
                assert time.monotonic() < deadline, "r2 never got going"
                await asyncio.sleep(0.01)
            killed_at = r2.stores["v1"].have
            await r1.stop()
            got = [await r.wait("v1", 20) for r in (r2, r3)]
            await push
            return killed_at, got, events
        finally:
            await stop_all(r2, r3, src)

    killed_at, (g2, g3), events = asyncio.run(run())
    assert bytes(g2.data) == blob and bytes(g3.data) == blob
    s2, s3 = g2.stats, g3.stats
    assert s2.repairs and s2.repairs[0]["via"] == "source" and s2.repairs[0]["from"] >= killed_at > 0
    assert "no progress" not in s2.repairs[0]["reason"]  # the stopped host reset it: no stall wait
    assert s2.parent == "source"  # the stream that finished it came from the source
    assert s2.bytes_in <= len(blob) + chunk  # resumed, not restarted
    assert any(e["event"] == "inbound_failed" and e["node"] == "r2" for e in events)
    # r3's own upstream (r2) never broke: it kept receiving while r2 repaired
    assert s3.parent == "r2" and not s3.repairs and s3.bytes_in == len(blob)


async def evil_push_p2p(host: Libp2pHost, url: str, signed, blob: bytes, route, *, sender: str,
                        corrupt: int | None = None) -> dict:
    """A misbehaving upstream over libp2p: a push stream (signed manifest and route, posing as
    `sender`) whose chunk `corrupt` has a flipped byte; sends up to that chunk, then reads the reply."""
    m = signed.manifest
    stream = await host.open_stream(p2p_addr(url), PUSH_PROTOCOL, timeout=5)
    await stream.write(frame_header({"manifest": signed.to_wire(), "route": route.to_wire(), "from": sender}))
    for c in m.chunks[:None if corrupt is None else corrupt + 1]:
        data = bytearray(blob[c.offset:c.offset + c.length])
        if c.index == corrupt:
            data[len(data) // 2] ^= 0x01
        await stream.write(frame_header({"i": c.index, "n": c.wire_length}))
        await stream.write(bytes(data))
    reply = await asyncio.wait_for(read_header(stream), 10)
    stream.abort()
    return reply


def test_flipped_byte_over_libp2p_caught_at_first_hop_and_never_forwarded():
    key = SigningKey.generate()
    blob = os.urandom(4 * MIB)

    async def run():
        events: list[dict] = []
        src = Source(key, transport="libp2p")
        a = Relay("a", key.public_key(), transport="libp2p", on_event=events.append, stall_timeout=2)
        b = Relay("b", key.public_key(), transport="libp2p", on_event=events.append, stall_timeout=2)
        for n in (src, a, b):
            await n.start()
        evil_key = SigningKey.generate()
        try:
            async with Libp2pHost(evil_key) as evil:
                full, _ = await src.publish(blob, 1, chunk_size=256 * KIB)
                evil_hop = Hop("evil", p2p_url(f"/ip4/127.0.0.1/tcp/9/p2p/{peer_id(evil_key)}"))
                route = sign_route(key, route_for(full.manifest, src.hop, [[evil_hop, a.hop, b.hop]]))
                reply = await evil_push_p2p(evil, a.url, full, blob, route, sender="evil", corrupt=5)
                ra, rb = await a.wait("v1", 10), await b.wait("v1", 10)
            return reply, bytes(ra.data), bytes(rb.data), ra.stats, rb.stats, events
        finally:
            await stop_all(a, b, src)

    reply, da, db, sa, sb, events = asyncio.run(run())
    assert reply["status"] == 502 and "chunk 5" in reply["text"]
    assert da == blob and db == blob
    assert [(c["index"], c["from"], c["reason"]) for c in sa.corrupt] == [(5, "evil", "blake3 mismatch")]
    assert [e["sender"] for e in events if e["event"] == "chunk_corrupt"] == ["evil"]  # only at a
    assert sa.repairs[0]["via"] == "source" and sa.repairs[0]["from"] == 5  # resumed over libp2p
    assert sb.corrupt == [] and sb.bytes_in == len(blob) and sb.repairs == []  # b never saw it


def test_foreign_manifest_and_forged_route_refused_over_libp2p():
    key, intruder = SigningKey.generate(), SigningKey.generate()
    blob = os.urandom(1 * MIB)

    async def run():
        events: list[dict] = []
        a = Relay("a", key.public_key(), transport="libp2p", on_event=events.append)
        await a.start()
        try:
            async with Libp2pHost(intruder) as evil:
                m = build_manifest(blob, 1, chunk_size=256 * KIB)
                x = Hop("x", p2p_url(f"/ip4/127.0.0.1/tcp/9/p2p/{peer_id(intruder)}"))
                good_route = sign_route(key, route_for(m, Hop("s", "http://127.0.0.1:9"), [[x, a.hop]]))
                foreign = await evil_push_p2p(evil, a.url, sign_manifest(intruder, m), blob, good_route, sender="x")
                forged_route = sign_route(intruder, good_route.route)
                forged = await evil_push_p2p(evil, a.url, sign_manifest(key, m), blob, forged_route, sender="x")
            return foreign, forged, events, dict(a.stores)
        finally:
            await a.stop()

    foreign, forged, events, stores = asyncio.run(run())
    assert foreign["status"] == 403 and forged["status"] == 403
    assert [e["event"] for e in events] == ["manifest_rejected", "route_rejected"]
    assert stores == {}  # nothing accepted


def test_late_joiner_fetch_and_409_over_libp2p():
    """b fetches the version (manifest and chunks over libp2p) before the push reaches it; a's push
    to b is then answered 409 early, read, and not reported as a failure."""
    key = SigningKey.generate()
    blob = os.urandom(2 * MIB)

    async def run():
        src = Source(key, transport="libp2p")
        events: list[dict] = []
        a = Relay("a", key.public_key(), transport="libp2p", on_event=events.append)
        b = Relay("b", key.public_key(), transport="libp2p")
        for n in (src, a, b):
            await n.start()
        try:
            await src.publish(blob, 1, chunk_size=256 * KIB)
            fetched = await b.fetch("v1", [src.hop])
            ok = await src.push("v1", [[a.hop, b.hop]])
            return bytes(fetched.data), ok, events, (await a.wait_settled("v1", 10)).stats
        finally:
            await stop_all(a, b, src)

    data, ok, events, stats = asyncio.run(run())
    assert data == blob and ok == [True]
    assert [e for e in events if e["event"] == "child_failed"] == []
    assert stats.pushes == []  # b took nothing from a


def test_a_reader_paused_longer_than_yamux_allows_still_gets_everything():
    """py-libp2p's yamux writer resets a stream whose reader leaves the window shut for 5 s (the
    window grows to 16 MiB, so it takes more than that in flight: with buffer_bytes=0 this very
    exchange ends in StreamReset). Our pump keeps reading into a bounded buffer, so a consumer
    pausing 6 s with 24 MiB outstanding loses nothing."""
    payload = os.urandom(24 * MIB)

    async def run():
        got: asyncio.Future = asyncio.get_running_loop().create_future()

        async def slow(stream: Libp2pStream) -> None:
            await asyncio.sleep(6.0)
            got.set_result(await stream.readexactly(len(payload)))
            await stream.write(b"\x00\x00\x00\x01\x80")  # an empty msgpack map as the reply frame

        async with Libp2pHost(SigningKey.generate()) as a, Libp2pHost(SigningKey.generate(), buffer_bytes=32 * MIB) as b:
            b.set_handler("/echo/test/slow/1", slow)
            stream = await a.open_stream(b.addrs[0], "/echo/test/slow/1")
            for off in range(0, len(payload), MIB):
                await stream.write(payload[off:off + MIB])
            await stream.close()
            reply = await asyncio.wait_for(read_header(stream), 30)
            return await asyncio.wait_for(got, 30), reply

    data, reply = asyncio.run(run())
    assert data == payload and reply == {}


def test_a_push_to_a_relay_listening_on_nothing_is_not_a_libp2p_error_line(caplog):
    """py-libp2p logged every failed dial at ERROR before raising it: relays whose URL listens on
    nothing (16 identities of one address) put a line each per version in the learner's log."""
    import logging
    import socket

    key, dead = SigningKey.generate(), SigningKey.generate()
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def run():
        src = Source(key, transport="libp2p")
        await src.start()
        try:
            await src.publish(os.urandom(256 * KIB), 1, chunk_size=64 * KIB)
            url = p2p_url(f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer_id(dead.public_key())}")
            return await src.push("v1", [[Hop("dead", url)]])
        finally:
            await src.stop()

    with caplog.at_level(logging.INFO):
        assert asyncio.run(run()) == [False]
    assert not [r for r in caplog.records if r.name.startswith("libp2p") and r.levelno >= logging.ERROR
                and "TCP stream" in r.getMessage()], caplog.text[-2000:]
    assert any("child_failed" in r.getMessage() for r in caplog.records)  # the failure is ours to say
