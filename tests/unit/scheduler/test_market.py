"""Marketplace providers, bandwidth in the bill, the budget: the pure parts, and the Vast SDK
against the local stand-in of its API (tests/vast_fake.py)."""

from __future__ import annotations

import math
import time

import pytest

from scheduler.controller import Controller, ControllerParams
from scheduler.cost import Budget, CostMeter, bandwidth_dollars, dollars_per_step
from scheduler.fleet import Fleet
from scheduler.market import MarketProvider, Offer, OfferGone, bandwidth_per_hour, offer_machine, version_traffic
from scheduler.providers import Machine, machine_token


class MemoryMarket:
    """A market in memory: offers, instances, and what was asked."""

    name = "mem"

    def __init__(self, offers: list[Offer]):
        self.listed = {o.id: o for o in offers}
        self.instances: dict[str, str] = {}  # id → state
        self.gone: set[str] = set()
        self.destroyed: list[str] = []
        self.onstarts: list[str] = []

    def search(self):
        rented = {i.split(":")[0] for i in self.instances}
        return [o for o in self.listed.values() if o.id not in rented]

    def create(self, offer, label, onstart):
        if offer.id in self.gone:
            raise OfferGone("no_such_ask")
        self.onstarts.append(onstart)
        iid = f"{offer.id}:{len(self.onstarts)}"
        self.instances[iid] = "running"
        return iid

    def destroy(self, iid):
        self.instances.pop(iid, None)
        self.destroyed.append(iid)

    def states(self):
        return dict(self.instances)


def offer(i: str, gpu="RTX 4090", price=0.3, **kw) -> Offer:
    return Offer(i, gpu, 1, price, down_mbps=800, up_mbps=300, **kw)


def provider(market, **kw) -> MarketProvider:
    p = MarketProvider(market, url="http://learner:1", machine_key="run-token", gpus={"RTX 4090": 3.0},
                       onstart="echo-worker join {url} --token {token} --worker.name {id}", refresh_s=0.0,
                       background=False, **kw)
    p.step()
    return p


def fleet_over(p, **kw) -> Fleet:
    return Fleet(None, p, ControllerParams(window_s=0, warmup_s=0, **kw), batch=16, publish_every=1, max_staleness=1,
                 t_train_prior=10.0, t_bcast_prior=0.0, launch_timeout_s=5.0)


def test_offers_become_candidates_priced_and_rated_by_the_offer():
    m = MemoryMarket([offer("1", price=0.3), offer("2", gpu="RTX 3090", price=0.1), offer("3", price=0.25)])
    p = provider(m)
    machines = {x.id: x for x in p.offers()}
    assert set(machines) == {"mem-1", "mem-3"}  # the 3090 is not in the gpus table: not a candidate
    assert machines["mem-3"].price_per_hour == 0.25 and machines["mem-3"].rollouts_per_s == 3.0
    assert machines["mem-3"].down_mbps == 800


def test_launch_runs_the_onstart_with_a_machine_token_and_release_destroys():
    m = MemoryMarket([offer("1")])
    p = provider(m)
    f = fleet_over(p)
    f.tick(0.0)
    assert f.controller.active == ["mem-1"]
    p.step()
    assert m.onstarts == [f"echo-worker join http://learner:1 --token {machine_token('run-token', 'mem-1')} "
                          "--worker.name mem-1"]
    p.release(Machine("mem-1", "", 0, 1))
    p.step()
    assert m.destroyed and not m.instances and not p.rented()


def test_a_vanished_offer_is_forgotten_and_the_next_cheapest_is_rented():
    m = MemoryMarket([offer("1", price=0.2), offer("2", price=0.3)])
    m.gone.add("1")
    p = provider(m)
    f = fleet_over(p)
    f.tick(0.0)
    assert f.controller.active == ["mem-1"]
    p.step()  # create → OfferGone
    st = f.tick(1.0)
    assert st.lost and st.lost[0][0] == "mem-1" and "vanished" in st.lost[0][1]
    assert f.controller.active == ["mem-2"] and "mem-1" not in f.candidates
    p.step()
    assert "mem-1" not in {x.id for x in p.offers()}  # remembered as bad


def test_a_machine_that_never_joins_is_destroyed_at_the_timeout_and_its_offer_not_used_again():
    m = MemoryMarket([offer("1", price=0.2), offer("2", price=0.3)])
    p = provider(m)
    f = fleet_over(p)
    f.tick(0.0)
    p.step()
    assert m.instances
    st = f.tick(6.0)  # past launch_timeout_s = 5 without a join
    assert [k for k, _ in st.lost] == ["mem-1"]
    p.step()
    assert m.destroyed and f.controller.active == ["mem-2"]
    assert "mem-1" not in {x.id for x in p.offers()}


def test_a_preempted_instance_is_reported_lost_and_destroyed():
    m = MemoryMarket([offer("1", price=0.2, interruptible=True), offer("2", price=0.3)])
    p = provider(m)
    f = fleet_over(p)
    f.tick(0.0)
    p.step()
    f.joined(1.0, "w1", "mem-1")
    iid, = m.instances
    m.instances[iid] = "stopped"  # outbid
    p.step()
    st = f.tick(2.0)
    assert st.lost == [("mem-1", "preempted (outbid)")]
    assert f.controller.active == ["mem-2"]
    p.step()
    assert iid in m.destroyed


def test_close_destroys_every_instance():
    m = MemoryMarket([offer("1"), offer("2")])
    p = provider(m)
    for mid in ("mem-1", "mem-2"):
        p.launch(Machine(mid, "", 0, 1))
    p.step()
    p.close()
    assert not m.instances and len(m.destroyed) == 2


# --- bandwidth ----------------------------------------------------------------------------------

def test_relays_upload_what_they_forward_and_every_member_downloads():
    wire = {"raw": 100, "full": 90, "delta": None, "plans": {
        "k": {"kind": "chains", "chains": [["a", "b", "c"], ["d"]], "pull": ["e"], "bytes": 90}}}
    t = version_traffic(wire)
    assert t == {"a": (90, 90), "b": (90, 90), "c": (90, 0), "d": (90, 0), "e": (90, 0)}
    tree = {"plans": {"k": {"kind": "chains", "chains": [["a", "b", "c"]], "parents": [[-1, 0, 0]], "bytes": 10}}}
    assert version_traffic(tree) == {"a": (10, 20), "b": (10, 0), "c": (10, 0)}


def test_bandwidth_is_in_the_bill_and_in_the_activation_price():
    assert bandwidth_dollars({"a": (2e9, 1e9)}, {"a": (0.01, 0.02)}) == pytest.approx(0.04)
    # $/step: 1 GB per version at $0.01/GB down + $0.02/GB up, published every 2 steps → +$0.015/step.
    base = dollars_per_step(10, 0, 2, 3.6, [0.36])
    assert dollars_per_step(10, 0, 2, 3.6, [0.36], bandwidth_per_version=0.03) == pytest.approx(base + 0.015)
    meter = CostMeter(3.6)
    step = meter.step(10.0, 0.0, [0.36], bandwidth=0.03)
    assert step.dollars == pytest.approx(0.011 + 0.03) and meter.summary()["bandwidth_dollars"] == 0.03
    # A cheap machine whose traffic is dear loses to a dearer one whose traffic is free.
    m = MemoryMarket([offer("1", price=0.20, dollars_per_gb_down=0.05, dollars_per_gb_up=0.05),
                      offer("2", price=0.25)])
    p = provider(m)
    f = fleet_over(p)
    f.version_bytes = 3e9  # 3 GB a version, 360 versions/h (T = 10 s, I = 1): $108/h of traffic
    machine = offer_machine("mem", m.listed["1"], {"RTX 4090": 3.0})
    assert f.effective_price(machine) == pytest.approx(0.20 + bandwidth_per_hour(machine, 3e9, 360))
    f.tick(0.0)
    assert f.controller.active == ["mem-2"]


# --- the budget ---------------------------------------------------------------------------------

def test_the_controller_never_activates_past_max_price_per_hour():
    c = Controller(ControllerParams(window_s=0, warmup_s=0, max_price_per_hour=1.0))
    for i, price in enumerate([0.4, 0.5, 0.3]):
        c.join(0, f"w{i}", price, 1.0)
    c.tick(0, 100.0)  # needs all three, can afford w2 + w0 (0.7); w1 would make 1.2
    assert c.active == ["w0", "w2"] and c.status().active_price <= 1.0
    c.observe(1, "w2", alive=True, price=0.9)  # its price rose: 1.3 > 1.0
    d = c.tick(1, 100.0)
    assert [x.worker_id for x in d if x.action == "release"] == ["w2"] and "budget" in d[0].reason
    assert c.status().active_price <= 1.0


def test_release_all_releases_everything_and_nothing_comes_back():
    m = MemoryMarket([offer("1")])
    p = provider(m)
    f = fleet_over(p)
    f.tick(0.0)
    p.step()
    f.joined(1.0, "w1", "mem-1")
    decisions = f.release_all(2.0, "budget: spent")
    assert [d.worker_id for d in decisions] == ["mem-1"] and not f.controller.active
    f.heartbeat(2.5, "mem-1", 3.0)
    f.tick(3.0)
    assert not f.controller.active
    p.step()
    assert not m.instances


def test_the_total_budget_stops_before_a_step_that_could_pass_it():
    b = Budget(1.0)
    assert b.exhausted(0.5, [0.1, 0.2]) == ""
    assert "budget" in b.exhausted(0.7, [0.1, 0.2])  # 0.7 + 2·0.2 > 1
    assert Budget(0).exhausted(1e9, [1.0]) == ""
    assert b.affordable_wait_s(0.5, [0.1], 36.0) == pytest.approx((1.0 - 0.5 - 0.2) / 36 * 3600)
    assert math.isinf(Budget(0).affordable_wait_s(0, [], 1.0))


def test_max_dollars_per_hour_must_leave_room_for_workers():
    from pydantic import ValidationError

    from scheduler.config import SchedulerSection

    with pytest.raises(ValidationError, match="leaves nothing for workers"):
        SchedulerSection(max_dollars_per_hour=2.0, learner_price_per_hour=3.0)
    assert SchedulerSection(max_dollars_per_hour=5.0, learner_price_per_hour=3.0).controller_params().max_price_per_hour == 2.0


# --- the Vast SDK against the fake API ----------------------------------------------------------

def test_the_vast_sdk_searches_creates_follows_and_destroys(tmp_path):
    pytest.importorskip("vastai", reason="the Vast.ai SDK is not installed (pip install 'echo-rl[market]')")
    from vast_fake import FakeVast

    from scheduler.vast import VastMarket

    fake = FakeVast(tmp_path, api_key="k").start()
    try:
        market = VastMarket(gpus={"RTX 4090": 3.0, "RTX 3090": 1.8}, query="reliability>0.98", image="img",
                            api_url=fake.url, api_key="k")
        offers = market.search()
        # GPU and reliability filters applied by the query the SDK sent; cheapest first.
        assert [o.id for o in offers] == ["18421003", "18421004", "18421001", "18421002"]
        o = offers[0]
        assert (o.gpu, o.price_per_hour, o.down_mbps, o.up_mbps, o.dollars_per_gb_down, o.dollars_per_gb_up,
                o.location, o.verified) == ("RTX 3090", 0.184, 488.2, 103.9, 0.003, 0.005, "Poland, PL", True)
        iid = market.create(o, "vast-18421003", f"echo booted > {tmp_path}/booted")
        assert market.states() == {iid: "running"}
        # The onstart runs in a process of its own: a preemption right after could kill it before it
        # wrote (a busy CI machine did), so the machine is let boot first.
        deadline = time.monotonic() + 30
        while not (tmp_path / "booted").exists() or not (tmp_path / "booted").read_text().endswith("\n"):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        fake.preempt(int(iid))
        assert market.states() == {iid: "stopped"}
        market.destroy(iid)
        market.destroy(iid)  # already gone: fine
        assert market.states() == {}
        assert (tmp_path / "booted").read_text() == "booted\n"
        fake.vanish(18421004)
        with pytest.raises(OfferGone):
            market.create(offers[1], "vast-18421004", "true")
        assert ("PUT", "/api/v0/asks/18421003/") in fake.requests and ("DELETE", f"/api/v0/instances/{iid}/") in fake.requests
    finally:
        fake.stop()


def test_plan_offers_prices_the_live_market_with_bandwidth(tmp_path, capsys, monkeypatch):
    pytest.importorskip("vastai", reason="the Vast.ai SDK is not installed (pip install 'echo-rl[market]')")
    import json

    from vast_fake import FakeVast

    from scheduler.plan import cli

    fake = FakeVast(tmp_path, api_key="k").start()
    monkeypatch.setenv("VAST_API_KEY", "k")
    try:
        args = ["--offers", "vast", "--vast-url", fake.url, "--gpus", "RTX 4090=3.0,RTX 3090=1.8,RTX 5090=4.2",
                "--batch", "256", "--t-train", "60", "--no-simulate", "--json"]
        assert cli([*args, "--snapshot-gb", "0"]) == 0
        free = json.loads(capsys.readouterr().out)
        assert cli([*args, "--snapshot-gb", "3"]) == 0
        billed = json.loads(capsys.readouterr().out)
    finally:
        fake.stop()
    assert len(free["offers"]["considered"]) == 5  # 3090s, 4090s, the 5090; not the unreliable one
    assert free["cost"]["bandwidth_per_version"] == 0
    # Free traffic: the two 4090s. At 3 GB a version their $0.003-0.005/GB costs ~$0.45/h each:
    # the plan moves to the Oregon 3090 (free traffic) and the 5090.
    assert free["offers"]["chosen"] == ["vast-18421001", "vast-18421002"]
    assert billed["offers"]["chosen"] == ["vast-18421004", "vast-18421005"]
    assert billed["cost"]["bandwidth_per_version"] > 0
    assert billed["cost"]["dollars_per_step"] > billed["cost"]["bandwidth_per_version"] / billed["inputs"]["publish_every"]
