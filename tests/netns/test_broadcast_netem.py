"""The relay on emulated wide-area links: namespaces, 50 Mbit/s caps, 20 ms one way per hop.

A learner whose uplink equals a worker's link makes the planner choose one chain through all
three workers; the real `Source`/`Relay` code then moves 16 MiB along it. Every relay must end
with the source's exact bytes (blake3 of the whole buffer, on top of per-chunk verification),
in about the planner's predicted time. Skipped with the reason where namespaces are missing.
The full sweep is a benchmark (`echo-rl bench broadcast`), not a test; its `--quick` smoke run
is the slow test at the end.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from broadcast.bench import MBIT, Bench, Settings, cli
from broadcast.planner import plan_broadcast
from netem.capability import probe

CAPS = probe()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(not CAPS.namespaces, reason=CAPS.reason)]


def test_chain_of_three_relays_in_namespaces(tmp_path: Path) -> None:
    settings = Settings(workers=(3,), size_mib=16, chunk_mib=1, uplink_mbit=50, link_mbit=50, rtt_ms=40)
    bench = Bench(settings, 3, tmp_path, log=lambda m: None)
    with bench.topology() as topo:
        cal = bench.calibrate(topo)
        assert 45 <= cal["b_mbit"] <= 51, cal  # caps hold (tc costs ~4%)
        assert 38 <= cal["rtt_ms"] <= 50, cal  # 2 x 20 ms through the delay relay
        # paced a little below the links' capacity, as the benchmark found works best
        plan = plan_broadcast(settings.size, cal["u_mbit"] * MBIT, bench.peers(cal), settings.chunk, headroom=0.95,
                              designs=("star", "chains"))
        assert plan.kind == "chains" and [len(c) for c in plan.chains] == [3]
        run = bench.transfer(topo, "chain", plan, timeout_s=60)
    assert run.ok, run.error  # every relay complete, bytes identical to the source's
    assert sorted(run.arrivals) == ["w1", "w2", "w3"] and run.repairs == 0
    assert run.bytes_in == 3 * settings.size  # nothing received twice
    # Pipelined: the tail finishes about one hop time after the head, not three.
    head, tail = (run.arrivals[w] for w in (plan.chains[0][0], plan.chains[0][-1]))
    assert tail - head < 0.35 * plan.predicted_s
    assert 0.9 * plan.predicted_s <= run.measured_s <= 1.5 * plan.predicted_s, (run.measured_s, plan.predicted_s)


@pytest.mark.slow
def test_quick_benchmark_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """`echo-rl bench broadcast --quick`: the mixed fleet at N=4 along chains and stripes, then a
    worker behind NAT that the learner's probe finds and the plan makes a pulling leaf."""
    assert cli(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "chains meas/T*" in out and "stripes meas/T*" in out
    assert "found unreachable: w4" in out and "pulling: w4" in out and "no fallback" in out
