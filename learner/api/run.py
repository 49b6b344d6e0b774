"""`Run`: the few facts about the run that many rooms read.

The loop writes `version`, `finished`; publishing writes `announcement` (and adds to `blobs`);
the eval part writes `training_done`. Rooms only read them. Mutated on the event loop only.
"""

from __future__ import annotations

from dataclasses import dataclass

from broadcast.star import BlobStore


@dataclass
class Run:
    blobs: BlobStore  # published snapshots (the star store also serves /v1/snapshots)
    version: int = 0  # updates the trainer applied: staleness is judged against it
    announcement: dict | None = None  # the newest version as workers are told of it
    # Chain mode: the workers the announced version is pushed to. Anyone else (idle at its
    # publication, joined after it, no relay) waits for no push of it: `on_route` tells it so.
    routed: frozenset[str] | None = None
    training_done: bool = False  # only eval leases go out (the last version's round)
    finished: bool = False  # workers are told to stop

    @property
    def published_version(self) -> int:
        latest = self.blobs.latest
        return latest.version if latest else -1

    def on_route(self, worker_id: str) -> bool | None:
        """Will the announced version be pushed to `worker_id`? None: nothing is pushed (star)."""
        return None if self.routed is None else worker_id in self.routed

    def installable(self, claim: int) -> int:
        """A worker's claimed installed version as far as it can be true: at most the newest
        published (nobody installs a version before it is published; a claim beyond it was shown in
        /v1/status and read by the broadcast planner). Clamped, not refused: a learner restarted
        at the same URL answers its workers before it published anything (a resumed run then goes
        on past the newest version ever published), and an honest worker must keep working."""
        return min(claim, self.published_version)
