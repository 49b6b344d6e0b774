"""Reachability: can the learner open a connection to a worker's relay?

Workers behind NAT (most home connections, many marketplace hosts) cannot accept inbound
connections, so nobody can push to them. The learner probes each relay's advertised URL when
it first hears of it (`probe_relay`) and plans unreachable workers as leaves that pull their
share from a reachable parent over their own outbound connection (`broadcast.planner`,
`PeerLink.reachable`; the relay follows the learner's route feed, `Relay.follow`).

The ladder, cheapest first: push (reachable) → pull from a reachable parent (this module says
which) → the learner's full-version fallback (`[broadcast] fallback_s`). py-libp2p 0.x has no
circuit relay v2 or hole punching that works over its trio host here (see the README), so
there is no rung between.
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp

from broadcast.http_transport import PREFIX


async def probe_relay(url: str, timeout_s: float) -> bool:
    """True if a relay at `url` (http(s):// or p2p:<multiaddr>) accepts a connection and answers
    within `timeout_s` seconds: its health route over HTTP, a manifest request over libp2p."""
    try:
        if url.startswith(("http://", "https://")):
            return await asyncio.wait_for(_probe_http(url.rstrip("/")), timeout_s)
        if url.startswith("p2p:"):
            # On a thread with its own event loop: importing py-libp2p and setting up a host hold
            # a loop for most of a second, and the caller's is the learner's.
            return await asyncio.wait_for(asyncio.to_thread(lambda: asyncio.run(_probe_p2p(url, timeout_s))),
                                          timeout_s + 10.0)
    except (asyncio.TimeoutError, aiohttp.ClientError, OSError, ValueError):
        return False
    except Exception:  # noqa: BLE001 - libp2p dial errors of every kind: not reachable
        return False
    return False


async def _probe_http(url: str) -> bool:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}{PREFIX}/health") as resp:
            return resp.status == 200


async def _probe_p2p(url: str, timeout_s: float) -> bool:
    """Dial with a throwaway identity and ask for a manifest that does not exist: any answer
    proves the relay accepted the connection and speaks the protocol."""
    from broadcast.libp2p_transport import MANIFEST_PROTOCOL, Libp2pHost, p2p_addr
    from broadcast.signing import SigningKey
    from broadcast.transport import frame_header, read_header

    host = Libp2pHost(SigningKey.generate())
    await host.start()
    try:
        stream = await host.open_stream(p2p_addr(url), MANIFEST_PROTOCOL, timeout=timeout_s)
        try:
            await stream.write(frame_header({"key": "probe"}))
            await stream.close()
            reply = await asyncio.wait_for(read_header(stream), timeout_s)
        finally:
            with contextlib.suppress(Exception):
                stream.abort()
        return isinstance(reply, dict)
    finally:
        await host.stop()
