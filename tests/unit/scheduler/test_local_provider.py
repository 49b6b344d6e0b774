"""The local provider's workers end with the learner that launched them, however it ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time


def test_a_local_worker_dies_with_a_learner_killed_with_sigkill(tmp_path):
    """`kill -9` of the demo learner left its four workers running, retrying forever; after
    `--resume` they and the new ones took each other's identities (a new user, 2026-11-28). The
    `--workers.spawn` path asked the kernel to end them; the scheduler's local provider did not."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexec sleep 60\n")  # stands in for the interpreter running the worker
    fake.chmod(0o755)
    learner = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from pathlib import Path
        from scheduler.providers import LocalProvider, Machine
        p = LocalProvider("http://127.0.0.1:9", "key", Path("w.toml"), Path({str(tmp_path)!r}), [], python={str(fake)!r})
        p.launch(Machine("cpu-a-0", "cpu", 0.1, 1.0))
        print(p.procs["cpu-a-0"].pid, flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    worker = int(learner.stdout.readline())
    os.kill(learner.pid, signal.SIGKILL)
    learner.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(worker, signal.SIGKILL)
    raise AssertionError("the worker outlived its learner")
