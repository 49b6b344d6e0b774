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
