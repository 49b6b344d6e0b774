"""`TrainerDriver`: the trainer behind one thread, so the event loop stays responsive to workers.

One thread runs every trainer call, in order (collectives must not interleave), with the rank's
CUDA device current (a fresh thread would start on cuda:0). Calls go through
`learner.train.dist.Lockstep`, so ranks 1..N-1 replay each one.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from learner.train.dist import Lockstep, World


class TrainerDriver:
    def __init__(self, world: World):
        self.world = world
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="trainer", initializer=world.use_device)
        self.lockstep: Lockstep | None = None

    async def run(self, fn, *args):
        """`fn(*args)` on the trainer thread (this rank only)."""
        return await asyncio.get_running_loop().run_in_executor(self.thread, fn, *args)

    async def build(self, cfg, checkpoint: Path | None):
        """Build the trainer on its thread (resumed from `checkpoint`, if any)."""
        from learner.train.trainer import Trainer

        trainer = await self.run(Trainer, cfg, self.world, checkpoint)
        self.lockstep = Lockstep(trainer, self.world)
        return trainer

    @property
    def trainer(self):
        return self.lockstep.target

    @property
    def version(self) -> int:
        return self.lockstep.target.version

    @property
    def updates(self) -> int:
        """Updates applied (a resumed run's versions may skip numbers; this count does not)."""
        return self.lockstep.target.updates

    async def call(self, method: str, *args):
        """A trainer method every rank runs (`step`, `snapshot`, `save_checkpoint`, ...)."""
        return await self.run(self.lockstep.call, method, *args)

    async def stop(self) -> None:
        """Release the follower ranks; no trainer call after this."""
        await self.run(self.lockstep.stop)
        self.thread.shutdown()
