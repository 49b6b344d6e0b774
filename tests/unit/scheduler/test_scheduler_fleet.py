"""The learner-side adapter: pool candidates, provider launches, heartbeats, replacement."""

from scheduler.controller import ControllerParams
from scheduler.fleet import Fleet
from scheduler.pool import parse_pool
from scheduler.providers import Provider

POOL = parse_pool({"workers": [
    {"name": "cheap", "price_per_hour": 0.1, "rollouts_per_s": 10, "count": 2},
    {"name": "mid", "price_per_hour": 0.3, "rollouts_per_s": 15},
    {"name": "pricey", "price_per_hour": 1.0, "rollouts_per_s": 20},
]})


class RecordingProvider(Provider):
    """Stands in for a cloud: records what it was asked to bring up or down."""

    kind = "command"
    launches_machines = True
    releases_machines = True

    def __init__(self):
        self.launched, self.released = [], []

    def launch(self, machine):
        self.launched.append(machine.id)

    def release(self, machine):
        self.released.append(machine.id)


def fleet(provider, rule="overlapped", **params):
    # B = 100 rollouts, T = 4 s, T_b = 0, I = 1, S = 2 -> R_req = 25/s (both rules), target α·R_req = 30/s
    return Fleet(POOL, provider, ControllerParams(alpha=1.2, window_s=5, warmup_s=0, heartbeat_timeout_s=3, **params),
                 batch=100, publish_every=1, max_staleness=2, t_train_prior=4.0, t_bcast_prior=0.0,
                 launch_timeout_s=20, rule=rule)


def test_cheapest_sufficient_set_is_launched_first():
    p = RecordingProvider()
    f = fleet(p)
    st = f.tick(0.0)
    assert st.r_req == 25.0 and st.target == 30.0
    assert sorted(p.launched) == ["cheap-0", "cheap-1", "mid"]  # 10 + 10 + 15 ≥ 30 at the lowest $/h per rollout/s
    assert not f.is_active("pricey")


def test_dead_worker_is_replaced_and_capacity_recomputed():
    p = RecordingProvider()
    f = fleet(p)
    f.tick(0.0)
    for name in ("cheap-0", "cheap-1", "mid"):
        assert f.joined(1.0, f"w-{name}", machine_id=name) == name
    for t in range(2, 6):
        for name in ("cheap-1", "mid"):  # cheap-0 died after joining: no more heartbeats
            f.heartbeat(float(t), name, 10.0 if name.startswith("cheap") else 15.0)
        st = f.tick(float(t))
    assert "cheap-0" not in st.active and "pricey" in p.launched
    assert p.released == ["cheap-0"]


def test_measured_step_time_moves_the_requirement_and_infeasibility_is_reported():
    for rule in ("paper", "overlapped"):
        f = fleet(RecordingProvider(), rule=rule)
        for _ in range(5):
            f.trained(2.0)
        assert f.tick(0.0).r_req == 50.0
    paper, overlapped = fleet(RecordingProvider(), rule="paper"), fleet(RecordingProvider())
    for f in (paper, overlapped):
        for _ in range(5):
            f.trained(2.0)
        f.broadcast(2.5)
        f.installed(0.5)  # learner-visible: received after 2.5 s, generating after 3 s
    # I·T = 2 s ≤ 3 s: the paper's rule gives up, and says what I and S it would take...
    assert "I ≥ 2, which needs a staleness budget S ≥ 3 (now S = 2)" in paper.tick(1.0).infeasible
    # ...while training goes on during the broadcast: rollouts of the new snapshot have
    # (S − I + 1)·T − T_b = 4 − 3 = 1 s to arrive, so R_req = B / 1 s (admissibility binds).
    st = overlapped.tick(1.0)
    assert not st.infeasible and st.r_req == 100.0 and st.binding == "admissibility"
    overlapped.broadcast(4.0)
    overlapped.broadcast(4.0)  # the median moves: 4 s + 0.5 s ≥ (S − I + 1)·T = 4 s: nothing arrives in time
    assert "S = 2, I = 1" in overlapped.tick(2.0).infeasible and "S ≥ 3" in overlapped.status.infeasible


def test_a_self_joined_worker_is_believed_only_as_far_as_it_was_measured():
    """A joiner declaring $0/h and 1e7 rollouts/s used to become the controller's first choice,
    and the honest paid worker was released. Now it is priced like the dearest listed machine,
    counts for UNPROVEN_RATE until measured, and is known by its worker id, not its name."""
    from scheduler.fleet import UNPROVEN_RATE
    from scheduler.pool import Pool

    pool = Pool.model_validate({"workers": [{"name": "box", "price_per_hour": 0.5, "rollouts_per_s": 40}]})
    f = Fleet(pool, Provider(), ControllerParams(alpha=1.2, window_s=0, warmup_s=0), batch=100,
              publish_every=1, max_staleness=2, t_train_prior=4.0, t_bcast_prior=0.0, launch_timeout_s=20)
    assert f.joined(0.0, "w1", machine_id="box") == "box"
    assert f.joined(0.0, "w2") == "w2"  # a liar naming itself "box" is still w2 to the fleet
    f.tick(0.0)
    assert f.is_active("box") and not f.is_active("w2")  # box alone covers 30/s
    assert f.candidates["w2"].machine.price_per_hour == 0.5  # the dearest listed, not its claim
    assert f.candidates["w2"].machine.rollouts_per_s == UNPROVEN_RATE
    assert f.active_prices() == [0.5]


def test_machine_tokens_bind_a_machine_and_nothing_else():
    from scheduler.providers import machine_of, machine_token

    token = machine_token("run-token", "box-0")
    assert machine_of("run-token", token) == "box-0"
    assert machine_of("other-run", token) is None
    assert machine_of("run-token", token.replace("box-0", "box-1")) is None
    assert machine_of("run-token", "run-token") is None


def test_a_forgotten_self_joined_worker_leaves_the_fleet_and_a_pool_machine_stays():
    """The learner forgot a worker (silent, or its machine joined again under a new identity): a
    self-joined one stops counting at once; a pool machine stays, to rejoin by the same key."""
    p = RecordingProvider()
    f = fleet(p)
    f.tick(0.0)
    assert f.joined(1.0, "w7") == "w7" and f.joined(1.0, "w8", machine_id="cheap-0") == "cheap-0"
    f.left("w7")
    f.left("cheap-0")
    assert "w7" not in f.candidates and "cheap-0" in f.candidates
    assert "w7" not in f.tick(2.0).active
    assert f.joined(3.0, "w9", machine_id="cheap-0") == "cheap-0"


def test_a_synchronous_run_is_not_called_infeasible():
    """S = 0 printed "infeasible at S = 0, I = 1: ... they would be dropped whatever the capacity"
    (a new user, 2026-12-07): nothing is dropped at S = 0, each step waits for its own rollouts.
    It says it is synchronous, and every available worker works."""
    f = Fleet(POOL, RecordingProvider(), ControllerParams(alpha=1.2, window_s=5, warmup_s=0, heartbeat_timeout_s=3),
              batch=100, publish_every=1, max_staleness=0, t_train_prior=4.0, t_bcast_prior=0.0,
              launch_timeout_s=20)
    st = f.tick(0.0)
    assert st.infeasible.startswith("S = 0 is synchronous") and "dropped" not in st.infeasible
