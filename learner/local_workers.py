"""Local worker processes (`[workers] spawn = N`): the demo's fleet on this machine.

Each is `python -m worker.main join URL` with its own name and seed, logging to
`<run dir>/workers/local-<i>.log`. The learner says when one dies, and at the end keeps
serving until every live worker was told the run finished before it terminates stragglers.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from echo.procs import die_with_parent
from learner.api.workers import WorkerRegistry
from learner.config import WorkersSection


class LocalWorkers:
    def __init__(self, section: WorkersSection, log_dir: Path, token: str, seed: int):
        self.section, self.log_dir, self.token, self.seed = section, log_dir, token, seed
        self.procs: list[subprocess.Popen] = []

    def spawn(self, url: str) -> None:
        w = self.section
        self.log_dir.mkdir(exist_ok=True)
        for i in range(w.spawn):
            # The token in the environment, not the command line, which any local user's `ps` reads.
            cmd = [w.python or sys.executable, "-m", "worker.main", "join", url,
                   "--config", str(w.config), "--worker.name", f"local-{i}",
                   "--worker.seed", str(self.seed * 100 + i), *w.overrides]
            out = open(self.log_dir / f"local-{i}.log", "w")
            self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent(),
                                               env={**os.environ, "PYTHONUNBUFFERED": "1", "ECHO_TOKEN": self.token}))

    async def watch(self) -> None:
        """Say so when a spawned worker dies, with where to look."""
        reported: set[int] = set()
        while True:
            await asyncio.sleep(1.0)
            for i, p in enumerate(self.procs):
                if p.poll() not in (None, 0) and i not in reported:
                    reported.add(i)
                    print(f"echo-learner: local worker {i} exited with code {p.returncode}; "
                          f"see {self.log_dir / f'local-{i}.log'}", file=sys.stderr)

    async def stop(self, registry: WorkerRegistry, grace: float) -> None:
        """Keep serving until every live worker was told the run finished (410 or heartbeat), then
        terminate spawned stragglers."""
        deadline = time.monotonic() + grace

        def pending() -> bool:
            untold = any(not w.told_finished for w in registry.alive(time.monotonic()))
            return untold or any(p.poll() is None for p in self.procs)

        while pending() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

        def reap() -> None:  # waits on processes: a thread's job, not the event loop's
            for p in self.procs:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()

        await asyncio.to_thread(reap)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
