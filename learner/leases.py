"""Prompt leases: which worker is generating which prompts, until when.

A worker leases a few prompts, generates a group for each and submits them. A lease lives
`ttl` seconds and every heartbeat of its worker renews it; when a worker goes silent its
lease expires and the unfinished prompts go to the front of the queue, so nothing is lost.

A prompt whose group was accepted but then dropped by the buffer (overflow, or staler than
`S`) is `recycle`d: queued again like an expired one, so every prompt is eventually trained.

A lease belongs to the worker it was issued to: only that worker may submit into it or hand
it back (`UnknownLease` otherwise, whatever the lease id). Every operation costs O(its own
prompts), not O(all leases): a thousand workers heartbeat and lease concurrently.

A worker cannot hoard (`WorkerCap`): until it has delivered it holds a few prompts at most (and
no more than its share of the prompts in flight among the workers alive); then
twice what it delivered within one lease turnaround (at least `ttl`), so an
honest worker's share grows as it proves itself, like a TCP window. A lease also has an
absolute deadline from its issue that heartbeats cannot extend, and a lease that expires
unanswered is held against its worker (`expired_unanswered`; its window starts over, halved
for each such lease while it has delivered nothing). A worker that never delivered is held
tighter still, because a hoarder heartbeats and never answers: its leases live at most a few
times the fleet's median turnaround whatever its heartbeats say, and all such workers together
hold at most `unproven_share` of the prompts in flight — the rest is the proven fleet's.

Plain logic with an injectable clock; the server calls `expire()` periodically.
Invariant: issued = completed + reissued + outstanding (prompt-issues).
"""

from __future__ import annotations

import bisect
import itertools
import math
import secrets
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from echo.tasks import Prompt

# A lease out this many of the fleet's median turnarounds is overdue: a synchronous batch (S = 0)
# leases its room again rather than wait on it (a fresh identity that leased and never answered
# held each step for the lease's whole TTL: 26 steps in 30 s became 2; an API-only tester, 2026-12-07).
OVERDUE_TURNAROUNDS = 3.0


class UnknownLease(KeyError):
    """The lease or the prompt in it is not outstanding (expired, finished, or never issued)."""


@dataclass
class Lease:
    id: str
    worker_id: str
    deadline: float
    prompts: dict[str, Prompt] = field(default_factory=dict)  # still outstanding
    issued_at: float = 0.0
    size: int = 0  # prompts at issue
    latest: float = math.inf  # heartbeats renew the deadline up to this, never past it


@dataclass
class LeaseStats:
    issued: int = 0  # prompt-issues, counting re-issues
    completed: int = 0
    expired_prompts: int = 0
    expired_leases: int = 0
    reissued: int = 0  # prompts queued again (expired leases and refused stale groups)
    dropped_reissued: int = 0  # completed prompts queued again because the buffer dropped their group


@dataclass(frozen=True)
class WorkerCap:
    """How much one worker may hold. `first`: prompts outstanding before it delivered anything;
    `lifetime`: seconds from issue after which a lease expires whatever its heartbeats say."""

    first: int = 8
    lifetime: float = 600.0
    unproven_share: float = 1.0  # of the prompts in flight, what workers that never delivered hold at most
    unproven_turnarounds: float = 4.0  # an unproven worker's lease lives this many median turnarounds

    @classmethod
    def of(cls, server) -> "WorkerCap":
        """From `[server] lease_first_prompts`, `lease_max_s` and `unproven_share`."""
        return cls(server.lease_first_prompts, server.lease_max_s, server.unproven_share)


@dataclass
class _Delivery:
    """What the book measured of one worker: when its prompts came back, and how long its leases took."""

    done: deque = field(default_factory=lambda: deque(maxlen=256))  # completion times
    turnaround: deque = field(default_factory=lambda: deque(maxlen=16))  # issue -> last prompt back, per lease
    expired_unanswered: int = 0  # leases that ran out with nothing delivered

    def window(self, cap: WorkerCap, ttl: float, limit: int, now: float | None = None, alive: int = 0) -> int:
        if not self.done:  # nothing delivered (since its last unanswered expiry): halved per such expiry,
            # and never more than its share of the prompts in flight among the `alive` workers (at
            # least 1): sybils hold what as many honest newcomers would, not `first` each
            fair = max(1, limit // alive) if alive else limit
            return min(max(1, cap.first >> min(self.expired_unanswered, 16)), limit, fair)
        # Twice what it delivered within one lease turnaround (at least ttl) before `now`. Counted,
        # not a rate from first to last delivery: the groups of one upload arrive microseconds
        # apart, and a rate over them would open the window to the whole book after one upload.
        horizon = max(ttl, sum(self.turnaround) / len(self.turnaround) if self.turnaround else 0.0)
        since = (self.done[-1] if now is None else now) - horizon
        recent = len(self.done) - bisect.bisect_left(self.done, since)  # in time order: asked per parked request woken
        return min(max(cap.first, 2 * recent), limit)


_NOTHING = _Delivery()  # a worker not yet measured (read, never written)


class LeaseBook:
    def __init__(self, prompts: Iterator[Prompt], ttl: float, max_outstanding: int, retry: list[Prompt] = (),
                 on_lease: Callable[[list[Prompt]], None] | None = None, per_worker: WorkerCap | None = None):
        self._fresh = prompts
        self._ahead: deque[Prompt] = deque()  # drawn from `_fresh` by `upcoming`, issued before it
        # Re-issued first: oldest work is finished first (a restarted learner passes what was in flight).
        self._retry: deque[Prompt] = deque(retry)
        self._leases: dict[str, Lease] = {}
        self._by_worker: dict[str, set[str]] = {}
        self._outstanding = 0
        self.on_lease = on_lease or (lambda prompts: None)  # the ledger writes each issue down
        self._ids = itertools.count()
        self.ttl = ttl
        self.max_outstanding = max_outstanding
        self.per_worker = per_worker  # None: a worker may hold everything (unit tests of the plain book)
        self._delivery: dict[str, _Delivery] = {}
        self._turnarounds: deque[float] = deque(maxlen=256)  # the fleet's recent lease turnarounds (issue to done)
        self._median: float | None = None  # of `_turnarounds`, kept until the next one comes back
        self.alive = 0  # workers alive (set by the server): an unproven worker's window is at most its share
        self.stats = LeaseStats()

    @property
    def outstanding(self) -> int:
        return self._outstanding

    @property
    def waiting_retry(self) -> int:
        return len(self._retry)

    def outstanding_by_worker(self) -> dict[str, int]:
        return {w: self.held(w) for w in self._by_worker}

    def held(self, worker_id: str) -> int:
        """Prompts `worker_id` holds now (O(its leases))."""
        return sum(len(self._leases[i].prompts) for i in self._by_worker.get(worker_id, ()))

    def get(self, lease_id: str) -> Lease | None:
        return self._leases.get(lease_id)

    def worker_room(self, worker_id: str, now: float | None = None) -> int:
        """Prompts `worker_id` may still take at `now` (None: as of its last delivery): its window
        less what it holds."""
        if self.per_worker is None:
            return self.max_outstanding
        held = self.held(worker_id)
        record = self._delivery.get(worker_id, _NOTHING)
        room = record.window(self.per_worker, self.ttl, self.max_outstanding, now, self.alive) - held
        if not record.done and self.per_worker.unproven_share < 1.0:  # unproven: within what they all may hold
            # (O(leases): a share of 1 is the book's own bound, and this runs for every parked request woken)
            quota = max(self.per_worker.first, int(self.per_worker.unproven_share * self.max_outstanding))
            room = min(room, quota - self._unproven_held())
        return max(0, room)

    def _unproven_held(self) -> int:
        """Prompts held by workers that have delivered nothing (O(leases): asked only for those)."""
        return sum(len(lease.prompts) for lease in self._leases.values()
                   if not self._delivery.get(lease.worker_id, _NOTHING).done)

    @property
    def median_turnaround(self) -> float | None:
        """The fleet's median lease turnaround, issue to last prompt back (None before any came back)."""
        if self._median is None and self._turnarounds:
            self._median = sorted(self._turnarounds)[len(self._turnarounds) // 2]
        return self._median

    def _unproven_lifetime(self) -> float:
        """How long an unproven worker's lease may live: a few of the fleet's median turnarounds
        (at least `ttl`), or the usual lifetime before any lease came back."""
        median = self.median_turnaround
        if median is None:
            return self.per_worker.lifetime
        return min(self.per_worker.lifetime, max(self.ttl, self.per_worker.unproven_turnarounds * median))

    def overdue(self, now: float) -> int:
        """Prompts of leases out longer than `OVERDUE_TURNAROUNDS` of the fleet's median turnaround
        (0 before any came back). A synchronous batch does not wait for them as coming: it leases
        their room to others (a backup), as stragglers' tasks are run again elsewhere."""
        median = self.median_turnaround
        if median is None:
            return 0
        bound = now - OVERDUE_TURNAROUNDS * median
        return sum(len(lease.prompts) for lease in self._leases.values() if lease.issued_at < bound)

    def expired_unanswered(self, worker_id: str) -> int:
        record = self._delivery.get(worker_id)
        return record.expired_unanswered if record else 0

    def lease(self, worker_id: str, max_prompts: int, now: float) -> Lease | None:
        room = min(max_prompts, self.max_outstanding - self._outstanding, self.worker_room(worker_id, now))
        if room <= 0:
            return None
        lifetime = self.per_worker.lifetime if self.per_worker else math.inf
        if self.per_worker and not self._delivery.get(worker_id, _NOTHING).done:
            lifetime = self._unproven_lifetime()
        lease = Lease(f"L{next(self._ids)}-{secrets.token_hex(8)}", worker_id, now + self.ttl, issued_at=now,
                      latest=now + lifetime)
        for _ in range(room):
            prompt = self._retry.popleft() if self._retry else self._ahead.popleft() if self._ahead else next(self._fresh)
            lease.prompts[prompt.id] = prompt
        lease.size = len(lease.prompts)
        self._leases[lease.id] = lease
        self._by_worker.setdefault(worker_id, set()).add(lease.id)
        self._outstanding += lease.size
        self.stats.issued += lease.size
        self.on_lease(list(lease.prompts.values()))
        return lease

    def upcoming(self, n: int) -> list[Prompt]:
        """The next `n` prompts `lease` would issue, in order: those queued for re-issue, then fresh
        ones (a prompt re-queued before then goes ahead of them)."""
        while len(self._ahead) < n - len(self._retry):
            self._ahead.append(next(self._fresh))
        return [*itertools.islice(self._retry, n), *itertools.islice(self._ahead, max(0, n - len(self._retry)))]

    def prompt_of(self, lease_id: str, prompt_id: str, worker_id: str | None = None) -> Prompt:
        """The outstanding prompt, if `worker_id` (when given) holds the lease."""
        lease = self._leases.get(lease_id)
        if lease is None or prompt_id not in lease.prompts or (worker_id is not None and lease.worker_id != worker_id):
            raise UnknownLease(f"lease {lease_id!r} has no outstanding prompt {prompt_id!r} for this worker "
                               "(expired, already submitted, or another worker's)")
        return lease.prompts[prompt_id]

    def _take(self, lease_id: str, prompt_id: str, worker_id: str | None, now: float | None = None) -> Prompt:
        prompt = self.prompt_of(lease_id, prompt_id, worker_id)
        lease = self._leases[lease_id]
        del lease.prompts[prompt_id]
        self._outstanding -= 1
        if not lease.prompts:
            self._forget(lease)
            if now is not None:
                self._record(lease.worker_id).turnaround.append(now - lease.issued_at)
                self._turnarounds.append(now - lease.issued_at)
                self._median = None
        return prompt

    def complete(self, lease_id: str, prompt_id: str, worker_id: str | None = None, now: float | None = None) -> Prompt:
        """The prompt's group was accepted. With `now`, it counts towards its worker's measured rate."""
        owner = self._owner(lease_id, worker_id)
        prompt = self._take(lease_id, prompt_id, worker_id, now)
        if now is not None:
            self._record(owner).done.append(now)
        self.stats.completed += 1
        return prompt

    def _owner(self, lease_id: str, worker_id: str | None) -> str:
        lease = self._leases.get(lease_id)
        return worker_id or (lease.worker_id if lease else "")

    def _record(self, worker_id: str) -> _Delivery:
        return self._delivery.setdefault(worker_id, _Delivery())

    def give_back(self, lease_id: str, prompt_id: str, worker_id: str | None = None) -> None:
        """The prompt's group was refused (too stale): queue the prompt for re-issue now."""
        self._retry.append(self._take(lease_id, prompt_id, worker_id))
        self.stats.reissued += 1

    def recycle(self, prompt: Prompt) -> None:
        """A completed prompt's group was dropped before training: issue the prompt again."""
        self._retry.append(prompt)
        self.stats.dropped_reissued += 1

    def release(self, lease_id: str, worker_id: str) -> int:
        """The worker hands a whole lease back unanswered: re-issue its prompts now."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.worker_id != worker_id:
            raise UnknownLease(f"lease {lease_id!r} is not outstanding for this worker")
        self._forget(lease)
        self._outstanding -= len(lease.prompts)
        self._retry.extend(lease.prompts.values())
        self.stats.reissued += len(lease.prompts)
        return len(lease.prompts)

    def renew(self, worker_id: str, now: float) -> None:
        for lease_id in self._by_worker.get(worker_id, ()):
            lease = self._leases[lease_id]
            lease.deadline = min(now + self.ttl, lease.latest)

    def expire(self, now: float) -> list[Lease]:
        """Drop leases past their deadline and queue their prompts for re-issue. One that ran out
        with nothing delivered counts against its worker, whose window starts over."""
        dead = [lease for lease in self._leases.values() if lease.deadline < now]
        for lease in dead:
            self._drop(lease)
            if len(lease.prompts) == lease.size:
                record = self._record(lease.worker_id)
                record.expired_unanswered += 1
                record.done.clear()
        return dead

    def forget_worker(self, worker_id: str) -> None:
        self._delivery.pop(worker_id, None)

    def release_worker(self, worker_id: str) -> list[Lease]:
        """A worker left or was declared dead: re-issue everything it held."""
        dead = [self._leases[i] for i in self._by_worker.get(worker_id, ())]
        for lease in dead:
            self._drop(lease)
        return dead

    def _forget(self, lease: Lease) -> None:
        del self._leases[lease.id]
        ids = self._by_worker[lease.worker_id]
        ids.discard(lease.id)
        if not ids:
            del self._by_worker[lease.worker_id]

    def _drop(self, lease: Lease) -> None:
        self._forget(lease)
        self._outstanding -= len(lease.prompts)
        self._retry.extend(lease.prompts.values())
        self.stats.expired_leases += 1
        self.stats.expired_prompts += len(lease.prompts)
        self.stats.reissued += len(lease.prompts)
