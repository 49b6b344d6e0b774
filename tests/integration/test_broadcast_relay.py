"""The chain relay on loopback: forward-while-receive, tamper detection, repair, deltas.

Several tests run each relay as its own process (`python -m broadcast.relay`) and kill one
mid-transfer; the source runs in the test's event loop.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import msgpack
import numpy as np
import pytest

from broadcast.delta import decode
from broadcast.manifest import build_manifest
from broadcast.relay import PREFIX, Relay, Source
from broadcast.route import Route, route_for, sign_route
from broadcast.signing import SigningKey, sign_manifest
from broadcast.transport import Hop, frame_header, read_header

REPO = Path(__file__).resolve().parents[2]
KIB = 1 << 10
MIB = 1 << 20


def random_blob(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


# -- relay processes ------------------------------------------------------------------------
class RelayProcess:
    """`python -m broadcast.relay` in a subprocess; its stdout (url, then events) goes to a file."""

    def __init__(self, node_id: str, public_key: str, tmp: Path, *, up_rate: float | None = None,
                 stall_timeout: float = 2.0) -> None:
        self.id = node_id
        self.log = tmp / f"{node_id}.jsonl"
        cmd = [sys.executable, "-m", "broadcast.relay", "--id", node_id, "--public-key", public_key,
               "--stall-timeout", str(stall_timeout)]
        if up_rate:
            cmd += ["--up-rate", str(up_rate)]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            lines = self.log.read_text().splitlines()
            if lines:
                self.url = json.loads(lines[0])["url"]
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"relay {node_id} exited: {self.log.read_text()}")
            time.sleep(0.05)
        raise RuntimeError(f"relay {node_id} did not start")

    @property
    def hop(self) -> Hop:
        return Hop(self.id, self.url)

    def events(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()[1:] if line.startswith("{")]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def relay_procs(tmp_path):
    procs: list[RelayProcess] = []

    def spawn(ids, public_key, **kw):
        new = [RelayProcess(i, public_key, tmp_path, **kw) for i in ids]
        procs.extend(new)
        return new

    yield spawn
    for p in procs:
        p.stop()


async def status(session: aiohttp.ClientSession, url: str, key: str) -> dict | None:
    try:
        async with session.get(f"{url}{PREFIX}/status") as resp:
            return (await resp.json())["versions"].get(key)
    except aiohttp.ClientError:
        return None


async def wait_complete(session, urls, key, timeout=30.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        sts = [await status(session, u, key) for u in urls]
        if all(s and s["complete"] for s in sts):
            return sts
        if time.monotonic() > deadline:
            raise AssertionError(f"not complete after {timeout}s: {sts}")
        await asyncio.sleep(0.05)


async def pull_all(session, url, key) -> bytes:
    """Read a whole version back from a node through its pull endpoint (frames → bytes)."""
    async with session.get(f"{url}{PREFIX}/chunks/{key}", params={"from": 0}) as resp:
        assert resp.status == 200
        await read_header(resp.content)
        out = bytearray()
        while True:
            try:
                h = await read_header(resp.content)
            except Exception:
                return bytes(out)
            out += await resp.content.readexactly(h["n"])


# -- processes ----------------------------------------------------------------------------
def test_chain_of_processes_forwards_while_receiving(relay_procs):
    key = SigningKey.generate()
    # 8 MiB through 3 relay processes; each relay uploads at 8 MB/s so a hop takes ~1 s
    w = relay_procs(["w1", "w2", "w3"], key.public_key().to_text(), up_rate=8e6)
    blob = random_blob(8 * MIB)

    async def run():
        src = Source(key)
        await src.start()
        try:
            full, _ = await src.publish(blob, 1, chunk_size=512 * KIB)
            assert await src.push("v1", [[p.hop for p in w]]) == [True]
            async with aiohttp.ClientSession() as s:
                sts = await wait_complete(s, [p.url for p in w], "v1")
                copies = await asyncio.gather(*(pull_all(s, p.url, "v1") for p in w))
            return sts, copies
        finally:
            await src.stop()

    sts, copies = asyncio.run(run())
    assert all(c == blob for c in copies)  # identical bytes everywhere
    w1, w2, w3 = sts
    assert [s["parent"] for s in sts] == ["source", "w1", "w2"]
    # w2 began forwarding long before it finished receiving; w3 received before w2 finished
    assert w2["t_first_forward"] < w2["t_complete"] - 0.5
    assert w2["forwarded_before_complete"] >= 8
    assert w3["t_first_chunk"] < w2["t_complete"] - 0.5
    # pipelined: the last hop ends ~one hop time after the first, not three
    assert w3["t_complete"] - w1["t_start"] < 1.6 * (8 * MIB / 8e6)
    assert all(s["bytes_in"] == len(blob) and not s["repairs"] for s in sts)


def test_killed_middle_relay_is_routed_around_and_resumed(relay_procs):
    key = SigningKey.generate()
    w = relay_procs(["w1", "w2", "w3", "w4"], key.public_key().to_text(), up_rate=4e6, stall_timeout=1.0)
    blob = random_blob(8 * MIB, seed=1)
    chunk = 512 * KIB

    async def run():
        src = Source(key)
        await src.start()
        try:
            await src.publish(blob, 3, chunk_size=chunk)
            push = asyncio.create_task(src.push("v3", [[p.hop for p in w]]))
            async with aiohttp.ClientSession() as s:
                while True:  # kill w2 once w3 holds a quarter of the version
                    st = await status(s, w[2].url, "v3")
                    if st and st["have"] >= st["chunks"] // 4:
                        break
                    await asyncio.sleep(0.02)
                w[1].proc.kill()
                killed_at = st["have"]
                survivors = [w[0], w[2], w[3]]
                sts = await wait_complete(s, [p.url for p in survivors], "v3")
                copies = await asyncio.gather(*(pull_all(s, p.url, "v3") for p in survivors))
            await push
            return killed_at, sts, copies
        finally:
            await src.stop()

    killed_at, (s1, s3, s4), copies = asyncio.run(run())
    assert all(c == blob for c in copies)
    # w3 re-attached to its nearest live ancestor (w1) and resumed where it was
    assert s3["repairs"] and s3["repairs"][0]["via"] == "w1"
    assert s3["repairs"][0]["from"] >= killed_at > 0
    # resumed, not restarted: nothing received twice beyond a partial chunk's worth
    assert s3["bytes_in"] <= len(blob) + chunk
    assert sum(s["bytes_in"] for s in (s1, s3, s4)) <= 3 * len(blob) + 2 * chunk
    # w4 kept its own parent (w3) throughout
    assert s4["parent"] == "w3"
    assert any(e["event"] == "repair" for e in w[2].events())


# -- in-process -------------------------------------------------------------------------
def signed_route(key, manifest, chain, source, rate=None):
    """The learner's signed route of `manifest` down one chain (source first, then `chain`)."""
    return sign_route(key, route_for(manifest, source, [chain], None if rate is None else [rate],
                                     paced=rate is not None))


async def evil_push(url: str, signed, blob: bytes, route, *, sender: str, corrupt: int | None = None,
                    stall_after: int | None = None, trickle_after: int | None = None,
                    route_wire: bytes | None = None) -> int:
    """A misbehaving upstream: pushes a (validly signed) version along a signed route, flipping a
    byte of chunk `corrupt` (posing as `sender`, a node of the route), going silent after
    `stall_after` chunks, sending a byte every 50 ms after `trickle_after` chunks, or sending
    `route_wire` (a tampered route) instead of the route."""
    m = signed.manifest

    async def body():
        yield frame_header({"manifest": signed.to_wire(), "route": route_wire or route.to_wire(), "from": sender})
        for c in m.chunks:
            if stall_after is not None and c.index == stall_after:
                await asyncio.sleep(30)
            if trickle_after is not None and c.index == trickle_after:
                yield frame_header({"i": c.index, "n": c.wire_length})
                for b in blob[c.offset:c.offset + c.length]:
                    await asyncio.sleep(0.05)
                    yield bytes([b])
            data = bytearray(blob[c.offset:c.offset + c.length])
            if c.index == corrupt:
                data[len(data) // 2] ^= 0x01
            yield frame_header({"i": c.index, "n": c.wire_length})
            yield bytes(data)

    async with aiohttp.ClientSession() as s:
        try:
            async with s.post(f"{url}{PREFIX}/push", data=body()) as resp:
                return resp.status
        except aiohttp.ClientError:
            return -1


def test_flipped_byte_caught_at_first_hop_and_never_forwarded():
    key = SigningKey.generate()
    blob = random_blob(4 * MIB, seed=2)

    async def run():
        src = Source(key)
        await src.start()
        events: list[dict] = []
        a = Relay("a", key.public_key(), on_event=events.append, stall_timeout=2)
        b = Relay("b", key.public_key(), on_event=events.append, stall_timeout=2)
        for r in (a, b):
            await r.start()
        try:
            full, _ = await src.publish(blob, 1, chunk_size=256 * KIB)
            # "evil" sits between the source and a, and corrupts chunk 5
            route = signed_route(key, full.manifest, [Hop("evil", "http://127.0.0.1:9"), a.hop, b.hop], src.hop)
            await evil_push(a.url, full, blob, route, sender="evil", corrupt=5)
            ra, rb = await a.wait("v1", 10), await b.wait("v1", 10)
            return bytes(ra.data), bytes(rb.data), ra.stats, rb.stats, events
        finally:
            for n in (a, b, src):
                await n.stop()

    da, db, sa, sb, events = asyncio.run(run())
    assert da == blob and db == blob
    assert sa.corrupt == [{"t": sa.corrupt[0]["t"], "index": 5, "from": "evil", "reason": "blake3 mismatch"}]
    assert [e["sender"] for e in events if e["event"] == "chunk_corrupt"] == ["evil"]  # only at a
    # a routed around the evil parent: resumed from chunk 5 via the source
    assert sa.repairs[0]["via"] == "source" and sa.repairs[0]["from"] == 5
    # b never saw the bad chunk: no corruption, no duplicate bytes
    assert sb.corrupt == [] and sb.bytes_in == len(blob) and sb.repairs == []


def test_tampered_or_foreign_manifest_rejected():
    key, intruder = SigningKey.generate(), SigningKey.generate()
    blob = random_blob(1 * MIB)

    async def run():
        events: list[dict] = []
        a = Relay("a", key.public_key(), on_event=events.append)
        await a.start()
        try:
            m = build_manifest(blob, 1, chunk_size=256 * KIB)
            foreign = sign_manifest(intruder, m)
            route = signed_route(key, m, [Hop("x", "http://127.0.0.1:9"), a.hop], Hop("s", "http://127.0.0.1:9"))
            st1 = await evil_push(a.url, foreign, blob, route, sender="x")
            good = sign_manifest(key, m)
            body = bytearray(good.body)
            body[body.index(m.chunks[0].hash)] ^= 0xFF  # retarget chunk 0's hash
            forged = type(good)(m, bytes(body), good.signature)
            st2 = await evil_push(a.url, forged, blob, route, sender="x")
            return st1, st2, events, dict(a.stores)
        finally:
            await a.stop()

    st1, st2, events, stores = asyncio.run(run())
    assert st1 in (403, -1) and st2 in (403, -1)
    assert [e["event"] for e in events] == ["manifest_rejected", "manifest_rejected"]
    assert stores == {}  # nothing accepted, nothing installed


def behind_a_bad_parent(blob: bytes, rate: float | None = None, **misbehaviour):
    """Relay `a` below a parent that misbehaves (`evil_push`'s keywords) on a route paced at
    `rate`: what `a` ends with, its stats, and how long it took."""
    key = SigningKey.generate()

    async def run():
        src = Source(key)
        await src.start()
        a = Relay("a", key.public_key(), stall_timeout=0.5)
        await a.start()
        try:
            full, _ = await src.publish(blob, 1, chunk_size=256 * KIB)
            t0 = time.monotonic()
            route = signed_route(key, full.manifest, [Hop("slow", "http://127.0.0.1:9"), a.hop], src.hop, rate=rate)
            pusher = asyncio.create_task(evil_push(a.url, full, blob, route, sender="slow", **misbehaviour))
            ra = await a.wait("v1", 10)
            dt = time.monotonic() - t0
            pusher.cancel()
            return bytes(ra.data), ra.stats, dt
        finally:
            await a.stop()
            await src.stop()

    return asyncio.run(run())


def test_stalled_parent_detected_and_resumed_from_source():
    blob = random_blob(2 * MIB, seed=3)
    data, stats, dt = behind_a_bad_parent(blob, stall_after=3)
    assert data == blob and dt < 5
    assert stats.repairs[0]["from"] == 3 and "no progress" in stats.repairs[0]["reason"]
    assert stats.bytes_in == len(blob)


def test_trickling_parent_is_given_up_on_and_the_rest_pulled_from_above():
    """A byte every 50 ms is progress, so a stall timeout alone never fires: a parent that forwards
    a trickle held its child on the old version for as long as it liked. Below an eighth of its
    tree's planned rate over two stall timeouts, it is a stalled parent."""
    blob = random_blob(2 * MIB, seed=4)
    data, stats, dt = behind_a_bad_parent(blob, rate=8 * MIB, trickle_after=3)
    assert data == blob and dt < 5
    assert stats.repairs[0]["from"] == 3 and "below the floor" in stats.repairs[0]["reason"]
    assert stats.repairs[0]["via"] == "source"


def test_delta_down_a_chain_and_full_version_for_a_late_joiner():
    key = SigningKey.generate()
    rng = np.random.default_rng(4)
    w1 = (rng.standard_normal(512 * KIB) * 0.02).astype(np.float32)  # 2 MiB
    w2 = w1.copy()
    idx = rng.random(w1.size) < 0.03
    w2[idx] *= 1.01

    async def run():
        src = Source(key)
        await src.start()
        installed: dict[str, bytes] = {}
        chain = [Relay(f"r{i}", key.public_key()) for i in range(3)]
        late = Relay("late", key.public_key())
        for r in (*chain, late):
            await r.start()
        try:
            v1, _ = await src.publish(w1, 1, chunk_size=256 * KIB)
            await src.push("v1", [[r.hop for r in chain]])
            bases = {r.id: await r.wait("v1", 10) for r in chain}
            v2, d2 = await src.publish(w2, 2, chunk_size=256 * KIB, base=(w1, v1.manifest))
            assert d2 is not None and d2.manifest.key == "v2-d1"
            await src.push(d2.manifest.key, [[r.hop for r in chain]])
            for r in chain:
                got = await r.wait("v2-d1", 10)
                base = bases[r.id]
                installed[r.id] = bytes(decode(got.manifest, got.data, base.data, base.manifest))
            full = await late.fetch("v2", [src.hop])  # no base: the full version, pulled from the source
            installed["late"] = bytes(decode(full.manifest, full.data))
            return installed, d2.manifest.wire_size, v2.manifest.total_size
        finally:
            for n in (*chain, late, src):
                await n.stop()

    installed, wire, total = asyncio.run(run())
    assert all(v == w2.tobytes() for v in installed.values()) and len(installed) == 4
    assert wire < total / 5


def test_slow_child_does_not_slow_its_parent():
    key = SigningKey.generate()
    blob = random_blob(4 * MIB, seed=5)

    async def run():
        src = Source(key)
        await src.start()
        a = Relay("a", key.public_key())
        b = Relay("b", key.public_key(), down_rate=4e6)  # ~1 s for 4 MiB
        for r in (a, b):
            await r.start()
        try:
            await src.publish(blob, 1, chunk_size=256 * KIB)
            await src.push("v1", [[a.hop, b.hop]])
            ra, rb = await a.wait("v1", 10), await b.wait("v1", 10)
            return ra.stats, rb.stats
        finally:
            for n in (a, b, src):
                await n.stop()

    sa, sb = asyncio.run(run())
    assert sa.t_complete - sa.t_start < 0.5 < sb.t_complete - sb.t_start


def test_push_along_a_planned_set_of_chains():
    from broadcast.planner import PeerLink, plan_broadcast

    key = SigningKey.generate()
    blob = random_blob(2 * MIB, seed=6)
    links = [PeerLink(f"r{i}", 8e6, 8e6, 0.001) for i in range(4)]
    plan = plan_broadcast(len(blob), 16e6, links, 256 * KIB)  # U = 2 b: two chains of two
    assert plan.kind == "chains" and plan.k == 2

    async def run():
        src = Source(key)
        await src.start()
        relays = {p.id: Relay(p.id, key.public_key()) for p in links}
        for r in relays.values():
            await r.start()
        try:
            await src.publish(blob, 1, chunk_size=256 * KIB)
            t0 = time.monotonic()
            assert await src.push_plan("v1", plan, {i: r.hop for i, r in relays.items()}) == [True, True]
            got = {i: await r.wait("v1", 10) for i, r in relays.items()}
            return got, time.monotonic() - t0
        finally:
            for n in (*relays.values(), src):
                await n.stop()

    got, dt = asyncio.run(run())
    assert all(bytes(g.data) == blob for g in got.values())
    for chain in plan.chains:  # each worker's parent is its predecessor in the plan
        assert [got[w].stats.parent for w in chain] == ["source", *chain[:-1]]
    assert plan.rates == (8e6, 8e6)
    assert dt >= (len(blob) - 256 * KIB) / 8e6  # the source paced each chain (burst: one piece)


def test_unreachable_head_is_skipped():
    key = SigningKey.generate()
    blob = random_blob(1 * MIB, seed=7)

    async def run():
        src = Source(key, connect_timeout=1)
        await src.start()
        events: list[dict] = []
        src.on_event = events.append
        a, b = Relay("a", key.public_key()), Relay("b", key.public_key())
        for r in (a, b):
            await r.start()
        try:
            await src.publish(blob, 1, chunk_size=256 * KIB)
            ok = await src.push("v1", [[Hop("dead", "http://127.0.0.1:9"), a.hop, b.hop]])
            ra, rb = await a.wait("v1", 10), await b.wait("v1", 10)
            return ok, ra, rb, events
        finally:
            for n in (a, b, src):
                await n.stop()

    ok, ra, rb, events = asyncio.run(run())
    assert ok == [True] and bytes(ra.data) == blob and bytes(rb.data) == blob
    assert (ra.stats.parent, rb.stats.parent) == ("source", "a")
    assert [(e["event"], e["child"], e["next"]) for e in events] == [("child_failed", "dead", ["a"])]


def test_no_live_ancestor_fails_cleanly_without_installing():
    key = SigningKey.generate()
    blob = random_blob(1 * MIB, seed=8)

    async def run():
        src = Source(key)
        await src.start()
        installed: list = []
        events: list[dict] = []
        a = Relay("a", key.public_key(), stall_timeout=0.3, max_source_retries=0, connect_timeout=1,
                  on_complete=installed.append, on_event=events.append)
        await a.start()
        try:
            full, _ = await src.publish(blob, 1, chunk_size=256 * KIB)
            dead = [Hop("q", "http://127.0.0.1:9"), Hop("p", "http://127.0.0.1:9"), a.hop]
            route = signed_route(key, full.manifest, dead, Hop("gone", "http://127.0.0.1:9"))
            pusher = asyncio.create_task(evil_push(a.url, full, blob, route, sender="p", stall_after=2))
            with pytest.raises(Exception) as err:
                await a.wait("v1", 10)
            pusher.cancel()
            return err.value, installed, events
        finally:
            await a.stop()
            await src.stop()

    err, installed, events = asyncio.run(run())
    assert type(err).__name__ == "BroadcastFailed" and "previous version" in str(err)
    assert installed == []  # never a half-installed version
    assert [e["event"] for e in events][-1] == "failed"
    assert [e["via"] for e in events if e["event"] == "repair"] == ["q", "gone"]  # up the signed route


def test_rewritten_or_foreign_route_refused():
    """Relays forward only along the learner's signed route: a relay that rewrites it (to skip
    a child, or to make itself everyone's repair peer), replays another version's route, or
    sends a route without the receiver, is refused before anything is stored."""
    key = SigningKey.generate()
    blob = random_blob(1 * MIB, seed=9)

    async def run():
        events: list[dict] = []
        a = Relay("a", key.public_key(), on_event=events.append)
        await a.start()
        try:
            dead = Hop("s", "http://127.0.0.1:9")
            m1, m2 = build_manifest(blob, 1, chunk_size=256 * KIB), build_manifest(blob[::-1], 2, chunk_size=256 * KIB)
            v1 = sign_manifest(key, m1)
            good = signed_route(key, m1, [Hop("p", "http://127.0.0.1:9"), a.hop, Hop("c", "http://127.0.0.1:9")], dead)
            r = good.route
            rewritten = Route(r.key, r.root, Hop("evil", "http://127.0.0.1:9"), r.chains, r.rates)
            forged = msgpack.packb([rewritten.to_bytes(), good.signature], use_bin_type=True)
            statuses = [await evil_push(a.url, v1, blob, good, sender="p", route_wire=forged)]
            other = signed_route(key, m2, [a.hop], dead)  # validly signed, but for version 2
            statuses.append(await evil_push(a.url, v1, blob, other, sender="s"))
            without_a = signed_route(key, m1, [Hop("b", "http://127.0.0.1:9")], dead)
            statuses.append(await evil_push(a.url, v1, blob, without_a, sender="s"))
            return statuses, events, dict(a.stores)
        finally:
            await a.stop()

    statuses, events, stores = asyncio.run(run())
    assert statuses[0] in (403, -1) and all(st in (400, -1) for st in statuses[1:])  # -1: cut while sending
    assert [e["event"] for e in events] == ["route_rejected"] * 3
    assert "route signature does not verify" in events[0]["error"]
    assert "does not match manifest v1" in events[1]["error"]
    assert "does not include a" in events[2]["error"]
    assert stores == {}


def test_child_that_already_has_the_version_is_not_reported_failed():
    """A child refusing a push with 409 (it is pulling the version already, e.g. after a repair)
    replies before closing: its parent reads the 409 and reports nothing."""
    key = SigningKey.generate()
    blob = random_blob(2 * MIB, seed=10)

    async def run():
        src = Source(key)
        await src.start()
        events: list[dict] = []
        a = Relay("a", key.public_key(), on_event=events.append)
        b = Relay("b", key.public_key())
        for r in (a, b):
            await r.start()
        try:
            await src.publish(blob, 1, chunk_size=256 * KIB)
            await b.fetch("v1", [src.hop])
            ok = await src.push("v1", [[a.hop, b.hop]])
            return ok, events, (await a.wait_settled("v1", 10)).stats
        finally:
            for n in (a, b, src):
                await n.stop()

    ok, events, stats = asyncio.run(run())
    assert ok == [True]
    assert [e.get("error") for e in events if e["event"] == "child_failed"] == []
    assert stats.pushes == []  # b took nothing from a
