"""The Vast.ai provider end to end: the real `vastai` SDK talks to a local stand-in of the
Vast API (tests/vast_fake.py, responses in tests/data/vast/), whose instances run their on-start
command as real processes here: `echo-worker join URL --token <machine token>` joins the real
learner on loopback. Search, activate, create, join, train, release, destroy; an offer taken
between search and create; an instance that never joins (destroyed at the timeout, its offer
not tried again); an interruptible instance preempted mid-lease (its prompts re-issued at
once, another machine rented); the budget stopping a run cleanly."""

from __future__ import annotations

import json

import pytest

import conftest
from scheduler.config import DEFAULT_ONSTART

pytest.importorskip("vastai", reason="the Vast.ai SDK is not installed (pip install 'echo-rl[market]')")

from vast_fake import FakeVast  # noqa: E402

KEY = "fake-vast-key-0123"


@pytest.fixture
def fake(tmp_path, monkeypatch):
    monkeypatch.setitem(conftest.WATCHED, "VAST_API_KEY", KEY)  # the learner's SDK reads it
    vast = FakeVast(tmp_path / "vast", api_key=KEY).start()
    yield vast
    vast.stop()


def vast_provider(fake: FakeVast, tmp_path, gpus: dict, worker_args: str = "", **extra) -> dict:
    # The image's entrypoint is echo-worker (the fake puts one on PATH); the cache is per machine here.
    onstart = f"{DEFAULT_ONSTART} --worker.cache_dir {tmp_path}/cache-{{id}} {worker_args}".rstrip()
    return {"type": "vast", "gpus": gpus, "api_url": fake.url, "api_key_env": "VAST_API_KEY", "refresh_s": 0.5,
            "query": "reliability>0.98", "onstart": onstart, **extra}


def scheduler_events(lp) -> list[dict]:
    path = lp.run_dir / "metrics.jsonl"
    return [e for e in map(json.loads, path.read_text().splitlines()) if e.get("event") == "scheduler"]


def test_vast_rents_the_cheapest_offer_that_joins_trains_and_destroys_everything(learner_factory, fake, tmp_path):
    fake.vanish(18421003)  # the cheapest: taken by someone else between our search and our create
    fake.dud(18421004)  # the next: boots, but its on-start never joins
    timeout = 8.0
    lp = learner_factory(run={"steps": 8}, scheduler={
        "provider": vast_provider(fake, tmp_path, {"RTX 3090": 1000.0, "RTX 4090": 1000.0}),
        "t_train_s": 10.0, "t_bcast_s": 0.0, "window_s": 1000.0, "tick_s": 0.25, "launch_timeout_s": timeout})
    assert lp.finished(180) == 0, lp.output()[-3000:]
    summary = json.loads((lp.run_dir / "summary.json").read_text())
    assert summary["steps"] == 8
    # The cheapest by unit cost first; the vanished offer and the dud are each tried once, never again.
    assert fake.creates == [18421003, 18421004, 18421001], fake.creates
    assert [w["name"] for w in summary["workers"]] == ["vast-18421001"]
    assert summary["workers"][0]["groups"] >= 8 * 4
    dud, = fake.by_offer(18421004)
    assert dud.destroyed is not None and dud.billed_s < timeout + 3.0, dud.billed_s  # not paid for past the timeout
    assert all(i.destroyed is not None for i in fake.instances.values())  # released: nothing left running
    assert set(summary["instances_destroyed"]) == {str(i) for i in fake.instances}
    worked, = fake.by_offer(18421001)
    assert "echo-worker join http://127.0.0.1:" in worked.onstart and "--token machine:vast-18421001:" in worked.onstart
    assert worked.label == "echo:vast-18421001" and worked.price is None  # on-demand: no bid
    lost = {e["worker"]: e["reason"] for e in scheduler_events(lp) if e["action"] == "lost"}
    assert "vanished" in lost["vast-18421003"] and "never joined" in lost["vast-18421004"], lost
    # Priced at the offer, not at what the worker says; the bill includes the offer's $/GB traffic.
    records = lp.records()
    assert {r["workers_price_per_hour"] for r in records[2:]} == {0.312}
    assert summary["cost"]["bandwidth_dollars"] > 0


# ~100 s on a 2-core machine: the budget runs out by the clock (the rent-join-train-destroy path stays in the default run)
@pytest.mark.slow
def test_a_preempted_instance_is_replaced_and_the_budget_stops_the_run_cleanly(learner_factory, fake, tmp_path):
    steps = 10_000  # the budget ends it long before
    lp = learner_factory(
        run={"steps": steps},
        server={"lease_ttl": 60.0},  # a lease re-issued before its TTL was re-issued by the preemption
        # Throttled so that a lease takes its worker a second or two: the machine is preempted while it
        # holds one (unthrottled, the tiny model answers in milliseconds and the worker is mostly
        # between leases, so the preemption could land after its lease came back: reissued 0).
        scheduler={"provider": vast_provider(fake, tmp_path, {"RTX 3090": 1000.0}, interruptible=True,
                                             worker_args="--worker.max_rollouts_per_s 10"),
                   "t_train_s": 10.0, "t_bcast_s": 0.0, "window_s": 1000.0, "tick_s": 0.25,
                   # $0.01/s of the learner's time: room for the first machine's 4 steps, the replacement's
                   # start-up and groups on a slow machine (at $0.35 the budget ended the run first: at its first step
                   # there, or before the replacement delivered)
                   "learner_price_per_hour": 36.0, "max_total_dollars": 0.9})
    lp.wait_until(lambda: len(lp.records()) >= 4, 90, "the first rented machine to train 4 steps")
    first, = fake.by_offer(18421003)  # the cheapest bid
    assert first.price == pytest.approx(0.09 * 1.1)  # min_bid × (1 + bid_margin)
    lp.wait_until(lambda: any(w["name"] == "vast-18421003" and w["leased_prompts"] > 0 for w in lp.status()["workers"]),
                  30, "the first machine to hold a lease")
    fake.preempt(first.id)  # outbid: the process dies mid-lease, the instance shows `exited`
    lp.wait_until(lambda: fake.by_offer(18421004), 30, "a replacement to be rented")
    assert lp.finished(180) == 0, lp.output()[-3000:]
    summary = json.loads((lp.run_dir / "summary.json").read_text())
    assert "budget" in summary["stopped"], summary.get("stopped")
    assert summary["steps"] < steps and summary["cost"]["dollars"] <= 0.9
    assert (lp.run_dir / "checkpoints" / "latest" / "learner_state.json").exists()
    lost = [e for e in scheduler_events(lp) if e["action"] == "lost"]
    assert lost and lost[0]["worker"] == "vast-18421003" and "preempted" in lost[0]["reason"]
    assert lost[0]["reissued"] > 0  # its leased prompts went back at once (lease TTL 60 s)
    groups = {w["name"]: w["groups"] for w in summary["workers"]}
    assert groups["vast-18421004"] > 0, groups
    assert first.destroyed is not None and all(i.destroyed is not None for i in fake.instances.values())
