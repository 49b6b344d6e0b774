"""Prompt leases: which worker is generating which prompts, until when.

A worker leases a few prompts, generates a group for each and submits them. A lease lives
`ttl` seconds and every heartbeat of its worker renews it; when a worker goes silent its
lease expires and the unfinished prompts go to the front of the queue, so nothing is lost.

A prompt whose group was accepted but then dropped by the buffer (overflow, or staler than
`S`) is `recycle`d: queued again like an expired one, so every prompt is eventually trained.

Plain logic with an injectable clock; the server calls `expire()` periodically.
Invariant: issued = completed + reissued + outstanding (prompt-issues).
"""

from __future__ import annotations

import itertools
import secrets
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from echo.tasks import Prompt


class UnknownLease(KeyError):
    """The lease or the prompt in it is not outstanding (expired, finished, or never issued)."""


@dataclass
class Lease:
    id: str
    worker_id: str
    deadline: float
    prompts: dict[str, Prompt] = field(default_factory=dict)  # still outstanding


@dataclass
class LeaseStats:
    issued: int = 0  # prompt-issues, counting re-issues
    completed: int = 0
    expired_prompts: int = 0
    expired_leases: int = 0
    reissued: int = 0  # prompts queued again (expired leases and refused stale groups)
    dropped_reissued: int = 0  # completed prompts queued again because the buffer dropped their group


class LeaseBook:
    def __init__(self, prompts: Iterator[Prompt], ttl: float, max_outstanding: int):
        self._fresh = prompts
        self._retry: deque[Prompt] = deque()  # re-issued first: oldest work is finished first
        self._leases: dict[str, Lease] = {}
        self._ids = itertools.count()
        self.ttl = ttl
        self.max_outstanding = max_outstanding
        self.stats = LeaseStats()

    @property
    def outstanding(self) -> int:
        return sum(len(lease.prompts) for lease in self._leases.values())

    def outstanding_by_worker(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for lease in self._leases.values():
            counts[lease.worker_id] = counts.get(lease.worker_id, 0) + len(lease.prompts)
        return counts

    def lease(self, worker_id: str, max_prompts: int, now: float) -> Lease | None:
        room = min(max_prompts, self.max_outstanding - self.outstanding)
        if room <= 0:
            return None
        lease = Lease(f"L{next(self._ids)}-{secrets.token_hex(4)}", worker_id, now + self.ttl)
        for _ in range(room):
            prompt = self._retry.popleft() if self._retry else next(self._fresh)
            lease.prompts[prompt.id] = prompt
        self._leases[lease.id] = lease
        self.stats.issued += len(lease.prompts)
        return lease

    def prompt_of(self, lease_id: str, prompt_id: str) -> Prompt:
        lease = self._leases.get(lease_id)
        if lease is None or prompt_id not in lease.prompts:
            raise UnknownLease(f"lease {lease_id!r} has no outstanding prompt {prompt_id!r} (expired or already submitted)")
        return lease.prompts[prompt_id]

    def complete(self, lease_id: str, prompt_id: str) -> Prompt:
        prompt = self.prompt_of(lease_id, prompt_id)
        lease = self._leases[lease_id]
        del lease.prompts[prompt_id]
        if not lease.prompts:
            del self._leases[lease_id]
        self.stats.completed += 1
        return prompt

    def give_back(self, lease_id: str, prompt_id: str) -> None:
        """The prompt's group was refused (too stale): queue the prompt for re-issue now."""
        prompt = self.prompt_of(lease_id, prompt_id)
        lease = self._leases[lease_id]
        del lease.prompts[prompt_id]
        if not lease.prompts:
            del self._leases[lease_id]
        self._retry.append(prompt)
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
        del self._leases[lease_id]
        self._retry.extend(lease.prompts.values())
        self.stats.reissued += len(lease.prompts)
        return len(lease.prompts)

    def renew(self, worker_id: str, now: float) -> None:
        for lease in self._leases.values():
            if lease.worker_id == worker_id:
                lease.deadline = now + self.ttl

    def expire(self, now: float) -> list[Lease]:
        """Drop leases past their deadline and queue their prompts for re-issue."""
        dead = [lease for lease in self._leases.values() if lease.deadline < now]
        for lease in dead:
            self._drop(lease)
        return dead

    def release_worker(self, worker_id: str) -> list[Lease]:
        """A worker left or was declared dead: re-issue everything it held."""
        dead = [lease for lease in self._leases.values() if lease.worker_id == worker_id]
        for lease in dead:
            self._drop(lease)
        return dead

    def _drop(self, lease: Lease) -> None:
        del self._leases[lease.id]
        self._retry.extend(lease.prompts.values())
        self.stats.expired_leases += 1
        self.stats.expired_prompts += len(lease.prompts)
        self.stats.reissued += len(lease.prompts)
