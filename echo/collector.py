"""The cyclic garbage collector of a process that serves from one event loop (echo-learner).

CPython collects when allocations outrun deallocations by 700 tracked objects: the young
generation, every tenth time the middle one too, and a full pass when a quarter more objects
survived. On a loop serving a thousand workers each of these held every request:
- full passes walk every live object and find next to nothing to free (~700 objects in a 120 s
  run of `echo-rl bench control-plane`); they ran every ~20 s there, 20-63 ms each;
- young passes walk what is young and alive, a thousand workers' parked requests among it
  (coroutines, tasks, contexts): 2-5 ms each, the middle generation's 10-19 ms, ~3 per second;
- and they come with allocation, so whoever allocates more makes every request wait more: a
  hostile 5% of the fleet, each refusal a few hundred short-lived objects, took the loop's
  collections from 375 to ~660 per 120 s (86 -> 163 over 5 ms; 4 pairs of runs).

So once serving: start-up's objects are frozen out of collections altogether, allocation no
longer triggers any, and `collections` runs them on a clock instead: the young and middle
generations every `YOUNG_EVERY_S` (the cycles requests leave behind are freed as soon as
before), a full pass every `FULL_EVERY_S`. However many requests come, the loop pays the same
few passes a second.

A full pass walks what outlived the middle generation, live or garbage. Garbage should not
get there: each evicted broadcast version was a reference cycle (~34 objects, ~440 a second in
the CPU demo), and after 10 minutes one full pass walked 130,000 of them in 170 ms; since they
are freed at eviction (`broadcast.store`), a pass there finds next to nothing.

The clock sets the longest pause: a pass walks what was allocated since the last one and is
still alive (~2,000-7,000 objects per 0.25 s under the bench's 1,000 workers, each a pointer
chase into the old heap). Every 0.25 s they took up to 10-14 ms, 18 (benign) and 47 (hostile)
over 5 ms per 60 s run, and those pauses set the honest p99; every 0.05 s the longest was
3.6-4.6 ms and none over 5 ms, for ~40% more collecting in all (0.5 -> 0.7 s per minute).
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time

YOUNG_EVERY_S = 0.05
FULL_EVERY_S = 300.0
NEVER = 1 << 30  # middle-generation passes between automatic full ones: none (each clock pass counts as one)


def serve() -> None:
    """From here on the process serves: freeze what start-up built, and collect only when
    `collections` says (run it as a task of the serving loop)."""
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, NEVER)  # and once `collections` ends, no automatic full pass either
    gc.disable()


async def collections(young_every_s: float = YOUNG_EVERY_S, full_every_s: float = FULL_EVERY_S) -> None:
    """The young and middle generations every `young_every_s`, everything every `full_every_s`
    (cycles that outlived the young passes are freed a few minutes late)."""
    loop = asyncio.get_running_loop()
    full_at = loop.time() + full_every_s
    try:
        while True:
            await asyncio.sleep(young_every_s)
            if loop.time() >= full_at:
                gc.collect()
                full_at = loop.time() + full_every_s
            else:
                gc.collect(1)
    finally:  # no longer serving (the run ended): what comes after collects as usual
        gc.enable()


class Pauses:
    """The collections that ran on this thread (the event loop's), timed: how many, how long in
    all, the longest, and how many held it over 5 ms (`echo-rl bench control-plane` reports them)."""

    def __init__(self) -> None:
        self._thread, self._clock = threading.get_ident(), time.perf_counter
        self._started = 0.0
        self.count, self.total_s, self.longest_s, self.over_5ms = 0, 0.0, 0.0, 0
        gc.callbacks.append(self._timed)

    def _timed(self, phase: str, info: dict) -> None:
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
