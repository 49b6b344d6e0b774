"""The broadcast benchmark's own logic, without namespaces: options, victim choice, hop lag,
the synthetic updates, and the table (rendered from a results dict shaped like a real run)."""

from __future__ import annotations

import numpy as np
import pytest

from broadcast.bench import netem_runs as bench
from broadcast.planner import PeerLink, plan_broadcast

MIB = 1 << 20


def test_not_root_exits_2_with_the_reason(monkeypatch, capsys):
    monkeypatch.setattr(bench.os, "geteuid", lambda: 1000)
    assert bench.cli(["--quick"]) == 2
    assert "needs root" in capsys.readouterr().err


def test_bad_worker_list_is_a_usage_error():
    with pytest.raises(SystemExit):
        bench.cli(["--workers", "4,x"])


def test_victim_is_a_middle_relay_of_the_longest_chain():
    b = 6e6
    peers = [PeerLink(f"w{i}", b, b, 0.02) for i in range(1, 17)]
    plan = plan_broadcast(256 * MIB, 4 * b, peers, 4 * MIB, designs=["chains"])
    assert plan.kind == "chains" and plan.k == 4
    victim = bench._victim(plan)
    chain = next(c for c in plan.chains if victim in c)
    assert 0 < chain.index(victim) < len(chain) - 1  # someone below it must repair


def test_hop_lag_is_the_worst_child_behind_parent():
    run = {"plan": {"chains": [["a", "b", "c"], ["d"]]}, "arrivals": {"a": 10.0, "b": 11.0, "c": 13.5, "d": 9.0}}
    assert bench.hop_lag(run) == 2.5
    assert bench.hop_lag({"plan": {"chains": [["a"], ["b"]]}, "arrivals": {"a": 1.0, "b": 2.0}}) is None


def test_synthetic_update_changes_about_three_percent_of_elements():
    base, new = bench.synthetic_update(4 * MIB, seed=1)
    a, b = np.frombuffer(base, np.float32), np.frombuffer(new, np.float32)
    changed = np.mean(a != b)
    assert 0.025 < changed < 0.035
    assert np.allclose(a, b, rtol=1e-2)  # small steps, as an optimizer makes


def test_bf16_update_at_lr_1e_6_changes_few_elements_by_one_ulp():
    """fp32 masters moved by ~1e-6 keep most bf16 values: only weights within a step of a
    rounding boundary flip, and those by one bf16 ulp."""
    base, new = bench.bf16_update(4 * MIB, seed=1)
    a, b = np.frombuffer(base, np.uint16), np.frombuffer(new, np.uint16)
    changed = a != b
    assert 0.002 < changed.mean() < 0.05
    ulps = np.abs(a[changed].astype(np.int32) - b[changed].astype(np.int32))
    assert np.mean(ulps == 1) > 0.8  # mostly neighbours (more only near zero, where the ulp is tiny)


def test_fleets_have_the_uploads_the_issue_asks_for():
    assert set(bench.fleet_links("sym", 8, 50).values()) == {(50, 50)}
    assert set(bench.fleet_links("asym", 8, 50).values()) == {(50, 12.5)}
    mixed = bench.fleet_links("mixed", 32, 50)
    assert sum(1 for d, u in mixed.values() if u == 2.5) == 8 and len(mixed) == 32
    with pytest.raises(bench.BenchError):
        bench.fleet_links("lan", 4, 50)


def test_render_prints_every_measurement():
    def run(name, measured, predicted, plan, arrivals, **kw):
        return {"name": name, "ok": True, "measured_s": measured, "predicted_s": predicted, "plan": plan,
                "arrivals": arrivals, "cpu_busy": 0.5, "repairs": 0, "bytes_in": 0, "error": "", **kw}

    chains = {"kind": "chains", "chains": [["w1", "w2"], ["w3", "w4"]], "parents": []}
    stripes = {"kind": "stripes", "chains": [["w1", "w2", "w3", "w4"]] * 4, "parents": [[-1, 0, 0, 0]] * 4}
    arr = {"w1": 45.0, "w2": 46.0, "w3": 45.5, "w4": 46.5}
    results = {
        "settings": {"size_mib": 64, "chunk_mib": None, "uplink_mbit": 100, "link_mbit": 50, "rtt_ms": 40},
        "latency": "relay",
        "sizes": [{"fleet": "asym", "n": 4, "t_star": 40.0, "choice": "stripes", "choice_shape": "4 stripes",
                   "calibration": {"share": 0.96}, "runs": {
                       "chains": run("chains", 62.0, 60.0, chains, arr),
                       "stripes": run("stripes", 44.0, 42.0, stripes, arr),
                       "fault": run("fault", 50.0, 42.0, stripes, {"w2": 45, "w3": 46, "w4": 50}, killed="w1",
                                    killed_at_s=16.8, repairs=3, bytes_in=3 * 64 * MIB),
                       "delta-bf16": run("delta-bf16", 1.8, 1.7, stripes, arr, source={
                           "wire_bytes": 4 * MIB, "total_bytes": 64 * MIB, "publish_s": 0.4, "decode_s": 0.5,
                           "decoded_ok": True, "changed_share": 0.012}),
                   }}],
        "extra": {"nat": {"n": 4, "worker": "w4", "reachable": {"w1": True, "w4": False}, "t_star": 40.0,
                          "plan": "3 stripes", "pull": ["w4"], "nat_arrival_s": 43.0, "nat_parent": "w2",
                          "nat_repairs": 0, "run": run("nat", 44.0, 42.0, stripes, arr)}},
    }
    text = bench.render(results)
    assert "stripes (4 stripes)" in text and "2x2" in text
    assert "1.55" in text and "1.10" in text  # chains and stripes measured / T*
    assert "stripe owner w1 SIGKILLed at 16.8 s; 3/3 survivors complete" in text and "1.14x the fault-free" in text
    assert "1.20% of elements changed" in text and "(16.0x)" in text and "decoded bytes match" in text
    assert "found unreachable: w4" in text and "w4 complete at 43.00 s (its largest span from w2, 0 repairs)" in text


# -- what the benchmark found, each fix pinned down ------------------------------------------
def test_headroom_plans_uploads_below_their_measured_rate():
    b, L, M, c = 6e6, 0.02, 256 * MIB, 4 * MIB
    peers = [PeerLink(f"w{i}", b, b, L) for i in range(1, 17)]
    full = plan_broadcast(M, 4 * b, peers, c)
    paced = plan_broadcast(M, 4 * b, peers, c, headroom=0.95)
    assert paced.chains == full.chains and paced.rates == pytest.approx([0.95 * b] * 4)
    assert paced.predicted_s == pytest.approx(M / (0.95 * b) + 4 * L + 3 * c / (0.95 * b))
    assert paced.lower_bound_s == full.lower_bound_s  # the bound stays the physical one
    with pytest.raises(ValueError, match="headroom"):
        plan_broadcast(M, 4 * b, peers, c, headroom=1.5)


def test_relays_forward_at_the_chain_rate_of_the_signed_route():
    """The source paces a chain; each relay must forward at that rate too, even when it has
    the whole version already (it received faster, or caught up after a repair). The rate is
    signed into the route: a relay that lowers it to throttle the chain is refused."""
    import asyncio
    import os

    import aiohttp

    from broadcast.manifest import build_manifest
    import msgpack

    from broadcast.relay import PREFIX, Relay
    from broadcast.route import Route, route_for, sign_route
    from broadcast.signing import SigningKey, sign_manifest
    from broadcast.transport import Hop, frame_header

    key = SigningKey.generate()
    blob = os.urandom(2 * MIB)
    signed = sign_manifest(key, build_manifest(blob, 1, chunk_size=256 << 10))
    rate = 2e6  # bytes/s: w2 needs ~1 s behind w1, which gets everything at loopback speed

    async def run():
        w1, w2 = Relay("w1", key.public_key()), Relay("w2", key.public_key())
        await w1.start()
        await w2.start()
        try:
            route = sign_route(key, route_for(signed.manifest, Hop("source", "http://127.0.0.1:9"), [[w1.hop, w2.hop]],
                                              [rate], paced=True))
            r = route.route
            throttled = Route(r.key, r.root, r.source, r.chains, (rate / 100,), True)
            tampered = msgpack.packb([throttled.to_bytes(), route.signature], use_bin_type=True)

            async def body(route_wire):
                yield frame_header({"manifest": signed.to_wire(), "route": route_wire, "from": "source"})
                for ch in signed.manifest.chunks:
                    yield frame_header({"i": ch.index, "n": ch.wire_length})
                    yield blob[ch.offset:ch.offset + ch.length]

            async with aiohttp.ClientSession() as s:
                try:  # a rewritten rate is refused before anything is stored; the relay cuts the stream
                    async with s.post(f"{w1.url}{PREFIX}/push", data=body(tampered)) as resp:
                        assert resp.status == 403
                except aiohttp.ClientError:
                    pass  # reset while we were still sending: also a refusal
                assert "v1" not in w1.stores
                async with s.post(f"{w1.url}{PREFIX}/push", data=body(route.to_wire())) as resp:
                    assert resp.status == 200
            a, b = await w1.wait("v1", 10), await w2.wait("v1", 10)
            return a.stats, b.stats, bytes(b.data)
        finally:
            await w1.stop()
            await w2.stop()

    s1, s2, data = asyncio.run(run())
    assert data == blob
    assert s1.t_complete - s1.t_start < 0.5
    assert s2.t_complete - s1.t_start >= 0.8 * len(blob) / rate
