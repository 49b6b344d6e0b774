"""The cyclic garbage collector of a process that serves from one event loop (echo-learner).

A full collection walks every tracked object while the loop waits. Once serving, almost every
object is long-lived state (workers, leases, the buffer) and a full pass finds next to nothing
to free (~700 objects in a 120 s run of `echo-rl bench control-plane`), but it ran every
~20 s there, holding the loop 20-63 ms each time: the tail of every route's latency. So:
start-up's objects are frozen out of collections altogether, the youngest generations are
collected as usual (they hold the cycles requests leave behind), and full passes come on a
clock, every `FULL_EVERY_S`, instead of whenever a quarter more objects has survived.
"""

from __future__ import annotations

import asyncio
import gc

FULL_EVERY_S = 300.0
NEVER = 1 << 30  # gen-1 collections between automatic full ones: none


def serve() -> None:
    """From here on the process serves: freeze what start-up built, take full passes off the
    automatic schedule (`full_collections` runs them)."""
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, NEVER)


async def full_collections(every_s: float = FULL_EVERY_S) -> None:
    """A full pass every `every_s` seconds: cycles that outlived the young generations are still
    freed, a few minutes late."""
    while True:
        await asyncio.sleep(every_s)
        gc.collect()
