"""Publishing a version: the trainer's snapshot, recorded and handed to the publisher.

Each publication is written to the custody ledger (a resumed run never reuses a version), timed
for T_bcast (`learner.accounting`), pushed to the active workers (`learner.publisher`), and its
announcement becomes what every reply tells workers of (`Run.announcement`).
"""

from __future__ import annotations

import time

from learner.accounting import Accounting
from learner.api.run import Run
from learner.api.workers import WorkerRegistry
from learner.driver import TrainerDriver
from learner.ledger import Ledger
from learner.metrics import LearnerMetrics


class Publishing:
    def __init__(self, publisher, *, driver: TrainerDriver, run: Run, registry: WorkerRegistry, ledger: Ledger,
                 accounting: Accounting, metrics: LearnerMetrics):
        self.publisher, self.driver, self.run, self.registry = publisher, driver, run, registry
        self.ledger, self.accounting, self.metrics = ledger, accounting, metrics

    async def publish(self) -> int:
        """Publish the trainer's current version; returns it."""
        blob = await self.driver.call("snapshot")
        version = self.driver.version
        self.accounting.published(version)
        self.ledger.published(version)
        workers = self.registry.active(time.monotonic())
        announcement = await self.publisher.publish(version, blob, workers)
        self.run.announcement, self.run.routed = announcement, getattr(self.publisher, "routed", None)
        self.metrics.published.set(version)
        return version
