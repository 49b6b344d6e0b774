"""The cyclic garbage collector of a process that serves from one event loop (echo-learner).

A full collection walks every tracked object while the loop waits. Once serving, almost every
object is long-lived state (workers, leases, the buffer) and a full pass finds next to nothing
to free (~700 objects in a 120 s run of `echo-rl bench control-plane`), but it ran every
~20 s there, holding the loop 20-63 ms each time: the tail of every route's latency. So:
start-up's objects are frozen out of collections altogether, the youngest generations are
collected as usual (they hold the cycles requests leave behind), and full passes come on a
clock, every `FULL_EVERY_S`, instead of whenever a quarter more objects has survived.

The middle generation is collected after every young collection but one (`MIDDLE_EVERY`), not
every tenth: it holds what survived the young passes since its last collection (a thousand
workers' parked requests: coroutines, tasks, contexts), and ten passes' worth took 10-19 ms to
walk, 3-8 ms at one pass's worth. Each object is still walked there once, so the total is alike
(246 against 237 ms in 30 s); only the longest hold shrinks.
"""

from __future__ import annotations

import asyncio
import gc

FULL_EVERY_S = 300.0
NEVER = 1 << 30  # gen-1 collections between automatic full ones: none
MIDDLE_EVERY = 1  # young collections between two of the middle generation (CPython: 10)


def serve() -> None:
    """From here on the process serves: freeze what start-up built, take full passes off the
    automatic schedule (`full_collections` runs them)."""
    gc.freeze()
    young, _, _ = gc.get_threshold()
    gc.set_threshold(young, MIDDLE_EVERY, NEVER)


async def full_collections(every_s: float = FULL_EVERY_S) -> None:
    """A full pass every `every_s` seconds: cycles that outlived the young generations are still
    freed, a few minutes late."""
    while True:
        await asyncio.sleep(every_s)
        gc.collect()


class Pauses:
    """The collections that ran on this thread (the event loop's), timed: how many, how long in
    all, the longest, and how many held it over 5 ms (`echo-rl bench control-plane` reports them)."""

    def __init__(self) -> None:
        import threading
        import time

        self._thread, self._clock = threading.get_ident(), time.perf_counter
        self._started = 0.0
        self.count, self.total_s, self.longest_s, self.over_5ms = 0, 0.0, 0.0, 0
        gc.callbacks.append(self._timed)

    def _timed(self, phase: str, info: dict) -> None:
        import threading

        if threading.get_ident() != self._thread:
            return
        if phase == "start":
            self._started = self._clock()
            return
        took = self._clock() - self._started
        self.count += 1
        self.total_s += took
        self.longest_s = max(self.longest_s, took)
        self.over_5ms += took > 0.005

    def summary(self) -> dict:
        return {"collections": self.count, "total_ms": round(1e3 * self.total_s, 1),
                "longest_ms": round(1e3 * self.longest_s, 1), "over_5ms": self.over_5ms}

    def stop(self) -> None:
        gc.callbacks.remove(self._timed)
