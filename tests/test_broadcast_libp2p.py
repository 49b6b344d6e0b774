"""The py-libp2p transport on loopback: peer IDs from ed25519 keys, the broadcast frames over a
libp2p stream with every chunk verified, and a paused reader that outlives yamux's 5 s limit.

Skipped (with the reason) where py-libp2p is not installed: it is the optional extra `p2p`.
"""

from __future__ import annotations

import asyncio
import os

import pytest

pytest.importorskip("libp2p", reason="py-libp2p is not installed (optional extra: pip install 'echo-rl[p2p]')")

from broadcast.libp2p_transport import (
    PUSH_PROTOCOL,
    Libp2pHost,
    Libp2pStream,
    peer_id,
    receive_version,
    send_version,
)
from broadcast.manifest import build_manifest
from broadcast.signing import ChunkCorrupt, SigningKey, VerifyKey, sign_manifest
from broadcast.transport import Hop, read_header

MIB = 1 << 20


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


@pytest.mark.parametrize("security", ["noise", "plaintext"])
def test_a_signed_version_crosses_a_libp2p_stream_verified(security):
    learner = SigningKey.generate()
    blob = os.urandom(5 * MIB + 123)
    signed = sign_manifest(learner, build_manifest(blob, 7, chunk_size=MIB))

    async def run():
        got: asyncio.Future = asyncio.get_running_loop().create_future()

        async def on_push(stream: Libp2pStream) -> None:
            got.set_result(await receive_version(stream, learner.public_key()))

        async with Libp2pHost(learner, security=security) as src, \
                Libp2pHost(SigningKey.generate(), security=security) as worker:
            worker.set_handler(PUSH_PROTOCOL, on_push)
            stream = await src.open_stream(worker.addrs[0], PUSH_PROTOCOL)
            route, ancestors = [Hop(worker.peer_id, worker.addrs[0])], [Hop("source", src.addrs[0])]
            reply = await send_version(stream, signed, blob, route, ancestors)
            return reply, await asyncio.wait_for(got, 30), src.peer_id

    reply, received, src_id = asyncio.run(run())
    assert reply == {"status": 200, "have": 6}
    assert bytes(received.data) == blob
    assert received.signed.manifest.root == signed.manifest.root
    assert received.route[0].url.endswith(received.route[0].id)
    assert received.ancestors[0].id == "source"
    assert received.remote_peer == src_id == peer_id(learner)


def test_a_flipped_byte_is_refused_with_a_reply():
    learner = SigningKey.generate()
    blob = bytearray(os.urandom(2 * MIB))
    signed = sign_manifest(learner, build_manifest(bytes(blob), 1, chunk_size=MIB))
    blob[MIB + 5] ^= 1  # chunk 1 no longer matches the signed manifest

    async def run():
        got: asyncio.Future = asyncio.get_running_loop().create_future()

        async def on_push(stream: Libp2pStream) -> None:
            try:
                await receive_version(stream, learner.public_key())
            except ChunkCorrupt as e:
                got.set_result(e)

        async with Libp2pHost(learner) as src, Libp2pHost(SigningKey.generate()) as worker:
            worker.set_handler(PUSH_PROTOCOL, on_push)
            stream = await src.open_stream(worker.addrs[0], PUSH_PROTOCOL)
            reply = await send_version(stream, signed, blob, [Hop("w", worker.addrs[0])], [Hop("s", src.addrs[0])])
            return reply, await asyncio.wait_for(got, 30)

    reply, err = asyncio.run(run())
    assert reply["status"] == 400 and "ChunkCorrupt" in reply["error"]
    assert err.index == 1


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
