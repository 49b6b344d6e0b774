"""Parked lease requests: a wake-up goes to a waiter that can use the room it announces."""

import asyncio
from types import SimpleNamespace

from learner.admission import Waiters


def test_a_wake_up_skips_a_waiter_whose_window_is_full_and_keeps_its_place():
    full = {"hoarder"}
    waiters = Waiters(eligible=lambda worker: worker.id not in full)
    woken: list[str] = []

    async def park(name: str) -> None:
        await waiters.wait(2.0, SimpleNamespace(id=name))
        woken.append(name)

    async def scenario() -> None:
        tasks = [asyncio.create_task(park(n)) for n in ("hoarder", "honest-1", "honest-2")]
        await asyncio.sleep(0.01)
        waiters.wake(1)  # room for one lease: the hoarder is first in line but cannot take it
        await asyncio.sleep(0.05)
        assert woken == ["honest-1"]
        full.clear()  # the hoarder's lease was answered: its window opened, it is first in line again
        waiters.unblock("hoarder")
        waiters.wake(1)
        await asyncio.sleep(0.05)
        assert woken == ["honest-1", "hoarder"]
        waiters.wake_all()
        await asyncio.gather(*tasks)

    asyncio.run(scenario())


def test_wake_ups_nobody_can_use_are_not_banked():
    waiters = Waiters(eligible=lambda worker: False)

    async def scenario() -> None:
        task = asyncio.create_task(waiters.wait(0.3, SimpleNamespace(id="capped")))
        await asyncio.sleep(0.01)
        waiters.wake(5)
        await asyncio.sleep(0.05)
        assert not task.done() and waiters._owed == 0
        await task

    asyncio.run(scenario())


def test_a_waiter_that_cannot_take_room_is_asked_once_not_at_every_wake_up():
    """50 hoarders with full windows parked ahead of the honest fleet: each is checked once and
    set aside, not 50 checks per freed prompt, until its own leases change."""
    asked: list[str] = []

    def eligible(worker) -> bool:
        asked.append(worker.id)
        return not worker.id.startswith("hoarder")

    waiters = Waiters(eligible=eligible)
    woken: list[str] = []

    async def park(name: str) -> None:
        await waiters.wait(2.0, SimpleNamespace(id=name))
        woken.append(name)

    async def scenario() -> None:
        names = [f"hoarder-{i}" for i in range(50)] + [f"honest-{i}" for i in range(20)]
        tasks = [asyncio.create_task(park(n)) for n in names]
        await asyncio.sleep(0.01)
        for _ in range(20):  # 20 prompts answered, one at a time
            waiters.wake(1)
            await asyncio.sleep(0)
        await asyncio.sleep(0.05)
        assert woken == [f"honest-{i}" for i in range(20)]
        assert sum(a.startswith("hoarder") for a in asked) == 50  # once each (it was 50 × 20)
        assert len(waiters) == 50
        waiters.unblock("hoarder-7")  # its lease expired: back at the front of the line
        waiters.wake(1)
        await asyncio.sleep(0.05)
        assert asked[-1] == "hoarder-7" and len(waiters) == 50  # asked again, still full: set aside again
        waiters.wake_all()  # the run finished: the set-aside hear it too
        await asyncio.gather(*tasks)
        assert len(woken) == 70

    asyncio.run(scenario())


def test_waking_every_waiter_serves_a_few_per_turn_of_the_loop_not_all_in_one():
    """A run's end, an eval round or a new version wakes hundreds of parked requests: woken in one
    call, their handlers all ran in one turn of the loop (~40 ms at 1,000 workers) while every
    heartbeat waited. Delivered WAKE_BATCH at a time, a heartbeat gets a turn in between, and
    every waiter still wakes, in order."""
    from learner.admission import WAKE_BATCH

    waiters = Waiters()
    woken: list[int] = []
    turns: list[int] = []  # how many had woken at each turn of the loop a ticker saw

    async def park(n: int) -> None:
        await waiters.wait(5.0, SimpleNamespace(id=n))
        woken.append(n)

    async def ticker() -> None:
        while True:
            turns.append(len(woken))
            if len(woken) == 300:
                return
            await asyncio.sleep(0)

    async def scenario() -> None:
        tasks = [asyncio.create_task(park(n)) for n in range(300)]
        await asyncio.sleep(0.01)
        tick = asyncio.create_task(ticker())
        waiters.wake_where(lambda worker: True)
        await asyncio.wait_for(asyncio.gather(*tasks, tick), 2.0)

    asyncio.run(scenario())
    assert woken == list(range(300))
    steps = [b - a for a, b in zip(turns, turns[1:])]
    assert max(steps) <= WAKE_BATCH, max(steps)  # on the code before: 300 in one turn
    assert len(turns) >= 300 // WAKE_BATCH


def test_counted_wake_ups_and_told_waiters_share_a_turn_and_both_arrive():
    waiters = Waiters()
    woken: list[str] = []

    async def park(name: str) -> None:
        await waiters.wait(2.0, SimpleNamespace(id=name))
        woken.append(name)

    async def scenario() -> None:
        tasks = [asyncio.create_task(park(f"w{n}")) for n in range(40)]
        await asyncio.sleep(0.01)
        waiters.wake_where(lambda worker: worker.id in ("w5", "w7"))  # stale: told to install
        waiters.wake(3)  # room for three leases: the first three still in line
        await asyncio.sleep(0.05)
        assert sorted(woken) == ["w0", "w1", "w2", "w5", "w7"], woken
        waiters.wake_all()
        await asyncio.gather(*tasks)

    asyncio.run(scenario())
