"""Who gets in, and who waits: the join gate and the long-polled lease requests.

`TokenBucket`: so many per second after a burst (joins, one worker's requests).
`JoinGate`: joins per second (a token bucket) and the network allow-list.
`Waiters`: lease requests parked until there is work, woken first come first served.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections import deque
from typing import Any, Callable

from broadcast.addresses import in_networks

WAKE_BATCH = 8  # waiters woken per turn of the event loop: a lease handler takes ~1-2 ms (its prompts tokenized)


class Waiters:
    """Long-polled lease requests waiting for work, first come first served. Room freed for one
    lease wakes one waiter; a new learner version wakes those it made too stale to be served
    (they are told to install), and the room a batch freed; only the end of training wakes all.

    A counted wake-up goes only to a waiter that can use it (`eligible`, e.g. a worker whose
    lease window is not full): handed to one that cannot, it would be spent on a request that
    parks again, and the room it announced would sit unused until some later wake-up. One that
    cannot is set aside (`blocked`) until its worker's own leases change (`unblock`, called by
    the lease room), then goes back to the front of the line: asked again at every wake-up, 50
    hoarders parked ahead of the fleet were 50 checks per freed prompt."""

    def __init__(self, eligible: Callable[[Any], bool] = lambda worker: True,
                 key: Callable[[Any], Any] = lambda worker: worker.id) -> None:
        self._queue: deque[tuple[asyncio.Future, Any]] = deque()
        self._blocked: dict[Any, deque[tuple[asyncio.Future, Any]]] = {}  # by worker: can take nothing now
        self._owed = 0  # wake-ups not yet delivered
        self._told: deque[asyncio.Future] = deque()  # woken by `wake_where`, not yet delivered
        self._paying: asyncio.Task | None = None
        self.eligible, self.key = eligible, key

    def __len__(self) -> int:
        return len(self._queue) + sum(map(len, self._blocked.values()))

    def unblock(self, key: Any) -> None:
        """`key`'s leases changed (answered, handed back, expired): its parked requests may take
        room again, ahead of those that came later."""
        parked = self._blocked.pop(key, None)
        if parked:
            self._queue.extendleft(reversed([w for w in parked if not w[0].done()]))

    async def wait(self, timeout: float, worker: Any) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((fut, worker))
        try:
            await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            fut.cancel()  # a woken-up future is done; a cancelled one is skipped by wake()

    def wake(self, n: int = 1) -> None:
        """Wake `n` waiters, a few at a time: a step that frees room for hundreds of leases would
        otherwise serve them all in one turn of the loop while heartbeats queue behind them."""
        self._owed += n
        self._start_paying()

    def wake_where(self, predicate: Callable[[Any], bool]) -> None:
        """Wake every waiter whose worker `predicate` picks (room or not: they are told something),
        delivered a few at a time like counted wake-ups: all at once, the hundreds a run's end or an
        eval round wakes held the loop ~40 ms in one turn."""
        for key in list(self._blocked):  # (for this, the blocked count as waiting like any other)
            self.unblock(key)
        kept: deque = deque()
        for fut, worker in self._queue:
            if fut.done():
                continue
            if predicate(worker):
                self._told.append(fut)
            else:
                kept.append((fut, worker))
        self._queue = kept
        self._start_paying()

    def _start_paying(self) -> None:
        if self._paying is None and (self._told or (self._owed > 0 and self._queue)):
            self._paying = asyncio.get_running_loop().create_task(self._pay())

    async def _pay(self) -> None:
        try:
            while self._told or (self._owed > 0 and self._queue):
                turn = 0  # waiters woken in this turn of the loop
                while turn < WAKE_BATCH and self._told:
                    fut = self._told.popleft()
                    if not fut.done():
                        fut.set_result(None)
                        turn += 1
                woken = 0
                while turn < WAKE_BATCH and woken < self._owed and self._queue:
                    fut, worker = self._queue.popleft()
                    if fut.done():
                        continue
                    if not self.eligible(worker):
                        parked = self._blocked.setdefault(self.key(worker), deque())
                        while parked and parked[0][0].done():  # timed out meanwhile
                            parked.popleft()
                        parked.append((fut, worker))
                        continue
                    fut.set_result(None)
                    woken += 1
                    turn += 1
                self._owed -= woken
                if not self._told and turn < WAKE_BATCH:  # nobody left who could use the rest
                    break
                await asyncio.sleep(0)
        finally:
            self._owed = 0
            self._paying = None

    def wake_all(self) -> None:
        self.wake_where(lambda worker: True)


class TokenBucket:
    """`rate` per second on average, after a burst of `burst` at once. Slotted and small: every
    worker record holds one (its requests), so the buckets go when the workers are forgotten."""

    __slots__ = ("rate", "burst", "tokens", "at")

    def __init__(self, rate: float, burst: float, now: float):
        self.rate, self.burst = rate, burst
        self.tokens, self.at = float(burst), now

    def take(self, now: float) -> float:
        """0 if one may pass now (it is counted), else the seconds until one may."""
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate


class JoinGate:
    """Token bucket on joins, plus the network allow-list."""

    def __init__(self, rate: float, burst: int, networks: list[str]):
        self.bucket = TokenBucket(rate, burst, time.monotonic())
        self.networks = [ipaddress.ip_network(n, strict=False) for n in networks]

    def allowed_from(self, address: str) -> bool:
        return not self.networks or in_networks(address, self.networks)

    def take(self, now: float) -> float:
        """0 if a join may pass now, else the seconds until one may."""
        return self.bucket.take(now)
