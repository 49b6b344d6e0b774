"""netem in real network namespaces: caps, latency, teardown. Skipped (with the reason) where
this machine cannot build them: no root, no `ip netns`, no veth/bridge/htb."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from netem import HostSpec, Topology, iproute
from netem.capability import probe
from netem.measure import goodput_mbit, rtt_ms
from netem.scenario import cli, load_scenario

ROOT = Path(__file__).resolve().parents[2]
CAPS = probe()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(not CAPS.namespaces, reason=CAPS.reason)]


def _ours() -> set[str]:
    return set(iproute.ours(include_live=True))


def _two(mbit: float = 50, delay_a: float = 0, delay_b: float = 0) -> list[HostSpec]:
    return [
        HostSpec(name="a", up_mbit=mbit, down_mbit=mbit, delay_ms=delay_a),
        HostSpec(name="b", up_mbit=mbit, down_mbit=mbit, delay_ms=delay_b),
    ]


@pytest.mark.parametrize("delay_ms", [0, 10], ids=["direct", "via-relay"])
def test_goodput_two_hosts_50mbit(delay_ms: float) -> None:
    """20 MB over plain asyncio TCP between two namespaces: 90-100% of the 50 Mbit/s cap
    (packet overhead costs ~4%), with and without a delay relay in the path."""
    with Topology(_two(50, delay_ms, delay_ms)) as topo:
        mbit = goodput_mbit(topo, "a", "b", 20_000_000)
    assert 45.0 <= mbit <= 51.0, f"{mbit:.1f} Mbit/s on a 50 Mbit/s link"


def test_upload_and_download_caps_are_separate() -> None:
    """a uploads at 20 Mbit/s; b downloads at up to 100: the a -> b path runs at ~20."""
    hosts = [
        HostSpec(name="a", up_mbit=20, down_mbit=100),
        HostSpec(name="b", up_mbit=100, down_mbit=100),
    ]
    with Topology(hosts) as topo:
        up = goodput_mbit(topo, "a", "b", 5_000_000)
        down = goodput_mbit(topo, "b", "a", 20_000_000, port=9502)
    assert 18.0 <= up <= 20.4, up
    assert 90.0 <= down <= 102.0, down


def test_latency_between_namespaces() -> None:
    """Path latency is delay_a + delay_b one way, so the RTT is 2 x (10 + 15) = 50 ms."""
    with Topology(_two(100, 10, 15)) as topo:
        rtt = rtt_ms(topo, "a", "b")
        assert topo.delay_ms("a", "b") == 25
        # the relay for (a, b, port) is made once and reused
        assert topo.address("a", "b", 9501) == topo.address("a", "b", 9501)
    assert 50.0 <= rtt <= 58.0, f"RTT {rtt:.1f} ms, expected ~50"


def test_teardown_leaves_nothing_even_when_the_body_raises() -> None:
    before = _ours()
    with pytest.raises(RuntimeError, match="body failed"), Topology(_two(10, 5, 5)) as topo:
        made = {topo.hub_ns, *(h.ns for h in topo)}
        assert made <= set(iproute.netns_list())
        sleeper = topo["a"].start([sys.executable, "-c", "import time; time.sleep(60)"])
        topo.address("a", "b", 9000)  # starts the hub's relay server too
        raise RuntimeError("body failed")
    assert _ours() == before
    assert not made & set(iproute.netns_list())
    assert sleeper.poll() is not None
    # no interface of ours appears in the root namespace at any point
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert "br0" not in links and " h1" not in links


def test_hosts_reach_each_other_and_nothing_else() -> None:
    with Topology(_two()) as topo:
        probe_b = f"import socket; print(socket.socket().connect_ex(('{topo['b'].ip}', 1)))"
        ok = topo["a"].run([sys.executable, "-c", probe_b])
        assert ok.output.strip() == "111"  # ECONNREFUSED: b answered
        routes = topo["a"].run(["ip", "route"]).output
        assert "default" not in routes  # no way out of the emulated network


def test_cleanup_removes_only_dead_runs_leftovers() -> None:
    child = [sys.executable, "-c", "import os; print(os.getpid())"]
    dead = subprocess.run(child, capture_output=True, text=True, check=True).stdout.strip()
    stale = f"{iproute.PREFIX}{dead}-0-stale"
    live = iproute.netns_name("t", "live")
    try:
        for ns in (stale, live):
            iproute.ip("netns", "add", ns)
        removed = iproute.cleanup()
        assert stale in removed and live not in removed
        assert live in iproute.netns_list()
    finally:
        for ns in (stale, live):
            iproute.netns_delete(ns)
    with pytest.raises(Exception, match="not one of ours"):
        iproute.netns_delete("somebody-elses")


def test_cli_runs_a_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    before = _ours()
    show = "import os; print('{ip[b]}', '{addr[a][b][9000]}', os.path.exists(os.environ['NETEM_TOPOLOGY']))"
    smoke = str(ROOT / "configs/wan/smoke-2-hosts.toml")
    code = cli(["run", smoke, "--host", "a", "--", sys.executable, "-c", show])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "10.231.0.2 10.231.0.254:" in out and "True" in out
    assert _ours() == before
    assert cli(["run", smoke, "--", sys.executable, "-c", "raise SystemExit(4)"]) == 4


def test_a_scenario_out_of_time_shows_what_each_process_printed(tmp_path: Path, capsys) -> None:
    # A learner and its workers in a scenario, killed at --timeout: only the timeout was printed,
    # not the workers' own lines saying why (every heartbeat refused), which were what mattered.
    scenario = tmp_path / "two.toml"
    scenario.write_text((ROOT / "configs/wan/smoke-2-hosts.toml").read_text() + f"""
[[processes]]
host = "b"
cmd = ["{{python}}", "-c", "import time; print('b says why', flush=True); time.sleep(60)"]
""")
    code = cli(["run", str(scenario), "--host", "a", "--timeout", "2", "--", sys.executable, "-c",
                "import time; print('a says why', flush=True); time.sleep(60)"])
    captured = capsys.readouterr()
    assert code == 124, captured
    assert "b says why" in captured.out and "a says why" in captured.out
    assert "still running after 2 s" in captured.err


@pytest.mark.slow
def test_reference_scenario_workers_get_their_caps() -> None:
    """learner-1g-workers-200m: each worker pulls at ~190 Mbit/s, learner out ~950 Mbit/s."""
    scenario = load_scenario(ROOT / "configs/wan/learner-1g-workers-200m.toml")
    with scenario.topology() as topo:
        for w in ("worker1", "worker4"):
            mbit = goodput_mbit(topo, "learner", w, 50_000_000)
            assert 180.0 <= mbit <= 202.0, (w, mbit)
        assert 80.0 <= rtt_ms(topo, "worker1", "learner") <= 90.0
    hosts = [
        HostSpec(name="l", up_mbit=1000, down_mbit=1000),
        HostSpec(name="w", up_mbit=1000, down_mbit=1000),
    ]
    with Topology(hosts) as topo:
        mbit = goodput_mbit(topo, "l", "w", 250_000_000)
    assert 900.0 <= mbit <= 1010.0, mbit


def test_a_host_behind_nat_refuses_inbound_connections_but_connects_out() -> None:
    """`accept_inbound = false`: a SYN to the host is dropped (the connect times out, where an
    open host answers at once), while the host's own connections and their replies work."""
    specs = _two()
    specs[1] = HostSpec(name="b", up_mbit=50, down_mbit=50, accept_inbound=False)
    with Topology(specs) as topo:
        connect = "import socket; s = socket.socket(); s.settimeout(1.5); print(s.connect_ex(('{ip}', {port})))"
        a_to_b = topo["a"].run([sys.executable, "-c", connect.format(ip=topo["b"].ip, port=1)])
        b_to_a = topo["b"].run([sys.executable, "-c", connect.format(ip=topo["a"].ip, port=1)])
        assert a_to_b.output.strip() == "11"  # EAGAIN: the SYN vanished (timed out), no RST came back
        assert b_to_a.output.strip() == "111"  # ECONNREFUSED from a: b's outbound SYN and a's reply pass
        assert goodput_mbit(topo, "b", "a", 2_000_000) > 30  # b uploads over its own connection
