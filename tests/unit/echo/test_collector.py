"""The loop's collections, timed: those of its own thread only."""

import gc
import threading

from echo.collector import Pauses


def test_pauses_count_the_collections_of_their_own_thread_and_no_other():
    pauses = Pauses()
    try:
        gc.collect(0)
        gc.collect(1)
        other = threading.Thread(target=gc.collect)
        other.start()
        other.join()
        s = pauses.summary()
    finally:
        pauses.stop()
    assert s["collections"] == 2, s  # the other thread's full pass is not the loop's
    assert 0 < pauses.longest_s <= pauses.total_s
    gc.collect()
    assert pauses.summary()["collections"] == 2  # stopped: no longer counting


def test_once_serving_allocation_triggers_no_collection_and_the_clock_frees_cycles():
    """A hostile share of the fleet, allocating more, made the loop collect ~75% more often: once
    serving, collections come only on the clock, which still frees the cycles requests leave."""
    import asyncio
    import weakref

    from echo import collector

    class Node:
        pass

    def cycles(n: int) -> list:
        refs = []
        for _ in range(n):
            a, b = Node(), Node()
            a.other, b.other = b, a
            refs.append(weakref.ref(a))
        return refs

    async def scenario() -> None:
        pauses, threshold = Pauses(), gc.get_threshold()
        try:
            collector.serve()
            refs = cycles(20_000)  # ~28 young collections' worth at CPython's threshold of 700
            assert pauses.count == 0 and all(r() is not None for r in refs[:100])
            ticking = asyncio.create_task(collector.collections(young_every_s=0.05))
            await asyncio.sleep(0.2)
            assert all(r() is None for r in refs)  # freed by the clock's passes
            assert 1 <= pauses.count <= 6, pauses.summary()
            ticking.cancel()
            await asyncio.gather(ticking, return_exceptions=True)
            assert gc.isenabled()  # no longer serving: automatic young collections again, but no full
            assert gc.get_threshold()[2] == collector.NEVER  # pass counted up by the clock's (106-128 ms at a run's end)
        finally:
            pauses.stop()
            gc.set_threshold(*threshold)
            gc.enable()
            gc.unfreeze()

    asyncio.run(scenario())
