"""Catch blocking work on an event loop, switched on by `$ECHO_SLOW_CALLBACK_MS` (the
integration tests set 100).

Every callback or task step that holds the loop longer than the limit is reported on stderr,
as asyncio's debug mode would, with one correction: asyncio measures wall time, and on two
shared cores a callback doing 1 ms of work is sometimes left waiting 200 ms on the run queue
while other processes run. That is the machine, not the code. The kernel counts that wait
(`/proc/.../schedstat`, run delay), so the time a callback held the loop is its wall time minus
its run-queue wait: computing, blocking in a system call, or waiting for the GIL all count.
Over the limit it is marked `SLOW CALLBACK`, the line the tests fail on; a callback slow only
because it was descheduled is reported as `preempted`.

Garbage collections over the limit are reported the same way, by generation.

Start-up (imports, loading a model) runs before `watch()` is called, so only the serving phase
is judged.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import time

ENV = "ECHO_SLOW_CALLBACK_MS"
MARK = "SLOW CALLBACK"


def watch(name: str) -> float | None:
    """Judge every event-loop callback of this process from now on, if `$ECHO_SLOW_CALLBACK_MS`
    asks; returns the limit in seconds."""
    ms = os.environ.get(ENV)
    if not ms:
        return None
    limit = float(ms) / 1e3
    handle = asyncio.events.Handle
    if getattr(handle._run, "_watched", False):
        return limit
    run = handle._run
    sched = _run_queue_clock()

    watched = asyncio.get_running_loop()  # not the private loops of helper threads

    def timed_run(self) -> None:
        if self._loop is not watched:
            return run(self)
        wall, waited = time.perf_counter(), sched()
        run(self)
        wall = time.perf_counter() - wall
        if wall >= limit:
            held = wall - (sched() - waited)
            kind = MARK if held >= limit else "preempted"
            print(f"{kind}: {name}: {_describe(self):.300} took {wall * 1e3:.0f} ms, {held * 1e3:.0f} ms of it holding the loop",
                  file=sys.stderr, flush=True)

    timed_run._watched = True
    handle._run = timed_run
    gc.callbacks.append(_collections_over(limit, name))
    print(f"{name}: event-loop callbacks over {ms} ms are reported ({ENV})", file=sys.stderr, flush=True)
    return limit


def _collections_over(limit: float, name: str):
    """A `gc.callbacks` entry reporting each garbage collection that held the process over
    `limit` (a full collection walks every live object: it names itself, not the callback it
    interrupted)."""
    started = [0.0]

    def timed(phase: str, info: dict) -> None:
        if sys.is_finalizing():  # the interpreter's last full pass at exit: no loop left to hold
            return
        if phase == "start":
            started[0] = time.perf_counter()
        elif (took := time.perf_counter() - started[0]) >= limit:
            print(f"{MARK}: {name}: garbage collection of generation {info['generation']} took {took * 1e3:.0f} ms "
                  f"({info['collected']} collected, {len(gc.get_objects(info['generation']))} objects tracked there)",
                  file=sys.stderr, flush=True)

    return timed


def _run_queue_clock():
    """Seconds this thread has spent runnable but not running (0 where the kernel does not say)."""
    try:
        fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
    except OSError:
        return lambda: 0.0
    return lambda: int(os.pread(fd, 128, 0).split()[1]) / 1e9


def _describe(handle) -> str:
    """The task a step belongs to (its coroutine and where it waits), else the handle."""
    task = getattr(getattr(handle, "_callback", None), "__self__", None)
    return repr(task) if isinstance(task, asyncio.Task) else repr(handle)
