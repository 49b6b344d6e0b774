"""Link estimates refreshed by the transfers themselves (`broadcast.links`).

Unit tests on synthetic transfer stats, then the whole loop on loopback: a worker that declared
a fast upload but really uploads at a quarter of it slows its chain for one version; its
measured upload moves it to a chain's tail in the next plan, and that version arrives fast.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field

import pytest

from broadcast.links import LinkSample, LinkTable, link_sample, uplink_sample
from broadcast.planner import plan_broadcast

MIB = 1 << 20
MB = 1e6


@dataclass
class Stats:
    """The fields of `broadcast.relay.TransferStats` that `link_sample` reads."""

    key: str = "v1"
    parent: str | None = "p"
    bytes_in: int = 0
    bytes_out: int = 0
    offered_rate: float | None = None
    t_first_chunk: float | None = None
    t_complete: float | None = None
    t_first_forward: float | None = None
    t_last_forward: float | None = None
    pushes: list = field(default_factory=list)


def received(rate: float, seconds: float = 4.0, offered: float | None = None, **kw) -> Stats:
    return Stats(bytes_in=int(rate * seconds), offered_rate=offered, t_first_chunk=100.0,
                 t_complete=100.0 + seconds, **kw)


def test_paced_transfer_only_proves_a_lower_bound():
    # Received at the chain's pace: the sender set the rate, not the link.
    s = link_sample(received(7.6 * MB, offered=7.6 * MB), 0)
    assert s.down == pytest.approx(7.6 * MB) and not s.down_limited
    table = LinkTable(uplink=20 * MB, default=100 * MB)
    table.declare("w", down=8 * MB, up=8 * MB)
    table.observe("w", s)
    assert table.link("w").down == 8 * MB  # the declared rate stands: no ratchet down
    table.observe("w", LinkSample("v2", down=9 * MB))  # a faster paced transfer raises it
    assert table.link("w").down == 9 * MB


def test_slow_link_replaces_the_declared_rate_then_averages():
    s = link_sample(received(2 * MB, offered=7.6 * MB), 0)
    assert s.down_limited and s.parent == "p"
    unpaced = link_sample(received(3 * MB), 0)  # nobody paced it: the path was the limit
    assert unpaced.down_limited
    table = LinkTable(uplink=20 * MB, default=100 * MB)
    table.declare("w", down=8 * MB, up=8 * MB)
    table.observe("w", s)
    assert table.link("w").down == pytest.approx(2 * MB)  # first measurement replaces the claim
    table.declare("w", down=8 * MB)  # re-declaring (every heartbeat) no longer overrides it
    table.observe("w", LinkSample("v2", down=4 * MB, down_limited=True))
    assert table.link("w").down == pytest.approx(3 * MB)  # then a moving average (alpha 0.5)
    assert not table.observe("w", LinkSample("v2", down=1.0, down_limited=True))  # repeats count once
    assert table.to_dict()["peers"]["w"]["down"] == {"mbit": 24.0, "source": "measured", "samples": 2}


def test_upload_is_link_limited_only_when_forwarding_fell_behind():
    base = dict(bytes_in=16 * MIB, t_first_chunk=0.0, t_complete=2.0, offered_rate=8 * MB, bytes_out=16 * MIB)
    kept_up = link_sample(Stats(**base, t_first_forward=0.1, t_last_forward=2.05), 0)
    assert not kept_up.up_limited  # it forwarded as fast as it received
    behind = link_sample(Stats(**base, t_first_forward=0.1, t_last_forward=8.1), 0)
    assert behind.up_limited and behind.up == pytest.approx(16 * MIB / 8.0)


def test_tiny_transfers_measure_nothing():
    assert link_sample(received(10 * MB, seconds=0.01), 0) is None  # 100 kB: setup, not bandwidth
    assert link_sample(received(10 * MB, seconds=0.3), 0) is None  # 3 MB: still too small to trust
    assert link_sample(Stats(), 0) is None


def test_slow_hop_blames_the_senders_upload_not_the_receivers_download():
    table = LinkTable(uplink=20 * MB, default=8 * MB)
    table.observe("child", LinkSample("v1", down=2 * MB, down_limited=True, parent="sender"))
    table.observe("sender", LinkSample("v1", down=7.6 * MB, up=2 * MB, up_limited=True, parent="source"))
    assert table.link("sender").up == pytest.approx(2 * MB)
    assert table.link("child").down == 8 * MB  # not lowered: its sender's upload was the limit
    # A slow download with a sender that kept up is the receiver's own.
    table.observe("other", LinkSample("v1", down=3 * MB, down_limited=True, parent="source"))
    assert table.link("other").down == pytest.approx(3 * MB)


def test_slowness_inherited_from_upstream_is_nobodys_download():
    """Chain source -> a -> b -> c where a uploads slowly: b and c both receive slowly, but only
    a is to blame (b forwarded as fast as it received)."""
    table = LinkTable(uplink=20 * MB, default=8 * MB)
    table.observe("c", LinkSample("v1", down=2 * MB, down_limited=True, parent="b"))
    table.observe("b", LinkSample("v1", down=2.05 * MB, down_limited=True, up=2 * MB, up_limited=False, parent="a"))
    table.observe("a", LinkSample("v1", down=7.6 * MB, up=2.05 * MB, up_limited=True, parent="source"))
    assert table.link("a").up == pytest.approx(2.05 * MB)
    assert table.link("b").down == table.link("c").down == 8 * MB
    assert table.link("b").up == 8 * MB  # forwarding at its inbound rate proves nothing against it


def test_uplink_sample_needs_every_chain_slow():
    pushes = [{"chain": 0, "seconds": 2.0, "bytes": 8 * MIB}, {"chain": 1, "seconds": 2.0, "bytes": 8 * MIB}]
    rates = [8 * MB, 8 * MB]  # both chains ran at ~4.2 MB/s of a planned 8
    s = uplink_sample(Stats(pushes=pushes), rates)
    assert s.up == pytest.approx(2 * 8 * MIB / 2.0) and s.up_limited
    one_slow = [{**pushes[0], "seconds": 1.05}, pushes[1]]  # chain 0 kept its rate: chain 1's head is slow
    assert not uplink_sample(Stats(pushes=one_slow), rates).up_limited


@pytest.mark.parametrize("bad", [
    {"key": "v1", "down": -1}, {"key": "v1", "down": float("nan")}, {"key": "v1", "up": "fast"},
    {"key": "v1", "down_limited": "yes"}, {"down": 1.0}, ["v1"], {"key": "v1", "parent": 3},
])
def test_malformed_samples_are_refused_with_the_field_named(bad):
    with pytest.raises(ValueError, match="link sample") as e:
        LinkSample.from_dict(bad)
    if "key" not in bad:  # the field is named as sent, and the sample is not echoed back
        assert "`key` names the version" in str(e.value) and "v1" not in str(e.value).replace('"v12"', "")


def test_measured_upload_moves_a_misdeclared_worker_to_a_tail():
    """Four relays declare 8 MB/s each way; w4 really uploads at 2 MB/s. Version 1 is planned
    from the declarations (w4 heads a chain, its child waits on it); the relays' link samples
    refresh the table; version 2's plan puts w4 at a tail and arrives about 4x sooner."""
    from broadcast.relay import Relay, Source
    from broadcast.signing import SigningKey

    key = SigningKey.generate()
    M, chunk, U = 4 * MIB, 256 << 10, 16 * MB
    table = LinkTable(uplink=U, default=100 * MB)
    ids = ["w1", "w2", "w3", "w4"]
    for w in ids:
        table.declare(w, down=8 * MB, up=8 * MB)

    def tails(plan):
        return {c[-1] for c in plan.chains}

    async def run():
        src = Source(key)
        await src.start()
        relays = {w: Relay(w, key.public_key(), up_rate=2 * MB if w == "w4" else None) for w in ids}
        for r in relays.values():
            await r.start()
        hops = {w: r.hop for w, r in relays.items()}
        times, plans = [], []
        try:
            for version in (1, 2):
                plan = plan_broadcast(M, table.uplink.rate, [table.link(w) for w in ids], chunk, headroom=0.95,
                                      designs=("star", "chains"))  # the scenario is who heads a chain
                plans.append(plan)
                await src.publish(os.urandom(M), version, chunk_size=chunk)
                t0 = time.monotonic()
                await src.push_plan(f"v{version}", plan, hops)
                for r in relays.values():
                    await r.wait(f"v{version}", 20)
                times.append(time.monotonic() - t0)
                for r in relays.values():
                    await r.wait_settled(f"v{version}", 20)
                for w, r in relays.items():  # what the workers' heartbeats would carry
                    for s in r.link_samples():
                        table.observe(w, s)
            return times, plans
        finally:
            for n in (*relays.values(), src):
                await n.stop()

    (t1, t2), (p1, p2) = asyncio.run(run())
    assert p1.kind == "chains" and "w4" not in tails(p1)  # declared equal: w4 relays for someone
    assert table.link("w4").up == pytest.approx(2 * MB, rel=0.2)  # measured, not declared
    assert all(table.link(w).down == 8 * MB for w in ids)  # nobody's download was blamed
    assert p2.kind == "chains" and "w4" in tails(p2)
    assert t2 < 0.5 * t1, (t1, t2)


def test_samples_waiting_for_a_plan_are_bounded_and_a_forgotten_peer_stays_forgotten():
    """In star mode nothing plans: one worker's heartbeats of 16 fresh keys each queued 1,600
    samples a second, forever. And a forgotten worker's waiting samples brought it back at the
    next settle, with its series in /metrics, for good."""
    from broadcast.links import MAX_PENDING

    t = LinkTable(uplink=100e6, default=10e6)
    for i in range(3 * MAX_PENDING):
        t.observe("flood", LinkSample(f"x{i}", down=5e6, down_limited=True))
    assert len(t._pending) < MAX_PENDING
    assert t.peers["flood"].down.source == "measured"
    t.observe("gone", LinkSample("v1", down=5e6, down_limited=True))
    t.observe("stays", LinkSample("v1", down=5e6, down_limited=True))
    t.forget("gone")
    t.settle()
    assert "gone" not in t.peers and "gone" not in t.to_dict()["peers"] and "stays" in t.peers
