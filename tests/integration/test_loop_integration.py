"""The whole loop with real processes on loopback: a learner, worker processes, HTTP, torch."""

from __future__ import annotations

import json
import re
import signal

import msgpack
import pytest
import zstandard

from echo.wire import CONTENT_TYPE, GroupMsg, SampleMsg, Submission, encode_submission


def test_two_workers_train_within_the_staleness_bound_and_survive_a_killed_worker(learner_factory):
    S = 1
    steps = 30
    lp = learner_factory(run={"steps": steps}, buffer={"max_staleness": S})
    fast = lp.worker("fast", "--worker.max_rollouts_per_s", "40")  # ~0.4 s/step: the run outlives the lease TTL
    slow = lp.worker("slow", "--worker.max_rollouts_per_s", "3")  # holds each lease for ~5 s
    lp.wait_until(lambda: any(w["name"] == "slow" and w["leased_prompts"] > 0 for w in lp.status()["workers"]),
                  90, "the slow worker to hold a lease")
    held = next(w["leased_prompts"] for w in lp.status()["workers"] if w["name"] == "slow")
    slow.send_signal(signal.SIGKILL)  # dies holding prompts: nobody will submit them
    lp.wait_until(lambda: lp.status()["leases"]["expired_prompts"] >= held, 30,
                  "the dead worker's lease to expire")

    assert lp.finished(180) == 0, lp.output()[-3000:]
    summary = json.loads((lp.run_dir / "summary.json").read_text())
    records = lp.records()
    assert summary["steps"] == steps and [r["step"] for r in records] == list(range(1, steps + 1))
    assert all(0 <= s <= S for r in records for s in r["staleness"]), [r["staleness"] for r in records]
    assert summary["leases_reissued"] >= held  # the dead worker's prompts went back out
    assert summary["groups_trained"] == steps * 4
    assert (lp.run_dir / "checkpoints" / "latest" / "state" / ".metadata").exists()  # torch.distributed.checkpoint
    assert (lp.run_dir / "model" / "model.safetensors").exists()  # the trained model as an HF directory
    # Eval ran on the workers: the first and the last version, every prompt answered.
    evals = [json.loads(line) for line in (lp.run_dir / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
    assert [e["step"] for e in evals] == [0, steps] and all(e["where"] == "workers" and e["prompts"] == 16 for e in evals)
    assert summary["eval_version_end"] == steps and summary["eval_metric"] == "accuracy"
    assert fast.wait(30) == 0  # told the run finished, it exits cleanly
    # Versions went out by the signed push (chain mode, the default), and their arrival was timed.
    published = [r["snapshot_bytes"] for r in records if "snapshot_bytes" in r]
    assert published and any(p["plans"] for p in published)
    plan = next(iter(next(p for p in published if p["plans"])["plans"].values()))
    assert plan["predicted_s"] >= plan["lower_bound_s"] > 0 and plan["links_mbit"]  # what it was planned from
    assert any("t_bcast" in r for r in records)


def _group(prompt_id: str, version: int, n: int = 4, logprob: float = -1.0) -> GroupMsg:
    return GroupMsg(prompt_id, version, [SampleMsg([5, 2], [logprob, logprob], 1.0) for _ in range(n)])


def test_bad_uploads_are_refused_with_reasons_and_the_learner_keeps_running(learner_factory):
    S = 1
    lp = learner_factory(run={"steps": 100000}, buffer={"max_staleness": S}, server={"max_body_mb": 1.0})
    lp.worker("w", "--worker.max_rollouts_per_s", "200")

    status, body = lp.request("POST", "/v1/join", {"name": "intruder"}, token=None)
    assert status == 401 and "token" in body["message"]
    status, body = lp.request("POST", "/v1/join", {"name": "intruder"}, token="guess")
    assert status == 401 and body["error"] == "unauthorized"

    wid, cred = lp.join("probe")
    # Measured links arrive with heartbeats; malformed ones are refused with the field named.
    status, body = lp.request("POST", "/v1/heartbeat", {"links": [{"key": "v1", "down": -5}]}, token=cred)
    assert status == 400 and "down must be a positive number" in body["message"]
    status, body = lp.request("POST", "/v1/heartbeat", {"rtt_ms": "slow"}, token=cred)
    assert status == 400 and "rtt_ms" in body["message"]
    status, _ = lp.request("POST", "/v1/heartbeat", {"rtt_ms": 80.0, "upload_mbit": 20, "links": [
        {"key": "v0", "down": 2.5e6, "down_limited": True, "parent": "source"}]}, token=cred)
    assert status == 200
    probe = lp.status()["links"]["peers"][wid]
    assert probe["rtt_ms"] == 80.0 and probe["up"] == {"mbit": 20.0, "source": "declared", "samples": 0}
    # A sample of a version whose route did not place it (chain mode) is not a measurement
    # (test_untrusted: test_link_samples_and_declared_links_raise_nothing_a_route_did_not_measure)
    assert probe["down"]["samples"] == 0 and probe["down"]["source"] != "measured"
    lp.wait_until(lambda: lp.status()["published_version"] >= 0, 30, "a published snapshot")
    status, lease = lp.request("POST", "/v1/lease", {"max_prompts": 2}, token=cred)
    assert status == 200 and lease["lease_id"], lease
    version = lease["snapshot"]["version"]
    p0, p1 = (p["id"] for p in lease["prompts"])

    def submit(sub: Submission | bytes, content_type=CONTENT_TYPE):
        body = sub if isinstance(sub, bytes) else encode_submission(sub)
        return lp.request("POST", "/v1/trajectories", body, content_type=content_type, token=cred)

    assert submit(b"\x00garbage")[1]["error"] == "malformed"
    assert submit(b"\x00garbage")[0] == 400
    assert submit(encode_submission(Submission(wid, lease["lease_id"], [_group(p0, version)])), "text/plain")[0] == 415
    status, body = submit(Submission(wid, lease["lease_id"], [_group(p0, version, logprob=float("nan"))]))
    assert (status, body["error"]) == (422, "bad-logprobs")
    status, body = submit(Submission(wid, lease["lease_id"], [_group(p0, version, n=3)]))
    assert (status, body["error"]) == (422, "wrong-group-size")
    status, body = submit(Submission(wid, "no-such-lease", [_group(p0, version)]))
    assert (status, body["error"]) == (409, "unknown-lease")
    status, body = submit(Submission(wid, lease["lease_id"], [_group(p0, version + 1000)]))
    assert (status, body["error"]) == (422, "future-version")
    huge = zstandard.ZstdCompressor(level=1).compress(msgpack.packb({"x": __import__("os").urandom(2 << 20)}))
    status, body = submit(huge)
    assert (status, body["error"]) == (413, "oversized") and "max_body_mb" in body["message"]

    # A well-formed group becomes too stale once the learner moves S + 1 versions past it.
    def past_window():
        lp.request("POST", "/v1/heartbeat", {"version": version}, token=cred)  # keep the lease alive
        return lp.status()["learner_version"] > version + S

    lp.wait_until(past_window, 90, "the learner to move past the staleness window")
    status, body = submit(Submission(wid, lease["lease_id"], [_group(p1, version)]))
    assert (status, body["error"]) == (409, "stale-version") and f"max staleness is {S}" in body["message"]
    # The age it states is past S: "2 updates old ...; max staleness is 2" read as an off-by-one
    assert int(re.search(r"would be (\d+) updates old when trained", body["message"]).group(1)) > S, body["message"]

    # Still serving and still training, and every refusal was counted by reason.
    v = lp.status()["learner_version"]
    lp.wait_until(lambda: lp.status()["learner_version"] > v, 60, "training to continue")
    metrics = lp.request("GET", "/metrics", token=None)[1]
    for reason in ("malformed", "bad-logprobs", "wrong-group-size", "unknown-lease", "future-version",
                   "oversized", "stale-version"):
        assert f'echo_trajectories_rejected_total{{reason="{reason}"}}' in metrics, reason
    assert 'echo_auth_refused_total{credential="run-token"} 2.0' in metrics


def test_stale_groups_give_every_prompt_back_and_duplicates_queue_nothing(learner_factory):
    """The last round's lease leak: an upload of several stale groups gave back only the first
    prompt, and heartbeats kept the rest leased for ever (four such uploads starved the learner).
    Now each stale group's prompt goes back, fresh groups of the same upload are kept, a prompt
    twice is refused before anything is queued, and the lease is left with nothing outstanding."""
    S = 1
    # The hand-made groups' rewards are not the task's: this test is about leases, not verification.
    lp = learner_factory(run={"steps": 100000}, buffer={"max_staleness": S}, verify={"rescore_fraction": 0.0})
    lp.worker("w", "--worker.max_rollouts_per_s", "200")
    wid, cred = lp.join("probe")
    lp.wait_until(lambda: lp.status()["published_version"] >= 0, 30, "a published snapshot")
    status, lease = lp.request("POST", "/v1/lease", {"max_prompts": 4}, token=cred)
    assert status == 200, lease
    old = lease["snapshot"]["version"]
    ids = [p["id"] for p in lease["prompts"]]
    assert len(ids) == 4

    def submit(groups):
        return lp.request("POST", "/v1/trajectories", encode_submission(Submission(wid, lease["lease_id"], groups)),
                          content_type=CONTENT_TYPE, token=cred)

    def leased() -> int:
        return next(w["leased_prompts"] for w in lp.status()["workers"] if w["id"] == wid)

    accepted = lp.status()["buffer"]["accepted"]
    status, body = submit([_group(ids[0], old), _group(ids[0], old)])
    assert (status, body["error"]) == (422, "duplicate-prompt") and "nothing of this upload was queued" in body["message"]
    assert leased() == 4  # the lease is untouched: a corrected upload can follow

    def past_window():
        lp.request("POST", "/v1/heartbeat", {}, token=cred)  # keeps the lease alive, as a real worker would
        return lp.status()["learner_version"] > old + S

    lp.wait_until(past_window, 90, "the learner to move past the staleness window")
    fresh = lp.status()["published_version"]
    reissued = lp.status()["leases"]["reissued"]
    # Two stale groups and one fresh in one upload: the fresh one is kept, both stale prompts go back.
    status, body = submit([_group(ids[0], old), _group(ids[1], old), _group(ids[2], fresh)])
    assert status == 200 and body == {"accepted": 1, "given_back": 2}
    assert lp.status()["leases"]["reissued"] == reissued + 2 and leased() == 1
    # All stale: refused, and every prompt of it goes back.
    status, body = submit([_group(ids[3], old)])
    assert (status, body["error"]) == (409, "stale-version") and "1 prompts were given back" in body["message"]
    assert leased() == 0 and lp.status()["leases"]["reissued"] == reissued + 3
    assert lp.status()["buffer"]["accepted"] >= accepted + 1


@pytest.mark.parametrize("seconds", [pytest.param(10, id="short"),
                                     pytest.param(600, marks=[pytest.mark.slow, pytest.mark.timeout(900)], id="10-minutes")])
def test_s1_with_four_workers_of_different_speeds_never_stalls(learner_factory, seconds):
    """S = 1 with workers 50× apart in speed: the slow ones' groups arrive stale, are refused
    with their prompts given back, and the workers hand their leases back; leases never pile up
    and the learner never waits long for a batch. `make test` runs 10 s, `make test-slow` 10 min."""
    import time

    # The token check's defaults hold here: the fastest honest worker, held to a slow voter's
    # few tokens, was quarantined by that voter's noise twice on 2026-11-29 (the drift's error is
    # counted now: test_a_fast_worker_is_not_read_as_choosing_its_tokens_by_a_slow_voters_noise).
    lp = learner_factory(run={"steps": 1_000_000}, buffer={"max_staleness": 1})
    for name, rate in (("a", 200), ("b", 50), ("c", 12), ("d", 4)):
        lp.worker(name, "--worker.max_rollouts_per_s", str(rate))
    lp.wait_until(lambda: lp.status()["learner_version"] >= 1, 90, "the first update")
    start, longest_wait = time.monotonic(), 0.0
    version, since = lp.status()["learner_version"], time.monotonic()
    while time.monotonic() - start < seconds:
        time.sleep(0.5)
        st = lp.status()
        if st["learner_version"] > version:
            version, since = st["learner_version"], time.monotonic()
        longest_wait = max(longest_wait, time.monotonic() - since)
        assert longest_wait < 20, f"no update for {longest_wait:.0f} s at v{version}: {st['leases']} {st['buffer']}"
        assert st["leases"]["outstanding"] <= 2 * 4, st["leases"]  # (S + 1)·G: the cap holds, nothing leaks
        assert lp.proc.poll() is None, lp.output()[-3000:]
    st = lp.status()
    assert st["leases"]["reissued"] > 0  # slow workers' stale prompts went back...
    assert all(w["alive"] for w in st["workers"])  # ...and every worker kept working
    records = lp.records()
    assert all(0 <= x <= 1 for r in records for x in r["staleness"])
    assert st["quarantined"] == []  # no honest worker read as dishonest (the token check twice did)


def test_s1_i1_leases_no_more_than_can_be_trained_so_little_ages_out(learner_factory):
    """S = 1 with I = 1 and two fast workers: a worker on the previous version was leased a second
    batch while the learner trained, and those groups aged out in the queue, G every other step:
    304 of 944 accepted in a 40-step demo (a new user, 2026-12-07; 0 since). Over 12 steps the old
    rule dropped ~5 batches; at most one is allowed here (a slow lease may still miss its batch)."""
    lp = learner_factory(run={"steps": 12}, buffer={"max_staleness": 1}, publish={"every": 1})
    for name in ("a", "b"):
        lp.worker(name)
    assert lp.finished(120) == 0, lp.output()[-3000:]
    summary = json.loads((lp.run_dir / "summary.json").read_text())
    G = 4  # [trainer] batch_prompts in the tests' config
    assert summary["recycled"] <= G, summary


@pytest.mark.slow  # ~50 s; a resumed run in `make test`: test_untrusted (killed mid-run, resumed, "already finished")
def test_resume_continues_from_the_last_checkpoint(learner_factory):
    lp = learner_factory(run={"steps": 4, "checkpoint_every": 2}, broadcast={"mode": "star"})  # the star path too
    lp.worker("w")
    assert lp.finished(120) == 0, lp.output()[-3000:]
    first = json.loads((lp.run_dir / "summary.json").read_text())
    assert first["steps"] == 4
    # The summary's idle share is the last status line's (the final eval and save are not idle time
    # divided into more wall: it said 45% where the status line said 58%).
    assert first["learner_idle_ratio"] == pytest.approx(lp.records()[-1]["idle_ratio"], abs=1e-3)

    import subprocess
    import sys

    from conftest import ROOT, start_worker

    resumed = subprocess.Popen([sys.executable, "-m", "learner.main", "--resume", str(lp.run_dir), "--run.steps", "7",
                                "--json"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        import time

        deadline = time.monotonic() + 60
        url_file = lp.run_dir / "url"
        written = url_file.stat().st_mtime_ns
        while url_file.stat().st_mtime_ns == written and time.monotonic() < deadline:
            time.sleep(0.1)
        assert url_file.read_text().strip() == lp.url  # the same address: running workers find it again
        worker = start_worker(lp.url, lp.token, "w2", lp.run_dir.parent / "w2.log")
        out, _ = resumed.communicate(timeout=120)
    finally:
        resumed.kill()
    assert resumed.returncode == 0, out[-3000:]
    steps = [r["step"] for r in lp.records()]
    assert steps == [1, 2, 3, 4, 5, 6, 7]  # the log continues; nothing is retrained from zero
    events = [json.loads(line) for line in (lp.run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [e["version"] for e in events if e.get("event") == "eval"]
    assert evals.count(4) == 1 and evals[-1] == 7, evals  # v4's eval came with the checkpoint: not run twice
    assert json.loads((lp.run_dir / "checkpoints" / "latest" / "learner_state.json").read_text())["version"] == 7
    assert worker.wait(30) == 0
    # `--resume` of a finished run: test_untrusted's killed-mid-run test.


def test_scheduler_activates_the_cheapest_sufficient_worker_and_idles_the_other(learner_factory, tmp_path):
    pool = tmp_path / "pool.toml"
    pool.write_text('[[workers]]\nname = "cheap"\nprice_per_hour = 0.1\nrollouts_per_s = 1000\n'
                    '[[workers]]\nname = "pricey"\nprice_per_hour = 1.0\nrollouts_per_s = 1000\n')
    # T_train prior 10 s -> R_req = 16 rollouts / 10 s: one machine covers it. A long window keeps
    # that decision for the whole (short) run, even once the measured step time raises R_req.
    # (Choosing the cheapest among several available machines is tested in test_scheduler_fleet.)
    lp = learner_factory(run={"steps": 30}, scheduler={"pool": str(pool), "provider": "static", "t_train_s": 10.0,
                                                      "t_bcast_s": 0.0, "window_s": 1000.0})
    lp.machine("cheap", "--worker.max_rollouts_per_s", "60")  # ~8 s for the run: time for pricey to join
    lp.wait_until(lambda: any(w["name"] == "cheap" and w["active"] for w in lp.status()["workers"]), 60,
                  "the cheap worker to be activated")
    lp.machine("pricey")  # available too, but the cheap one already covers the target
    lp.wait_until(lambda: any(w["name"] == "pricey" for w in lp.status()["workers"]), 60, "pricey to join")
    assert lp.finished(120) == 0, lp.output()[-3000:]
    summary = json.loads((lp.run_dir / "summary.json").read_text())
    groups = {w["name"]: w["groups"] for w in summary["workers"]}
    assert groups["pricey"] == 0 and groups["cheap"] >= 30 * 4
    assert "idled by the learner's scheduler" in (lp.run_root.parent / "pricey.log").read_text()
    records = lp.records()
    assert all(r["workers_price_per_hour"] == 0.1 for r in records)
    assert summary["cost"]["dollars"] > 0 and records[-1]["dollars_total"] == round(summary["cost"]["dollars"], 6)


def test_a_worker_activated_after_a_version_was_published_pulls_it_at_once(learner_factory, tmp_path):
    """A self-joined worker joins idle where a pool is scheduled, and so pulls nothing then;
    activated, it waited `fallback_s` for a push of v0, planned before it joined and never
    coming: 10 of the first 18 s of a one-worker demo. Here fallback_s is 10 minutes: waiting
    for it fails the test."""
    pool = tmp_path / "pool.toml"  # a machine that never comes: the self-joined worker is activated in its place
    pool.write_text('[[workers]]\nname = "absent"\nprice_per_hour = 0.1\nrollouts_per_s = 1000\n')
    # Heartbeats 3 s apart: the worker hears of its activation after its engine loaded (as in the
    # demo), not before, when the join's own pull would still be to come.
    lp = learner_factory(run={"steps": 3}, scheduler={"pool": str(pool), "provider": "static"},
                         broadcast={"mode": "chain", "fallback_s": 600.0},
                         server={"heartbeat_interval": 3.0, "lease_ttl": 10.0})
    lp.worker("late")
    assert lp.finished(120) == 0, lp.output()[-3000:]
    log = (lp.run_root.parent / "late.log").read_text()
    assert log.index("idled by the learner's scheduler") < log.index("activated by the learner's scheduler")
    assert "pulling v0 from the learner" in log


def test_a_worker_whose_relay_is_not_at_its_own_address_trains_as_a_pulling_leaf(learner_factory):
    """A worker behind NAT advertises a relay at an address the learner does not see it connect
    from (its private one; by default its loopback). The learner refused every heartbeat of it
    (422), so it never counted as alive and never trained: found running a learner and workers in
    network namespaces, each with the default relay. Now it is a leaf that pulls, never probed."""
    lp = learner_factory(run={"steps": 4}, broadcast={"mode": "chain", "fallback_s": 600.0})
    lp.worker("natted", "--worker.advertise_url", "http://127.0.0.2:9")  # it connects from 127.0.0.1
    assert lp.finished(120) == 0, lp.output()[-3000:]
    log = (lp.run_root.parent / "natted.log").read_text()
    assert "heartbeat failed" not in log and "the learner does not connect to this relay at http://127.0.0.2:9" in log
    assert "run finished" in log, log[-2000:]


def test_an_interrupted_learner_takes_the_machines_it_started_with_it(learner_factory, tmp_path):
    """SIGTERM (or Ctrl-C) mid-run: the local provider's workers went on retrying the dead learner
    forever (`make demo` interrupted left four); a market's rented machines would have billed on.
    The provider is closed on every way out of the run, as at its end."""
    import signal
    import time

    from conftest import ROOT

    pool = tmp_path / "pool.toml"
    pool.write_text('[[workers]]\nname = "box"\ncount = 2\nprice_per_hour = 0.1\nrollouts_per_s = 1000\n')
    lp = learner_factory(run={"steps": 100_000}, workers={"config": str(ROOT / "configs" / "worker.toml")},
                         scheduler={"pool": str(pool), "provider": {"type": "local"}, "t_train_s": 10.0,
                                    "t_bcast_s": 0.0})
    lp.wait_until(lambda: lp.status()["learner_version"] >= 1, 90, "the provider's machines to train")
    started = _descendants(lp.proc.pid)
    assert len(started) >= 1
    lp.proc.send_signal(signal.SIGTERM)
    assert lp.finished(60) == 130, lp.output()[-3000:]
    deadline = time.monotonic() + 20
    while _alive(started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(started), lp.output()[-2000:]


def test_a_worker_stopped_by_sigterm_says_so_and_exits_130(learner_factory):
    """`kill` (SIGTERM) of a worker ended it at the signal's default: no line in its log, and its
    relay and engine not closed (a new user, 2026-12-07). It stops as Ctrl-C stops it now."""
    import time

    lp = learner_factory(run={"steps": 100_000})
    worker = lp.worker("w")
    lp.wait_until(lambda: lp.status()["learner_version"] >= 1, 90, "the worker to train")
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(30) == 130
    time.sleep(0.2)
    log = (lp.run_root.parent / "w.log").read_text()
    assert "echo-worker: interrupted" in log and "Traceback" not in log, log[-2000:]


def test_abort_policy_hands_stale_batches_back(learner_factory):
    lp = learner_factory(run={"steps": 15})
    lp.worker("finisher", "--worker.max_rollouts_per_s", "60")
    aborter = lp.worker("aborter", "--engine.on_new_version", "abort", "--worker.max_rollouts_per_s", "20")
    assert lp.finished(120) == 0, lp.output()[-3000:]
    assert aborter.wait(30) == 0
    log = (lp.run_root.parent / "aborter.log").read_text()
    assert "handed" in log and "prompts back" in log  # a newer version arrived mid-batch: no stale submit
    summary = json.loads((lp.run_dir / "summary.json").read_text())
    assert summary["leases_reissued"] > 0 and summary["steps"] == 15


def test_command_provider_launches_machines_with_the_users_command(learner_factory, tmp_path):
    import sys

    from conftest import ROOT

    pool = tmp_path / "pool.toml"
    pool.write_text('[[workers]]\nname = "box"\nprice_per_hour = 0.2\nrollouts_per_s = 100\n')
    launched = tmp_path / "launched.txt"
    launch = (f"echo {{id}} {{price}} >> {launched}; cd {ROOT} && exec {sys.executable} -m worker.main join {{url}} "
              f"--token {{token}} --config configs/worker.toml --worker.name {{id}} "
              f"--worker.cache_dir {tmp_path / 'cache'}")
    lp = learner_factory(run={"steps": 5}, scheduler={"pool": str(pool), "provider": "command",
                                                      "launch_command": launch, "t_train_s": 1.0, "t_bcast_s": 0.0})
    assert lp.finished(120) == 0, lp.output()[-3000:]
    assert launched.read_text().split() == ["box", "0.2"]  # placeholders filled in, shell-quoted
    summary = json.loads((lp.run_dir / "summary.json").read_text())
    assert [w["name"] for w in summary["workers"]] == ["box"] and summary["steps"] == 5


@pytest.mark.slow  # ~20 s; the libp2p transport in `make test`: tests/unit/broadcast/test_broadcast_libp2p.py
def test_workers_relay_over_libp2p(learner_factory, tmp_path):
    """The same loop with the workers' relays on py-libp2p (`[worker] relay_transport`): the
    learner pushes each signed version to a `p2p:` address and the workers forward it there."""
    import pytest

    pytest.importorskip("libp2p", reason="py-libp2p is not installed (optional extra: pip install 'echo-rl[p2p]')")
    steps = 8
    lp = learner_factory(run={"steps": steps}, buffer={"max_staleness": 2})
    workers = [lp.worker(name, "--worker.max_rollouts_per_s", "40", "--worker.relay_transport", "libp2p")
               for name in ("a", "b")]
    lp.wait_until(lambda: sum(w["relay_url"].startswith("p2p:/ip4/127.0.0.1/") for w in lp.status()["workers"]) == 2,
                  60, "both relays to advertise a p2p address")
    assert lp.finished(240) == 0, lp.output()[-3000:]
    records = lp.records()
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    plans = [p for r in records if "snapshot_bytes" in r for p in r["snapshot_bytes"]["plans"].values()]
    assert plans and any(len(p["links_mbit"]) == 2 for p in plans)  # both pushed to, over libp2p
    assert any("t_bcast" in r for r in records)  # and they installed what was pushed
    for w in workers:
        assert w.wait(30) == 0
    for name in ("a", "b"):  # only the version current at join is pulled; the rest came by push
        log = (tmp_path / f"{name}.log").read_text()
        assert "relay listening at p2p:" in log and log.count("from the learner") <= 1, log[-2000:]


@pytest.mark.slow  # ~30 s; `[run] nproc = 2` in `make test`: the multi-turn bf16 LoRA run below; top-p π = μ: test_engines
def test_a_two_rank_learner_trains_on_policy_with_top_p(learner_factory):
    """`[run] nproc = 2`: the learner relaunches itself under torchrun (FSDP2 on two gloo ranks,
    rank 0 serving), a transformers worker samples with top-p 0.9, and with S = 0 every trained
    group is fresh: π of the sharded trainer equals the worker's μ (mismatch_kl ≈ 0, no token
    outside the nucleus). Eval runs on the worker; the run exports the trained model. ~60 s."""
    steps = 4
    lp = learner_factory(run={"steps": steps, "nproc": 2}, buffer={"max_staleness": 0},
                         rollout={"top_p": 0.9, "temperature": 0.8})
    lp.worker("w", "--worker.max_rollouts_per_s", "200")
    assert lp.finished(240) == 0, lp.output()[-4000:]
    records, summary = lp.records(), json.loads((lp.run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and len(records) == steps
    assert all(s == 0 for r in records for s in r["staleness"])
    assert all(abs(r["mismatch_kl"]) < 1e-6 and r["outside_nucleus_fraction"] == 0 for r in records), \
        [(r["mismatch_kl"], r["outside_nucleus_fraction"]) for r in records]
    assert summary["eval_version_end"] == steps
    assert (lp.run_dir / "model" / "model.safetensors").exists()
    state = json.loads((lp.run_dir / "checkpoints" / "latest" / "learner_state.json").read_text())
    assert state["ranks"] == 2 and state["version"] == steps


def test_a_worker_that_writes_its_own_eval_answers_is_caught(learner_factory):
    """The forger of v0's eval: it computes the right sums itself (the arithmetic is easy; the
    answers are never sent) instead of running the model. The learner checks each answer in one
    teacher-forced pass under v0: they are not v0's greedy completions, so the worker is
    quarantined and the forged prompts are asked again of an honest worker: v0's accuracy is over
    all 8 prompts, every answer checked. Before, v0's accuracy read 1.000."""
    from learner.tinymodel import build_tokenizer

    tokenizer = build_tokenizer()
    lp = learner_factory(run={"steps": 3}, eval={"limit": 8, "prompts_per_lease": 8, "final_timeout_s": 5},
                         verify={"ban_address": False})  # the honest worker comes from the forger's address
    wid, cred = lp.join("forger")

    def eval_lease():  # the round opens once v0 is published; eval leases go out before prompts
        status, lease = lp.request("POST", "/v1/lease", {"max_prompts": 8, "version": 0, "wait_s": 1}, token=cred)
        assert status == 200
        if lease["lease_id"] and lease["eval_version"] is None:
            lp.request("POST", "/v1/release", {"lease_id": lease["lease_id"]}, token=cred)
        return lease if lease["eval_version"] == 0 else None

    leases = []
    lp.wait_until(lambda: leases.append(eval_lease()) or leases[-1], 60, "an eval lease for v0")
    lease = leases[-1]
    assert len(lease["prompts"]) == 8 and all(p["answer"] == "" for p in lease["prompts"])
    sums = {p["id"]: str(eval(p["text"].split("=")[0].split(":")[-1].strip())) for p in lease["prompts"]}  # noqa: S307
    completions = {k: tokenizer(v + tokenizer.eos_token, add_special_tokens=False)["input_ids"] for k, v in sums.items()}
    status, _ = lp.request("POST", "/v1/eval", {"lease_id": lease["lease_id"], "version": 0,
                                                "completions": completions, "rewards": {k: 1.0 for k in sums}},
                           token=cred)
    assert status == 200
    lp.wait_until(lambda: any(w["id"] == wid and w["quarantined"] for w in lp.status()["workers"]), 60,
                  "the forger to be quarantined")
    why = next(w["quarantined"] for w in lp.status()["workers"] if w["id"] == wid)
    assert "not that version's greedy completions" in why

    def eval_events():
        path = lp.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if '"event": "eval"' in line]

    assert not eval_events()  # the forged prompts wait for an honest answer: no accuracy over fewer prompts
    lp.worker("honest")
    lp.wait_until(eval_events, 120, "v0's eval round, the forged prompts answered by the honest worker")
    events = eval_events()
    assert events[0]["step"] == 0 and events[0]["checked"]
    assert events[0]["forged"] >= 7 and events[0]["prompts"] == 8  # asked again, not left out
    assert events[0]["eval_accuracy"] < 0.9  # v0's own accuracy (≈ 0.17), not the forger's 1.000
    metrics = lp.request("GET", "/metrics", token=None)[1]
    gauge = next(float(line.split()[1]) for line in metrics.splitlines() if line.startswith("echo_eval_accuracy "))
    assert gauge == events[-1]["eval_accuracy"]  # what Prometheus shows is the checked accuracy


def test_a_task_the_models_tokenizer_cannot_play_stops_the_learner_in_one_line(tiny_model, tmp_path):
    """The calculator on the demo's digits-only model: the learner printed its URL, then its first
    eval died in a traceback (EpisodeError: the environment's "error" is no tokens; an API-only
    tester, 2026-12-07). Now it says so and what to do, before it serves."""
    import subprocess
    import sys

    from conftest import ROOT

    config = tmp_path / "calculator.toml"  # as a new operator writes it: the task, the default (demo) model
    config.write_text(f'[run]\ndir = "{tmp_path}"\n[task]\nname = "calculator"\n[server]\nport = 0\n')
    done = subprocess.run([sys.executable, "-m", "learner.main", "--config", str(config), "--model.path", str(tiny_model)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "reply 'error' to the action '' is no tokens" in done.stderr and "Traceback" not in done.stderr
    assert "echo-learner at" not in done.stdout + done.stderr  # never served


def test_a_multi_turn_task_trains_through_real_workers(learner_factory, chat_model):
    """The calculator task on a chat model whose turns end on <|im_end|>: workers play episodes
    turn by turn, the learner replays a share of them, trains on the policy's tokens only."""
    steps = 4
    lp = learner_factory(model=chat_model, run={"steps": steps, "eval_every": 2},
                         task={"name": "calculator", "digits": 1, "turns": 3, "eval_size": 8},
                         rollout={"group_size": 4, "max_new_tokens": 8, "max_episode_tokens": 120},
                         eval={"where": "learner"}, verify={"rescore_fraction": 1.0})
    lp.worker("w1")
    assert lp.finished(180) == 0, lp.output()[-3000:]
    records = lp.records()
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert all(r["turns_mean"] > 1 and 0 < r["env_token_share"] < 1 for r in records), records
    assert records[0]["mismatch_kl"] < 1e-4  # the first batch: μ of the workers' weights is π (staleness aside)
    summary = json.loads((lp.run_dir / "summary.json").read_text())
    assert summary["rewards_checked"] >= steps * 4 * 4 and summary["rewards_mismatched"] == 0  # every episode replayed
    assert summary["eval_metric"] == "mean return"  # what eval_accuracy_* hold for a multi-turn task
    assert not summary["quarantined"]
    evals = [json.loads(line) for line in (lp.run_dir / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
    assert evals and all(e["where"] == "learner" and e["metric"] == "mean return" for e in evals)


def test_a_multi_turn_task_trains_on_two_bf16_ranks_with_lora(learner_factory, chat_model):
    """The GPU-scale settings together on a multi-turn task: 2 FSDP2 ranks computing in bf16, a
    LoRA adapter, evaluated on the learner (the only place a multi-turn return is scored), with
    the demo's fp32 worker. Before, the config refused N ranks with learner-side eval (so no
    multi-turn task could run on N ranks), and the fp32 worker refused every bf16 adapter probe."""
    steps = 3
    lp = learner_factory(model=chat_model, run={"steps": steps, "eval_every": 2, "nproc": 2},
                         task={"name": "calculator", "digits": 1, "turns": 3, "eval_size": 4},
                         rollout={"group_size": 4, "max_new_tokens": 8, "max_episode_tokens": 120},
                         trainer={"compute_dtype": "bfloat16", "lora": {"rank": 2, "alpha": 8}, "lr": 1e-3},
                         eval={"where": "learner"})
    lp.worker("w1")
    assert lp.finished(240) == 0, lp.output()[-3000:]
    records = lp.records()
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert all(r["turns_mean"] > 1 for r in records)
    assert abs(records[0]["mismatch_kl"]) < 1e-2  # bf16 π against the fp32 worker's μ, fresh batch
    evals = [r for r in records if r.get("eval_accuracy") is not None]
    assert evals and evals[-1]["step"] == steps  # the learner evaluated on both ranks and the run ended
    assert (lp.run_dir / "model-adapter" / "adapter_model.safetensors").exists()
    assert (lp.run_dir / "model" / "model.safetensors").exists()
    worker_log = (lp.run_dir.parent.parent / "w1.log").read_text()
    assert "FutureWarning" not in lp.output() + worker_log  # PEFT's, on every LoRA run's console


def _descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc: parentage survives new sessions)."""
    import os

    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
                alive.add(pid)
        except OSError:
            pass
    return alive


# ~95 s on a 2-core machine (one-rank resume stays in the default run)
@pytest.mark.slow
def test_a_two_rank_learner_killed_twice_applies_exactly_its_steps_and_nothing_outlives_it(learner_factory):
    """A SIGINT to the launcher's pid alone (a supervisor's, not the terminal's), then `kill -9` of
    it: each takes torchrun, both ranks and the spawned worker with it (the SIGINT, before, reached
    nobody past the launcher, which waited on); each resume continues from the last checkpoint
    with later version numbers (the stop lost some) yet counts updates, so the run applies exactly
    `steps` of them and the cosine schedule ends where an uninterrupted run's does, with no
    traceback from torchrun or a rank. ~2-3 min."""
    import subprocess
    import sys
    import time

    from conftest import ROOT, WATCHED, sigint_as_at_a_terminal

    steps, lr, floor = 9, 3e-4, 0.1
    lp = learner_factory(run={"steps": steps, "nproc": 2, "checkpoint_every": 3},
                         trainer={"schedule": "cosine", "lr": lr, "min_lr_ratio": floor},
                         workers={"spawn": 1, "overrides": ["--worker.max_rollouts_per_s", "30"]})
    launcher = lp.proc
    for crash, at in enumerate((4, 7)):
        lp.wait_until(lambda: max((r["version"] for r in lp.records()), default=0) >= at + crash, 240,
                      f"crash {crash}: step {at}")
        tree = _descendants(launcher.pid)
        assert len(tree) >= 4  # torchrun, two ranks, the spawned worker
        if crash == 0:
            launcher.send_signal(signal.SIGINT)
            assert launcher.wait(60) == 130, lp.output()[-3000:]
            assert "echo-learner: interrupted" in lp.output()
        else:
            launcher.kill()
            launcher.wait()
        deadline = time.monotonic() + 60
        while _alive(tree) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _alive(tree), f"outlived their launcher: {_alive(tree)}"
        out = lp.output() if crash == 0 else (lp.run_dir.parent / "resume0.log").read_text()
        # torchrun, stopped with its launcher, printed a 20-line SignalException under it; rank 1, a KeyboardInterrupt
        assert "Traceback" not in out, out[-3000:]
        log = open(lp.run_dir.parent / f"resume{crash}.log", "w")
        launcher = subprocess.Popen([sys.executable, "-m", "learner.main", "--resume", str(lp.run_dir), "--json"],
                                    cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=WATCHED,
                                    preexec_fn=sigint_as_at_a_terminal)
        lp.proc = launcher
    assert launcher.wait(300) == 0, (lp.run_dir.parent / "resume1.log").read_text()[-3000:]
    summary = json.loads((lp.run_dir / "summary.json").read_text())
    state = json.loads((lp.run_dir / "checkpoints" / "latest" / "learner_state.json").read_text())
    assert summary["steps"] == state["updates"] == steps
    assert state["version"] > steps  # versions a crash lost are never reused
    from learner.config import TrainerSection
    from learner.train.trainer import lr_factor

    last = lp.records()[-1]  # the rate the last update ran at (it logged the next one's, the floor here)
    end = lr * lr_factor(steps - 1, "cosine", TrainerSection().warmup_steps, steps, floor)
    assert last["step"] == steps and last["lr"] == pytest.approx(end, rel=1e-6)


def test_echo_learner_serves_on_uvloop_and_a_sigterm_ends_it_like_ctrl_c(learner_factory, monkeypatch):
    """As users run it (no `$ECHO_SLOW_CALLBACK_MS`, which every other test sets for
    `echo.loopwatch`), echo-learner serves on uvloop: it trains with a worker, and a SIGTERM ends
    the run as Ctrl-C does (exit 130, the run directory named), not with a traceback."""
    import conftest

    monkeypatch.delitem(conftest.WATCHED, "ECHO_SLOW_CALLBACK_MS")
    lp = learner_factory(run={"steps": 1000})
    lp.worker("w1")
    lp.wait_until(lambda: len(lp.records()) >= 2, 120, "two updates")
    assert "uvloop" in open(f"/proc/{lp.proc.pid}/maps").read()  # its compiled loop is loaded
    lp.proc.send_signal(signal.SIGTERM)
    assert lp.finished(30) == 130, lp.output()[-3000:]
    out = lp.output()
    assert f"interrupted; the run directory {lp.run_dir}" in out and "Traceback" not in out, out[-3000:]
    assert "checkpoint_every = 0 saves one only at the end" in out  # not "the first comes at [run] checkpoint_every"
