"""Say so when the run cannot start: workers joined, and none has installed a snapshot.

A worker that refuses every version (an adapter probe it cannot match, a snapshot of another
shape) takes no leases and logs why on its own machine; the learner then waits for rollouts
with nothing on its console, indefinitely. `NoInstalls` notes it once per stall, pointing at
the workers' logs; the loop runs on without it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from pathlib import Path


class NoInstalls:
    def __init__(self, after_s: float, note: Callable[[str], None], logs: Path):
        self.after_s, self.note, self.logs = after_s, note, logs
        self.said = False

    def check(self, workers: Iterable, published: int, now: float) -> bool:
        """Note once (until a worker installs) when every worker joined `after_s` ago or more
        still holds no version while one was published; returns whether it noted now."""
        workers = [w for w in workers if not w.quarantined]
        if published < 0 or not workers or any(w.version >= 0 for w in workers):
            self.said = False
            return False
        waited = now - max(w.joined for w in workers)
        if self.said or waited < self.after_s:
            return False
        self.said = True
        self.note(f"waiting: {len(workers)} worker{'s' if len(workers) > 1 else ''} joined {waited:.0f} s ago or more "
                  f"and none has installed a snapshot (v{published} is published): each refused it or is still "
                  f"loading. A worker logs why it refused an install ({self.logs}/*.log for the ones this learner "
                  "spawned; a remote worker's own output)")
        return True

    async def watch(self, registry, run, every_s: float = 5.0) -> None:
        while True:
            await asyncio.sleep(every_s)
            self.check(registry.alive(time.monotonic()), run.published_version, time.monotonic())
