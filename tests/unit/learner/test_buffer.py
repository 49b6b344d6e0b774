"""The bounded-staleness buffer: admission, both policies, the oldest-first order, the invariant."""

import asyncio

import pytest

from learner.buffer import AsyncBuffer, Group, StalenessBuffer


def group(version: int, length: int = 2, pid: str = "p") -> Group:
    return Group(pid, version, [1], [[5] * length], [[-0.1] * length], [1.0])


def test_staleness_bound_evicts_and_counts():
    buf = StalenessBuffer("queue-drop", max_staleness=2, batch_groups=2, queue_factor=4)
    for v in (0, 1, 3, 4):
        buf.put(group(v))
    batch = buf.take(learner_version=4)  # v0 (4 behind) and v1 (3 behind) exceed S = 2
    assert [g.version for g in batch.groups] == [3, 4]
    assert batch.staleness == [1, 0] and batch.max_staleness == 1
    assert buf.metrics()["recycled"] == 2


def test_queue_drop_capacity_drops_oldest_and_trainer_takes_oldest():
    buf = StalenessBuffer("queue-drop", max_staleness=10, batch_groups=2, queue_factor=2)  # capacity 4
    for i in range(6):
        buf.put(group(0, pid=f"g{i}"))
    assert len(buf) == 4 and buf.metrics()["dropped_overflow"] == 2
    assert [g.prompt_id for g in buf.take(0).groups] == ["g2", "g3"]


def test_queue_max_has_no_capacity_but_enforces_staleness():
    buf = StalenessBuffer("queue-max", max_staleness=1, batch_groups=2, queue_factor=1)
    for i in range(10):
        buf.put(group(0, pid=f"g{i}"))
    assert len(buf) == 10 and buf.metrics()["dropped_overflow"] == 0
    assert buf.take(2) is None  # everything is 2 behind
    assert buf.metrics()["recycled"] == 10


def test_take_waits_for_a_full_batch_and_never_exceeds_the_bound():
    buf = StalenessBuffer("queue-drop", max_staleness=1, batch_groups=3, queue_factor=2)
    buf.put(group(5))
    buf.put(group(5))
    assert buf.take(5) is None
    buf.put(group(6))
    batch = buf.take(6)
    assert sorted(batch.staleness) == [0, 1, 1]


def test_length_bias_is_reported():
    buf = StalenessBuffer("queue-max", max_staleness=0, batch_groups=1, queue_factor=1)
    buf.put(group(0, length=8))  # long and stale by the time it is trained
    buf.put(group(1, length=2))
    buf.take(1)
    m = buf.metrics()
    assert m["sampled_mean_length"] == 5.0 and m["trained_mean_length"] == 2.0


def test_an_episodes_length_is_the_policys_tokens_not_the_environments():
    """A multi-turn sample's completion interleaves the policy's turns with the environment's
    replies (mask 0): the length bias is about what the policy wrote."""
    hand = Group("p", 0, [1], [[5] * 10, [5] * 6], [[-0.1] * 10, [-0.1] * 6], [1.0, 0.0],
                 masks=[[1, 1, 0, 0, 0, 0, 0, 1, 1, 1], [1, 0, 0, 0, 0, 1]])
    assert hand.mean_length == 3.5 and group(0, length=4).mean_length == 4.0


def test_invariant_holds_under_random_traffic():
    import random

    rng = random.Random(0)
    for policy in ("queue-drop", "queue-max"):
        buf = StalenessBuffer(policy, max_staleness=2, batch_groups=4, queue_factor=1.5)
        version = 0
        for _ in range(2000):
            if rng.random() < 0.7:
                buf.put(group(max(0, version - rng.randint(0, 4))))
            elif (b := buf.take(version)) is not None:
                assert b.max_staleness <= 2
                version += 1
        s = buf.stats
        assert s.accepted == s.trained + s.dropped_stale + s.dropped_overflow + len(buf)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="queue-drop"):
        StalenessBuffer("fifo", 1, 1, 1)


def test_async_buffer_wakes_the_waiting_trainer():
    async def scenario():
        abuf = AsyncBuffer(StalenessBuffer("queue-drop", 1, 2, 2))
        waiter = asyncio.create_task(abuf.get_batch(0))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        await abuf.put(group(0))
        await abuf.put(group(0))
        return await asyncio.wait_for(waiter, 1)

    assert len(asyncio.run(scenario()).groups) == 2


# --- replay (the replay-buffer paper) ------------------------------------------------------------


def scored(version: int, pid: str, reward: float = 0.0) -> Group:
    """Two samples whose rewards differ (so the group has a gradient to replay); correct iff reward > 0."""
    return Group(pid, version, [1], [[5, 2], [6, 2]], [[-0.1, -0.1]] * 2, [reward, reward - 1.0])


def replay_buffer(**kw) -> StalenessBuffer:
    args = dict(max_staleness=3, batch_groups=4, queue_factor=4, reuse=2, seed=1)
    return StalenessBuffer("queue-drop", **{**args, **kw})


def test_replay_needs_only_ceil_g_over_reuse_fresh_groups_and_fills_the_batch_from_the_pool():
    buf = replay_buffer(reuse=2)
    assert buf.fresh_per_step == 2
    for i in range(4):
        buf.put(scored(0, f"a{i}"))
    first = buf.take(0)  # empty pool: the whole batch is fresh
    assert first.uses == [1, 1, 1, 1] and first.replayed == 0
    buf.put(scored(1, "b0"))
    assert buf.take(1) is None  # two fresh groups needed, one queued
    buf.put(scored(1, "b1"))
    second = buf.take(1)
    assert [g.prompt_id for g in second.groups[:2]] == ["b0", "b1"] and second.uses[:2] == [1, 1]
    assert second.uses[2:] == [2, 2] and {g.prompt_id for g in second.groups[2:]} <= {f"a{i}" for i in range(4)}
    assert second.since_last_use == [0, 0, 1, 1] and second.staleness == [0, 0, 1, 1]
    s = buf.stats
    assert (s.trained, s.replayed) == (6, 2) and s.accepted == s.trained + len(buf)  # the invariant counts first uses


def test_no_group_is_trained_more_than_reuse_times():
    import random

    rng = random.Random(3)
    for reuse in (2, 3):
        buf = replay_buffer(reuse=reuse, max_staleness=4, batch_groups=6, queue_factor=2)
        uses: dict[str, int] = {}
        version = 0
        for i in range(3000):
            if rng.random() < 0.5:
                buf.put(scored(max(0, version - rng.randint(0, 2)), f"g{i}"))
            elif (b := buf.take(version)) is not None:
                for g in b.groups:
                    uses[g.prompt_id] = uses.get(g.prompt_id, 0) + 1
                assert len({g.prompt_id for g in b.groups}) == len(b.groups)  # never twice in one batch
                assert b.uses == [g.uses for g in b.groups]
                version += 1
        assert max(uses.values()) == reuse and min(uses.values()) >= 1
        assert buf.stats.replayed == sum(uses.values()) - len(uses)
        counts = buf.metrics()["reuse_counts"]
        assert max(counts) == reuse and sum(counts.values()) == len(uses)


def test_replay_never_trains_a_group_staler_than_s():
    buf = replay_buffer(reuse=10, max_staleness=2, batch_groups=2, queue_factor=10)
    buf.put(scored(0, "old0"))
    buf.put(scored(0, "old1"))
    buf.take(0)
    for version in range(1, 6):
        buf.put(scored(version, f"n{version}"))
        b = buf.take(version)
        assert b is not None and b.max_staleness <= 2, b.staleness
        if version > 2:  # old0/old1 (v0) are past S = 2 from version 3 on
            assert not {g.prompt_id for g in b.groups} & {"old0", "old1"}
    assert buf.metrics()["replay_pool"] <= 3  # v3..v5: what can still be replayed at version 6 (v4, v5)


def test_positive_bias_keeps_older_correct_groups_that_plain_replay_forgets():
    def pool_after(bias: float) -> set[str]:
        # G = 1: every step trains one fresh group, which then joins the pool of N = 4.
        buf = replay_buffer(reuse=5, max_staleness=10, batch_groups=1, queue_factor=1, replay_size=4,
                            positive_bias=bias)
        for version, pid in enumerate(["ok0", "ok1", "bad2", "bad3", "bad4", "bad5", "bad6", "bad7"]):
            buf.put(scored(version, pid, 1.0 if pid.startswith("ok") else 0.0))
            assert buf.take(version).groups[0].prompt_id == pid
        return {g.prompt_id for g in buf._replay}

    assert pool_after(0.0) == {"bad4", "bad5", "bad6", "bad7"}  # the freshest N
    assert pool_after(0.5) == {"bad6", "bad7", "ok0", "ok1"}  # freshest (1 - δ)N + freshest δN correct


def test_positive_bias_sampling_selects_correct_groups_more_often():
    """Over many steps, correct groups are replayed more often with δ > 0 than without."""
    import random

    def positive_share(bias: float) -> float:
        rng = random.Random(0)
        buf = replay_buffer(reuse=4, max_staleness=3, batch_groups=8, queue_factor=2, replay_size=8,
                            positive_bias=bias)
        hits = total = 0
        for version in range(300):
            i = 0
            while (b := buf.take(version)) is None:  # fresh groups until the pool fills the rest
                buf.put(scored(version, f"{version}-{i}", 1.0 if rng.random() < 0.2 else 0.0))
                i += 1
            replayed = [g for g, u in zip(b.groups, b.uses) if u > 1]
            hits += sum(g.positive for g in replayed)
            total += len(replayed)
        return hits / total

    plain, biased = positive_share(0.0), positive_share(0.75)
    assert 0.12 < plain < 0.3  # about the 20% base rate
    assert biased > plain + 0.15


def test_leasable_refuses_the_old_snapshot_while_its_batch_trains():
    """S = 0: once the batch of version t is taken, a group generated by t arrives stale."""
    buf = StalenessBuffer("queue-drop", max_staleness=0, batch_groups=1, queue_factor=1)
    assert buf.leasable(0, 0)
    buf.put(group(0))
    buf.take(0)
    assert buf.admissible(0, 0) and not buf.leasable(0, 0)  # training step 0: v0 work would be wasted
    assert buf.leasable(1, 1)  # the learner moved on and v1 is published


def test_bad_replay_settings_say_what_to_do():
    with pytest.raises(ValueError, match="reuse = 0.*use 1"):
        replay_buffer(reuse=0)
    with pytest.raises(ValueError, match="needs max_staleness >= 1"):
        replay_buffer(reuse=2, max_staleness=0)
    with pytest.raises(ValueError, match="positive_bias"):
        replay_buffer(positive_bias=1.0)


def test_synchronous_lease_room_is_what_the_batch_still_needs():
    buf = StalenessBuffer("queue-drop", max_staleness=0, batch_groups=4, queue_factor=2)
    assert buf.lease_room(0, in_flight=0) == 4
    buf.put(group(0))
    assert buf.lease_room(0, in_flight=2) == 1  # 1 queued + 2 generating: one more is needed
    assert buf.lease_room(0, in_flight=3) == 0
    for _ in range(3):
        buf.put(group(0))
    buf.take(0)
    assert buf.lease_room(0, in_flight=0) == 0  # its batch is training: v0 work would arrive stale
    assert buf.lease_room(1, in_flight=0) == 4
    assert StalenessBuffer("queue-drop", 1, 4, 2).lease_room(0, 100) is None  # asynchronous: no limit here


def test_a_version_is_leased_only_what_it_can_still_be_trained_in():
    """S = 1, I = 1 on the demo: a worker on v(t-1) was leased a second batch's worth while the
    learner trained batch t; those groups queued behind the batch and aged out, G every other
    step, a third of what was accepted (a new user, 2026-12-07). A version trainable for k more
    batches is leased only what the groups queued and in flight leave of k batches."""
    buf = StalenessBuffer("queue-drop", max_staleness=1, batch_groups=4, queue_factor=2)
    assert buf.version_room(0, 0, in_flight=0) is None  # the newest, not training: the window bounds it
    for _ in range(4):
        buf.put(group(0))
    buf.take(0)  # batch 0 trains: what arrives now is trained at v1 at the earliest, v0's last chance
    assert buf.version_room(0, 0, in_flight=1) == 3  # one batch, 1 of it coming
    buf.put(group(0))
    assert buf.version_room(0, 0, in_flight=3) == 0  # that batch is full: more would age out
    assert buf.version_room(1, 1, in_flight=3) is None  # the next version: a fresh window
    s2 = StalenessBuffer("queue-drop", max_staleness=2, batch_groups=4, queue_factor=2)
    for _ in range(4):
        s2.put(group(3))
    s2.take(3)
    assert s2.version_room(2, 3, in_flight=0) == 4  # v2 trains at v4 at the latest: one batch
    assert s2.version_room(3, 3, in_flight=0) == 8  # v3 at v4 or v5: two
    # Under dynamic sampling a prompt leased is a batch's group at the share that carry signal:
    # late in the demo 12% did, and a room of k·G prompts would have starved the learner.
    thin = StalenessBuffer("queue-drop", max_staleness=1, batch_groups=4, queue_factor=2, skip_uniform=True)
    for rewards in [[1.0, 0.0]] * 4 + [[1.0, 1.0]] * 12:  # a quarter carry signal
        thin.put(Group("p", 0, [1], [[5], [6]], [[-0.1]] * 2, rewards, worker_id="w"))
    thin.take(0)
    assert thin.useful_share == 0.25 and thin.version_room(0, 0, in_flight=2) == 4 * 4 - 2
    assert StalenessBuffer("queue-drop", 0, 4, 2).version_room(0, 0, 0) is None  # S = 0: `lease_room`'s
    assert StalenessBuffer("queue-drop", 1, 4, 2, staleness_filter=False).version_room(0, 5, 0) is None  # no filter


def test_drop_worker_discards_its_queued_and_replayable_groups():
    dropped = []
    buf = StalenessBuffer("queue-drop", 2, 2, 4, reuse=2, on_drop=lambda g, reason: dropped.append((g.prompt_id, reason)))
    for pid, wid in (("a", "w1"), ("b", "w2")):
        buf.put(Group(pid, 0, [1], [[5], [6]], [[-0.1]] * 2, [1.0, 0.0], worker_id=wid))
    buf.take(0)  # both now in the replay pool
    buf.put(Group("c", 0, [1], [[5]], [[-0.1]], [1.0], worker_id="w1"))
    buf.put(Group("d", 0, [1], [[5]], [[-0.1]], [1.0], worker_id="w2"))
    assert buf.drop_worker("w1") == 1 and dropped == [("c", "untrusted")]
    assert [g.prompt_id for g in buf._queue] == ["d"] and [g.prompt_id for g in buf._replay] == ["b"]
    s = buf.stats
    assert s.accepted == s.trained + s.dropped_untrusted + len(buf)


def test_replay_keeps_only_groups_with_a_gradient_freshest_by_generation_version():
    buf = replay_buffer(reuse=3, max_staleness=5, batch_groups=4, queue_factor=4, replay_size=2)
    same = Group("all-correct", 2, [1], [[5], [6]], [[-0.1]] * 2, [1.0, 1.0])  # zero advantage everywhere
    for g in (scored(2, "late-v2"), scored(3, "v3a"), same, scored(1, "early-v1")):
        buf.put(g)
    buf.take(3)
    assert not same.varied and scored(0, "x").varied
    assert [g.prompt_id for g in buf._replay] == ["late-v2", "v3a"]  # N = 2 freshest by version, not by arrival
    assert buf.metrics()["reuse_counts"] == {1: 4}  # every group counted once, in the pool or retired


# --- dynamic sampling ------------------------------------------------------------------------------


def test_dynamic_sampling_skips_groups_of_equal_rewards_and_counts_them():
    """A flood of all-correct groups (every claim true) neither fills a batch nor advances the
    learner: the batch is the groups that carry signal, and each skipped prompt is reported done."""
    done = []
    buf = StalenessBuffer("queue-drop", max_staleness=4, batch_groups=2, queue_factor=2,
                          skip_uniform=True, on_skip=lambda g: done.append(g.prompt_id))
    for i in range(50):
        buf.put(Group(f"flood{i}", 0, [1], [[5], [5]], [[-0.1]] * 2, [1.0, 1.0], worker_id="sybil"))
    assert buf.take(0) is None and len(buf) == 0  # nothing to train, nothing pushed out
    buf.put(scored(0, "a", 1.0))
    buf.put(scored(0, "b", 1.0))
    batch = buf.take(0)
    assert [g.prompt_id for g in batch.groups] == ["a", "b"]
    m = buf.metrics()
    assert m["skipped_uniform"] == 50 and len(done) == 50 and m["dropped_overflow"] == 0
    assert m["accepted"] == 52 and m["trained"] == 2  # the invariant counts the skipped groups


def test_without_dynamic_sampling_equal_rewards_are_trained():
    buf = StalenessBuffer("queue-drop", max_staleness=4, batch_groups=2, queue_factor=2)
    for i in range(2):
        buf.put(Group(f"u{i}", 0, [1], [[5], [5]], [[-0.1]] * 2, [1.0, 1.0]))
    assert len(buf.take(0).groups) == 2 and buf.useful_share == 1.0


def test_useful_share_is_the_median_workers_and_a_flood_cannot_push_it_below_the_floor():
    buf = StalenessBuffer("queue-drop", max_staleness=4, batch_groups=2, queue_factor=100, skip_uniform=True)
    for i in range(40):  # two honest workers: half their groups carry signal
        for w in ("w1", "w2"):
            g = scored(0, f"{w}-{i}", 1.0) if i % 2 else Group(f"{w}-{i}u", 0, [1], [[5]], [[-0.1]], [0.0])
            g.worker_id = w
            buf.put(g)
    assert buf.useful_share == pytest.approx(0.5)
    for i in range(150):  # one identity floods: the median worker is still an honest one
        buf.put(Group(f"f{i}", 0, [1], [[5]], [[-0.1]], [1.0], worker_id="sybil"))
    assert buf.useful_share == pytest.approx(0.5, abs=0.1)
    for s in range(3):  # a majority of flooding identities: the floor bounds what the scheduler would rent
        for i in range(60):
            buf.put(Group(f"s{s}-{i}", 0, [1], [[5]], [[-0.1]], [1.0], worker_id=f"sybil{s}"))
    from learner.buffer import MIN_USEFUL_SHARE
    assert buf.useful_share == MIN_USEFUL_SHARE


def test_dynamic_sampling_defaults_on_for_grpo_and_off_for_asymre():
    from learner.config import LearnerConfig

    assert LearnerConfig().dynamic_sampling is True
    assert LearnerConfig.model_validate({"trainer": {"loss": "asymre"}}).dynamic_sampling is False
    assert LearnerConfig.model_validate({"buffer": {"dynamic_sampling": False}}).dynamic_sampling is False


def test_the_status_line_shows_the_share_of_groups_with_signal():
    """Late in a run most prompts are always answered right and dynamic sampling skips their
    groups, so a step waits: the status line says why the learner idles."""
    from learner.record import _signal
    from learner.status import status_line

    buf = StalenessBuffer("queue-drop", max_staleness=2, batch_groups=2, queue_factor=2, skip_uniform=True)
    for i in range(6):
        buf.put(Group(f"u{i}", 0, [1], [[5]], [[-0.1]], [1.0]))
    buf.put(scored(0, "a", 1.0))
    buf.put(scored(0, "b", 1.0))
    batch = buf.take(0)
    assert batch.skipped == 6 and _signal(batch) == 0.25
    record = {"step": 1, "published_version": 0, "reward_mean": 0.5, "idle_ratio": 0.4, "signal_share": 0.25,
              "workers": 1, "recycled": 0, "avg_staleness": 0.0, "max_staleness": 0, "queue_size": 0,
              "sampled_mean_length": 1.0, "trained_mean_length": 1.0, "dollars_step": 0.0}
    assert "idle  40% signal  25% workers 1" in status_line(record)
    # Released workers heartbeat on: the line counted them as working ("workers 4" while one generated).
    assert "workers 1/4 joined | " in status_line({**record, "workers_joined": 4})
    assert buf.take(0) is None and (buf.put(scored(0, "c")), buf.put(scored(0, "d")))
    assert buf.take(0).skipped == 0  # counted since the previous batch


def test_replay_that_cannot_work_because_groups_arrive_s_behind_is_counted_and_said_once(caplog):
    # The fleet one version behind at S = 1 (a user's demo): every group is trained at staleness
    # S, is past S at the next version and can never be replayed. Nothing said so before.
    buf = replay_buffer(reuse=2, max_staleness=1, batch_groups=4, queue_factor=4)
    with caplog.at_level("WARNING", logger="echo.learner.buffer"):
        for version in range(1, 12):
            for i in range(4):
                buf.put(scored(version - 1, f"g{version}-{i}"))
            assert buf.take(version).replayed == 0
    assert buf.stats.replayed == 0 and buf.metrics()["replay_aged_out"] == 44
    said = [r.getMessage() for r in caplog.records if "reuse = 2 is doing little" in r.getMessage()]
    assert len(said) == 1 and "raise [buffer] max_staleness" in said[0]


def test_replay_that_works_is_not_warned_about(caplog):
    buf = replay_buffer(reuse=2, max_staleness=3, batch_groups=4, queue_factor=4)
    with caplog.at_level("WARNING", logger="echo.learner.buffer"):
        for version in range(1, 40):  # one version behind, S = 3: two more versions of room
            for i in range(4 if version == 1 else 2):  # then what a step needs fresh (ceil(G / reuse)): no backlog
                buf.put(scored(version - 1, f"g{version}-{i}"))
            assert buf.take(version) is not None
    assert buf.stats.replayed >= 30 * 2 and not caplog.records


def test_the_summary_tells_apart_workers_of_one_name():
    """A worker that rejoined under its name was listed twice as that name (`intme: 2084, ...,
    intme: 6532`; a new user, 2026-12-07): a name held by two identities gets their ids."""
    from learner.status import worker_label

    workers = [{"id": "w1", "name": "intme"}, {"id": "w2", "name": "keep"}, {"id": "w3", "name": "intme"}]
    assert [worker_label(w, workers) for w in workers] == ["intme (w1)", "keep", "intme (w3)"]
