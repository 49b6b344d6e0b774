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
        full.clear()  # the hoarder's window opened: it is first in line again
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
