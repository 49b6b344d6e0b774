"""`echo-rl bench broadcast transports`: the relay transports on loopback, in one run.

One stream of broadcast frames per transport (aiohttp chunked POST; py-libp2p with plaintext
and with noise security, when installed), then a whole relay chain (`broadcast.relay`: a source
and three relays in this process) over each transport. MB/s and CPU seconds per GiB; both ends
run in this process, so CPU is the sum of all of them.
"""

from __future__ import annotations

import asyncio
import time

from broadcast.libp2p_transport import Libp2pHost, Libp2pStream, available
from broadcast.manifest import BroadcastError
from broadcast.signing import SigningKey
from broadcast.transport import PIECE, frame_header


async def _aiohttp_stream(size: int) -> dict:
    """MB/s of one chunked POST carrying `size` bytes of frames, loopback, receiver reads all."""
    import aiohttp
    from aiohttp import web

    done: asyncio.Future = asyncio.get_running_loop().create_future()

    async def handle(request: web.Request) -> web.Response:
        n = 0
        while data := await request.content.read(PIECE):
            n += len(data)
        done.set_result(n)
        return web.json_response({"n": n})

    app = web.Application(client_max_size=0)
    app.router.add_post("/push", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    block = bytes(1 << 20)

    async def body():
        for i in range(size >> 20):
            yield frame_header({"i": i, "n": len(block)})
            yield block

    try:
        async with aiohttp.ClientSession() as s:
            t0, c0 = time.perf_counter(), time.process_time()
            async with s.post(f"http://127.0.0.1:{port}/push", data=body()) as resp:
                await resp.read()
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        await runner.cleanup()
    n = await done
    return {"mb_s": n / dt / 1e6, "cpu": cpu, "bytes": n}


async def _libp2p_stream(size: int, security: str) -> dict:
    """MB/s of one libp2p stream (two hosts in this process, loopback)."""
    done: asyncio.Future = asyncio.get_running_loop().create_future()

    async def handle(stream: Libp2pStream) -> None:
        n = 0
        while data := await stream.read(PIECE):
            n += len(data)
        done.set_result(n)

    async with Libp2pHost(SigningKey.generate(), security=security) as a, \
            Libp2pHost(SigningKey.generate(), security=security) as b:
        b.set_handler("/echo/bench/1", handle)
        stream = await a.open_stream(b.addrs[0], "/echo/bench/1")
        block = bytes(1 << 20)
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(size >> 20):
            await stream.write(frame_header({"i": i, "n": len(block)}))
            await stream.write(block)
        await stream.close()
        n = await done
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"mb_s": n / dt / 1e6, "cpu": cpu, "bytes": n}


async def _relay_chain(size: int, transport: str, relays: int = 3) -> dict:
    """MB/s of a whole chain, source -> r1 -> ... -> r`relays` (`broadcast.relay` nodes, all in this
    process): `size` bytes over the given transport, from the push until the last relay holds it.

    A small version goes down the chain first, so the connections are open (as between the
    versions of a run) and the first-dial cost is not in the figure.
    """
    import os

    from broadcast.relay import Relay, Source

    key = SigningKey.generate()
    src = Source(key, transport=transport)
    chain = [Relay(f"r{i}", key.public_key(), transport=transport) for i in range(1, relays + 1)]
    for node in (src, *chain):
        await node.start()
    try:
        hops = [[r.hop for r in chain]]
        await src.publish(os.urandom(1 << 20), 1, chunk_size=256 << 10)
        await src.push("v1", hops)
        await chain[-1].wait("v1", 60)
        await src.publish(os.urandom(size), 2, chunk_size=1 << 20)
        t0, c0 = time.perf_counter(), time.process_time()
        if await src.push("v2", hops) != [True]:
            raise BroadcastError(f"the push down the {transport} chain failed")
        await chain[-1].wait("v2", 600)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        for node in (*chain, src):
            await node.stop()
    return {"mb_s": size / dt / 1e6, "cpu": cpu}


def compare_transports(size: int, chain_relays: int = 3) -> list[dict]:
    """Rows of `echo-rl bench broadcast transports`: one stream each, then a relay chain over each
    transport (`chain_relays` relays; 0: no chain rows); same run, loopback."""
    gib = size / (1 << 30)
    rows = []
    r = asyncio.run(_aiohttp_stream(size))
    rows.append({"transport": "aiohttp chunked POST", "mb_s": r["mb_s"], "cpu_s_per_gib": r["cpu"] / gib,
                 "note": "the default"})
    version = available()
    if version is None:
        rows.append({"transport": "py-libp2p", "note": "not installed: pip install 'libp2p>=0.2'"})
    else:
        for security in ("plaintext", "noise"):
            try:
                r = asyncio.run(_libp2p_stream(size, security))
                rows.append({"transport": f"py-libp2p {version} {security}+yamux", "mb_s": r["mb_s"],
                             "cpu_s_per_gib": r["cpu"] / gib, "note": "trio thread per host, asyncio bridge"
                             + (" (libp2p's default security)" if security == "noise" else "")})
            except BroadcastError as e:
                rows.append({"transport": f"py-libp2p {version} {security}+yamux", "note": f"failed: {e}"})
    if chain_relays:
        for transport in ("aiohttp", "libp2p") if version else ("aiohttp",):
            name = f"{chain_relays}-relay chain, {transport}" + (" (noise)" if transport == "libp2p" else "")
            try:
                r = asyncio.run(_relay_chain(size, transport, chain_relays))
                rows.append({"transport": name, "mb_s": r["mb_s"], "cpu_s_per_gib": r["cpu"] / gib,
                             "note": f"source + {chain_relays} relays, one process (one GIL), 1 MiB chunks; end to end"})
            except BroadcastError as e:
                rows.append({"transport": name, "note": f"failed: {e}"})
    return rows


def cli(argv: list[str]) -> int:
    """`echo-rl bench broadcast transports`: MB/s on loopback, aiohttp vs libp2p: one stream, and a
    3-relay chain."""
    import argparse
    import json

    from echo.table import fmt, table
    from broadcast.manifest import MIB

    p = argparse.ArgumentParser(prog="echo-rl bench broadcast transports", description=cli.__doc__)
    p.add_argument("--size-mib", type=float, default=128, help="bytes to stream per transport")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    args = p.parse_args(list(argv))
    rows = compare_transports(int(args.size_mib * MIB))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"loopback, {args.size_mib:g} MiB in 1 MiB frames (the broadcast framing): one stream per transport, "
          "then a relay chain (`broadcast.relay`) per transport; every node in one process, so CPU is the sum "
          "of all of them")
    print(table(["transport", "MB/s", "CPU s/GiB", "note"],
                [[r["transport"], fmt(r.get("mb_s")), fmt(r.get("cpu_s_per_gib"), ".2f"), r.get("note", "")]
                 for r in rows]))
    return 0
