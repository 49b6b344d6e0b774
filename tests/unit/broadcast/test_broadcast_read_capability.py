"""The weights reach no one without the run's read capability: a source or relay given a
`read_token` serves manifests, chunks, pushes, its status and the route feed only to requests
that present it; relays that hold it fetch as before. (The learner hands it to workers with
their credential: `echo.protocol.BroadcastInfo.read_token`.)"""

import asyncio
import os

import aiohttp
import pytest

from broadcast.http_transport import PREFIX
from broadcast.relay import Relay
from broadcast.signing import SigningKey
from broadcast.source import Source
from broadcast.transport import Refused

TOKEN = "run-read-capability-0123456789"


def test_nothing_is_served_without_the_read_capability():
    key = SigningKey.generate()

    async def run():
        src = Source(key, read_token=TOKEN)
        await src.start()
        await src.publish(os.urandom(1 << 20), 1, chunk_size=256 << 10)
        paths = [f"{PREFIX}/manifest/v1", f"{PREFIX}/chunks/v1?from=0", f"{PREFIX}/status", f"{PREFIX}/routes?wait=0"]
        out = {}
        try:
            async with aiohttp.ClientSession() as session:
                for path in paths:
                    for name, headers in (("none", {}), ("wrong", {"Authorization": "Bearer guess"}),
                                          ("right", {"Authorization": f"Bearer {TOKEN}"})):
                        async with session.get(src.url + path, headers=headers) as resp:
                            body = await resp.read()
                            out[path, name] = (resp.status, len(body))
                async with session.post(src.url + f"{PREFIX}/push", data=b"x" * 64) as resp:
                    out["push", "none"] = (resp.status, 0)
                async with session.get(src.url + f"{PREFIX}/health") as resp:
                    out["health", "none"] = (resp.status, 0)
        finally:
            await src.stop()
        return out

    out = asyncio.run(run())
    for path in (f"{PREFIX}/manifest/v1", f"{PREFIX}/chunks/v1?from=0", f"{PREFIX}/status", f"{PREFIX}/routes?wait=0"):
        assert out[path, "none"][0] == 401 and out[path, "wrong"][0] == 401, (path, out)
        assert out[path, "right"][0] == 200, (path, out)
    assert out[f"{PREFIX}/chunks/v1?from=0", "right"][1] >= 1 << 20  # the weights, to the holder only
    assert out["push", "none"][0] == 401
    assert out["health", "none"][0] == 200  # reachability probes carry no weights


def test_a_relay_with_the_capability_fetches_and_one_without_is_refused():
    key = SigningKey.generate()
    blob = os.urandom(1 << 20)

    async def run():
        src = Source(key, read_token=TOKEN)
        await src.start()
        await src.publish(blob, 1, chunk_size=256 << 10)
        holder = Relay("w1", key.public_key(), read_token=TOKEN, source_url=src.url, stall_timeout=3)
        stranger = Relay("w2", key.public_key(), source_url=src.url, stall_timeout=3)
        await holder.start()
        await stranger.start()
        try:
            transport = await holder.transport_for(src.url)
            wire = await transport.manifest(src.url, "v1")
            theirs = await stranger.transport_for(src.url)
            refused_manifest = await theirs.manifest(src.url, "v1")
            with pytest.raises(Refused) as refused:
                async with theirs.pull(src.url, "v1", 0, 1):
                    pass
            return wire, refused_manifest, refused.value.status
        finally:
            await holder.stop()
            await stranger.stop()
            await src.stop()

    wire, refused_manifest, status = asyncio.run(run())
    assert wire and refused_manifest is None and status == 401
