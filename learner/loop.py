"""The training loop, in one sitting.

    begin   publish v0, evaluate it (on workers, or here for tiny models)
    train   for each step: wait for a batch (bounded staleness) -> GRPO update (trainer thread)
            -> publish every I updates -> status line + run log (+ eval) -> checkpoint;
            then the last version's eval
    end     checkpoint, model export, release the follower ranks

Every part it drives was built by the composition root (`learner.main`); torch work runs on
the trainer thread (`learner.driver`), so the event loop stays responsive to workers throughout.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from echo import serving
from learner.accounting import Accounting
from learner.api.leases import LeaseRoom
from learner.api.run import Run
from learner.api.workers import WorkerRegistry
from learner.buffer import AsyncBuffer
from learner.config import LearnerConfig
from learner.driver import TrainerDriver
from learner.evaluation import Evaluation
from learner.ledger import Ledger
from learner.publishing import Publishing
from learner.record import RunRecord


class Loop:
    def __init__(self, cfg: LearnerConfig, run_dir: Path, *, driver: TrainerDriver, buffer: AsyncBuffer, run: Run,
                 ledger: Ledger, leases: LeaseRoom, registry: WorkerRegistry, publishing: Publishing,
                 evaluation: Evaluation, accounting: Accounting, record: RunRecord):
        self.steps, self.publish_every, self.checkpoint_every = cfg.run.steps, cfg.publish_every, cfg.run.checkpoint_every
        self.run_dir, self.driver, self.buffer, self.run, self.ledger = run_dir, driver, buffer, run, ledger
        self.leases, self.registry, self.publishing = leases, registry, publishing
        self.evaluation, self.accounting, self.record = evaluation, accounting, record
        self.stopped = ""  # why the run ended before [run] steps (its budget), else ''

    async def begin(self) -> None:
        await self.publishing.publish()
        await self.evaluation.start(self.driver.version)

    async def train(self, background: list[asyncio.Task]) -> None:
        """Train `[run] steps` updates; `background` (the reaper, watchers) is cancelled at the end."""
        trainer, run, evaluation, record = self.driver, self.run, self.evaluation, self.record
        record.start(trainer.version)
        # Serving from here on: what start-up built (the model, torch, tokenizers: millions of
        # objects) stays out of the cyclic collector, whose full passes over it held the event
        # loop 100-160 ms (measured by `echo-rl bench control-plane`), and every collection
        # comes on a clock, not with allocations (echo.collector); the offload pool and the
        # trainer's thread hand the loop the GIL within 0.5 ms (echo.gil).
        background = [*background, serving.start("echo-learner")]
        try:
            while trainer.updates < self.steps:  # not the version: a resume may skip version numbers
                t0 = time.monotonic()
                try:  # the budget bounds the wait too: a learner idling for rollouts still bills
                    batch = await asyncio.wait_for(self.buffer.get_batch(trainer.version),
                                                   self.accounting.affordable_wait_s())
                except asyncio.TimeoutError:
                    self.stop_for(f"budget: waiting longer for rollouts would leave too little of max_total_dollars "
                                  f"for the next step (${self.accounting.cost.dollars:.4f} spent)")
                    break
                t1 = time.monotonic()
                stats = await trainer.call("step", batch)
                t2 = time.monotonic()
                run.version = trainer.version
                self.ledger.trained(trainer.version, [g.prompt_id for g in batch.groups])
                skipped = [(g := batch.skipped_sample[j], batch.learner_version - g.version, terms)
                           for j, terms in stats.pop("skipped_tokens")]
                claims = stats.pop("claim_checks")
                skipped_claims = [(batch.skipped_sample[j], sums) for j, sums in stats.pop("skipped_claims")]
                self.registry.judge_logprobs(batch.groups, batch.staleness, stats.pop("group_gaps"),
                                             stats.pop("group_tokens"), skipped, claims, stats.pop("claimable"),
                                             skipped_claims)
                groups = {"batch": batch.groups, "skipped": batch.skipped_sample}
                self.registry.judge_repeats([(groups[where][g].worker_id, key) for where, g, key in stats.pop("improbable")])
                checked = [c[1:] for c in claims] + [sums for _, sums in skipped_claims]
                stats["claims_checked"] = len(checked)  # stale groups held to their own version (and μ's gap there)
                stats["claim_gap"] = sum(c[6] for c in checked) / max(1.0, sum(c[7] for c in checked))
                self.leases.stepped()  # room in the buffer, and a new version to judge staleness by
                last = trainer.updates == self.steps
                published = trainer.version % self.publish_every == 0 or last
                if published:
                    await self.publishing.publish()
                    self.leases.published()  # the workers it made too stale hear of its successor now
                step = record.step(trainer.updates, trainer.version, run.published_version, batch, stats,
                                   wait=t1 - t0, train=t2 - t1)
                step.update(self.accounting.step(wait=t1 - t0, train=t2 - t1,
                                                 useful_share=self.buffer.buffer.useful_share))
                accuracy = await evaluation.stepped(trainer.version, published, last)
                if accuracy is not None:
                    step["eval_accuracy"] = accuracy
                record.show(step, evaluation.last)
                if self.checkpoint_every and trainer.updates % self.checkpoint_every == 0 and not last:
                    await self.checkpoint()
                if not last and (why := self.accounting.exhausted()):
                    self.stop_for(why)
                    break
            if not self.stopped:  # a spent budget buys no final eval round
                await evaluation.finish(trainer.version)
        finally:
            record.stop()
            run.finished = True
            self.leases.changed()
            for task in background:
                task.cancel()

    def stop_for(self, why: str) -> None:
        """The budget is spent: end() checkpoints; the scheduler releases every machine now."""
        self.stopped = why
        self.record.display.note(f"stopping: {why}")
        if self.accounting.fleet is not None:
            self.accounting.fleet.release_all(time.monotonic(), why)

    async def end(self) -> None:
        await self.checkpoint()
        await self.driver.call("export", self.run_dir / "model")
        await self.driver.stop()

    async def checkpoint(self) -> None:
        await self.driver.call("save_checkpoint", self.run_dir / "checkpoints", self.evaluation.checkpoint_state())
