"""The demo as a fleet in network namespaces (configs/wan/demo-fleet.toml): a real learner and
four real `echo-worker join`s with default settings on shaped consumer lines, one behind NAT.
Until 2026-12-07 every such worker was refused each heartbeat (its relay bound loopback, not the
address the learner saw it connect from) and the run never trained; a relay bound elsewhere is
a pulling leaf now, and by default a relay binds where the learner sees its worker."""

from __future__ import annotations

from pathlib import Path

import pytest

from netem.capability import probe
from netem.scenario import cli

ROOT = Path(__file__).resolve().parents[2]
CAPS = probe()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(not CAPS.namespaces, reason=CAPS.reason)]


def test_the_demo_fleet_trains_and_its_workers_forward_versions(tmp_path, capsys, monkeypatch, tiny_model):
    scenario = tmp_path / "fleet.toml"  # the shipped fleet, a shorter run, its run directory here, the suite's model
    # (a fresh clone has no models/tiny-arith until `make model`: its learner exited, and CI failed)
    shorter = (f'"--run.steps", "12", "--run.eval_every", "0", "--run.dir", "{tmp_path / "runs"}", '
               f'"--model.path", "{tiny_model}"')
    scenario.write_text((ROOT / "configs/wan/demo-fleet.toml").read_text()
                        .replace('"--run.steps", "60", "--run.eval_every", "30"', shorter)
                        .replace('"--worker.name",', f'"--worker.cache_dir", "{tmp_path / "cache"}", "--worker.name",'))
    monkeypatch.chdir(ROOT)  # its commands name configs/demo.toml
    code = cli(["run", str(scenario), "--timeout", "240"])
    out = capsys.readouterr().out
    assert code == 0, out[-4000:]
    by_process = dict(part.split("\n", 1) for part in out.split("--- ")[1:] if "\n" in part)
    logs = {name.split(":")[0]: text for name, text in by_process.items()}
    assert set(logs) == {"learner", "worker1", "worker2", "worker3", "natted"}, list(by_process)
    assert all("heartbeat failed" not in text and "did not answer heartbeats" not in text for text in logs.values())
    assert all("run finished" in logs[w] for w in ("worker1", "worker2", "worker3", "natted"))
    assert "the learner does not connect to this relay" in logs["natted"], logs["natted"]  # NAT'd: a leaf that pulls
    # The others' relays are at the address the learner sees: probed and reachable, so planned to
    # forward (whether a 12-step run pushes between them depends on how many the scheduler has
    # active when each version is planned; the shipped 60-step run pushed 79 times).
    assert not any("the learner does not connect" in logs[w] for w in ("worker1", "worker2", "worker3"))
    assert "12 in" in logs["learner"]  # the summary's steps
