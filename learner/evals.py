"""Greedy evaluation on the workers, one version at a time: the learner never generates.

A *round* evaluates snapshot `v` on the task's eval prompts. Its prompts go out as eval leases
(greedy, one sample each), only to workers whose installed version is exactly `v` (they say so
when they ask for a lease, and generate the batch before installing anything else), so every
answer of the round is `v`'s. Eval leases come before training prompts. A worker that dies
loses nothing: its eval lease expires like any other and the prompts go back to the round.
A worker holds one eval lease at a time, only once it has delivered training work the learner
accepted (`proven`; any worker before the run's first accepted group), and a lease lives at
most `lifetime` seconds from its issue whatever its heartbeats: `lifetime`, or once leases of
the run came back, four times their median answer time (at least `ttl`). One identity that took
an eval lease and sat on it, heartbeating, held up every eval round for ~60 s and the rounds
due meanwhile never opened (an API-only tester, 2026-11-30). So also: once nothing of a round
is pending, a worker on `v` asking for work gets a *backup* of an outstanding lease late by the
run's median answer time (at most `HOLDERS` holders of one set of prompts; the first answer
counts, the others are refused), and honest workers still on `v` finish the round; and a
worker that kept its lease alive to its lifetime without answering is `barred` from eval leases
for the rest of the run (a learner that stalls lets leases lapse unrenewed: nobody is barred for
it). If no live worker that may still answer holds `v` (all moved on, or barred), the round is
abandoned (`abandoned`): the learner opens the next one at a version it holds aside to check,
never a round whose answers it cannot check.

Workers are never told the answers (a worker holding them could return them instead of its
model's), and their rewards are not believed: the learner scores each completion itself, and
keeps it with the worker that sent it (`EvalResult.answers`) so the loop can check that it is the
version's greedy completion (`learner.evaluation`).

Plain logic with an injectable clock, like `LeaseBook`; the server and the learner's loop drive it.
"""

from __future__ import annotations

import itertools
import secrets
from collections import deque
from dataclasses import dataclass, field

from echo.tasks import Prompt
from echo.wire import Rejected
from learner.addresses import remember


@dataclass
class EvalResult:
    version: int
    accuracy: float
    prompts: int
    seconds: float  # round opened → last answer
    workers: int
    restarts: int
    answers: dict[str, tuple[str, list[int]]] = field(default_factory=dict)  # prompt id -> (worker, completion)
    scores: dict[str, float] = field(default_factory=dict)  # prompt id -> the learner's reward
    answered_by: frozenset[str] = frozenset()  # the workers whose answers it holds (`workers` of them)
    opened: float | None = None  # when the round was first opened (a re-asked round goes on from it)
    backups: int = 0  # backup leases issued: what a round cost beyond one answer per prompt
    waited: float = 0.0  # of `seconds`, before its first lease went out (no worker on its version yet)


@dataclass
class _Lease:
    worker_id: str
    deadline: float
    prompt_ids: list[str]
    latest: float = float("inf")  # heartbeats renew the deadline up to this, never past it
    slot: str = ""  # the lease it backs up (its own id for the first): the slot's first answer counts
    issued: float = 0.0
    renewed: float = 0.0  # the holder's latest heartbeat


@dataclass
class _Round:
    version: int
    opened: float
    pending: deque[str]
    leased: dict[str, _Lease] = field(default_factory=dict)
    rewards: dict[str, float] = field(default_factory=dict)
    answers: dict[str, tuple[str, list[int]]] = field(default_factory=dict)
    workers: set[str] = field(default_factory=set)
    restarts: int = 0
    backups: int = 0  # backup leases issued (`EvalBook.HOLDERS`)
    first_leased: float | None = None  # when its first lease went out
    superseded: dict[str, str] = field(default_factory=dict)  # lease -> its worker, whose slot another answered first


class EvalBook:
    """Invariant of the open round: every prompt is pending, in one slot (leased to 1..HOLDERS
    workers), or answered."""

    HOLDERS = 2  # workers holding one slot at once: the first and one backup (at most twice the work)

    def __init__(self, prompts: list[Prompt], ttl: float, per_lease: int, lifetime: float | None = None):
        if not prompts:
            raise ValueError("the task has no eval prompts")
        self.prompts = {p.id: p for p in prompts}
        self.ttl, self.per_lease = ttl, per_lease
        self.lifetime = lifetime if lifetime is not None else 3 * ttl
        self.round: _Round | None = None
        self.abandoned: _Round | None = None  # the last round nobody alive could finish, until the next opens
        self.finished: _Round | None = None  # the last round completed: its outpaced holders' answers still come
        self.barred: dict[str, None] = {}  # workers that sat on an eval lease to its lifetime: no more eval
        #   leases (the latest `TRACKED`: a week of identities churned through must not grow it)
        self._answer_s: deque[float] = deque(maxlen=64)  # issue -> answer of the run's latest eval leases
        self._ids = itertools.count()

    @property
    def version(self) -> int | None:
        return self.round.version if self.round else None

    def open(self, version: int, now: float) -> None:
        """Start evaluating `version` (a round already running is replaced)."""
        restarts = self.abandoned.restarts + 1 if self.abandoned else 0
        self.round = _Round(version, now, deque(self.prompts), restarts=restarts)
        self.abandoned = None

    def reask(self, result: EvalResult, prompt_ids: list[str], verified: dict[str, float],
              answered_by: set[str], now: float) -> None:
        """Ask `result`'s round again for `prompt_ids` (answers found forged), keeping the
        `verified` scores of the rest, the workers `answered_by` whose answers those are, and the
        round's opening time and restarts: its result then covers every prompt again, and says who
        answered it and how long it took (it said "on 1 worker", the re-asked prompts' one, where
        three had answered)."""
        opened = now if result.opened is None else result.opened
        self.round = _Round(result.version, opened, deque(prompt_ids), rewards=dict(verified), workers=set(answered_by),
                            restarts=result.restarts, first_leased=opened + result.waited)

    def wants_newer(self, worker_version: int, installable: int) -> bool:
        """Does the open round need answers of a version newer than `worker_version`, one the
        worker can install now (at most `installable`)?"""
        r = self.round
        return r is not None and bool(r.pending) and worker_version < r.version <= installable

    def lease(self, worker_id: str, worker_version: int, max_prompts: int, now: float,
              proven: bool = True) -> tuple[str, int, list[Prompt]] | None:
        """An eval lease of the open round for a worker on its version (`proven`: it delivered
        accepted training work), or a backup of an outstanding one once nothing is pending; never
        more than `max_prompts`, what the worker said it can take."""
        r = self.round
        if r is None or worker_version != r.version or worker_id in self.barred or not proven:
            return None
        if any(lease.worker_id == worker_id for lease in r.leased.values()):
            return None  # one at a time
        if r.pending:
            ids, slot = [r.pending.popleft() for _ in range(min(max_prompts, self.per_lease, len(r.pending)))], ""
        elif (backup := self._backup_slot(now, max_prompts)) is not None:
            slot, ids = backup
            r.backups += 1
        else:
            return None
        lease_id = f"E{next(self._ids)}-{secrets.token_hex(4)}"
        r.first_leased = now if r.first_leased is None else r.first_leased
        r.leased[lease_id] = _Lease(worker_id, now + self.ttl, ids, latest=now + self._lifetime(), slot=slot or lease_id,
                                    issued=now, renewed=now)
        return lease_id, r.version, [self.prompts[i] for i in ids]

    def _median_answer_s(self) -> float:
        return sorted(self._answer_s)[len(self._answer_s) // 2] if self._answer_s else 0.0

    def _lifetime(self) -> float:
        """Four times the run's median answer time (at least `ttl`), or `lifetime` before any came back."""
        if not self._answer_s:
            return self.lifetime
        return min(self.lifetime, max(self.ttl, 4 * self._median_answer_s()))

    def _backup_slot(self, now: float, max_prompts: int) -> tuple[str, list[str]] | None:
        """An outstanding slot of at most `max_prompts` prompts, late by the run's median answer
        time, with the fewest holders (below `HOLDERS`), the oldest first: a straggler's, not one
        as young as the asker's own was; its id and prompts (its first lease may have expired
        while a backup holds it)."""
        holders: dict[str, list[_Lease]] = {}
        for lease in self.round.leased.values():
            holders.setdefault(lease.slot, []).append(lease)
        late = now - self._median_answer_s()
        open_slots = [(len(held), issued, slot) for slot, held in holders.items()
                      if len(held) < self.HOLDERS and len(held[0].prompt_ids) <= max_prompts
                      and (issued := min(h.issued for h in held)) <= late]
        if not open_slots:
            return None
        slot = min(open_slots)[2]
        return slot, list(holders[slot][0].prompt_ids)

    def check(self, worker_id: str, lease_id: str, version: int, prompt_ids) -> _Lease:
        """The outstanding eval lease `lease_id` of `worker_id`, answered for exactly its prompts
        at its version; else `Rejected`. Asked before anything is scored: scoring costs the learner."""
        r = self.round
        lease = r.leased.get(lease_id) if r else None
        # A backup's (or its original's) late answer, in the round or after the other's completed it.
        if any(done is not None and done.superseded.get(lease_id) == worker_id for done in (r, self.finished)):
            raise Rejected(409, "answered", f"eval lease {lease_id!r}: another worker answered its prompts first")
        if r is None or lease is None or lease.worker_id != worker_id:
            raise Rejected(409, "unknown-lease", f"eval lease {lease_id[:128]!r} is not outstanding for this worker "
                                                    "(expired, or its round was restarted)")
        if version != r.version:
            raise Rejected(409, "wrong-version", f"eval lease {lease_id!r} evaluates v{r.version}, not v{version}")
        if set(prompt_ids) != set(lease.prompt_ids):
            raise Rejected(422, "wrong-prompts", f"eval lease {lease_id!r} holds {len(lease.prompt_ids)} prompts; "
                                                    "send exactly one reward for each")
        return lease

    def submit(self, worker_id: str, lease_id: str, version: int, rewards: dict[str, float],
               now: float, completions: dict[str, list[int]] | None = None) -> EvalResult | None:
        """Record an eval lease's rewards; the round's result when this completes it."""
        self.check(worker_id, lease_id, version, rewards)
        r = self.round
        bad = [k for k, v in rewards.items() if not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0]
        if bad:
            raise Rejected(422, "bad-reward", f"rewards must be numbers in [0, 1]; got {rewards[bad[0]]!r}")
        slot = r.leased[lease_id].slot
        self._answer_s.append(now - r.leased[lease_id].issued)
        for other in [k for k, held in r.leased.items() if held.slot == slot]:  # the slot is answered
            held = r.leased.pop(other)
            if other != lease_id:
                r.superseded[other] = held.worker_id
        r.rewards.update({k: float(v) for k, v in rewards.items()})
        r.answers.update({k: (worker_id, list(ids)) for k, ids in (completions or {}).items()})
        r.workers.add(worker_id)
        if len(r.rewards) < len(self.prompts):
            return None
        result = EvalResult(r.version, sum(r.rewards.values()) / len(r.rewards), len(r.rewards), now - r.opened,
                            len(r.workers), r.restarts, dict(r.answers), dict(r.rewards), frozenset(r.workers), r.opened,
                            r.backups, max(0.0, (r.first_leased or r.opened) - r.opened))
        self.round, self.finished = None, r
        r.answers, r.rewards = {}, {}  # kept for `superseded` alone; the result holds these
        return result

    def renew(self, worker_id: str, now: float) -> None:
        if self.round:
            for lease in self.round.leased.values():
                if lease.worker_id == worker_id:
                    lease.deadline, lease.renewed = min(now + self.ttl, lease.latest), now

    def expire(self, now: float, live: dict[str, int], newest: int) -> bool:
        """Give expired leases' prompts back (unless a backup holds them); bar the workers that kept
        theirs alive to its lifetime unanswered; abandon the round when no live worker (`live`:
        worker id -> installed version) that may answer holds its version, nothing is leased and
        a newer version exists (returns True when it did)."""
        r = self.round
        if r is None:
            return False
        for lease_id, lease in list(r.leased.items()):
            if lease.deadline < now:
                del r.leased[lease_id]
                if lease.deadline >= lease.latest and lease.renewed >= lease.latest - self.ttl / 2:
                    remember(self.barred, lease.worker_id, None)  # alive, heartbeating to the end, never answered
                if not any(held.slot == lease.slot for held in r.leased.values()):
                    r.pending.extendleft(reversed(lease.prompt_ids))
        holders = [w for w, version in live.items() if version == r.version and w not in self.barred]
        if not holders and not r.leased and newest > r.version:
            self.round, self.abandoned = None, r
            return True
        return False
