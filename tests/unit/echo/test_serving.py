"""Starting to serve is one call, made by echo-learner's loop and by the control-plane bench's
stand-in alike: collections on a clock, the GIL handed to the loop, until the task ends."""

import asyncio
import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from echo import collector, gil, serving

ROOT = Path(__file__).resolve().parents[3]


def test_serving_puts_collections_on_the_clock_and_favours_the_loop_until_its_task_ends():
    async def scenario() -> None:
        threshold, interval = gc.get_threshold(), sys.getswitchinterval()
        try:
            task = serving.start("test")
            assert not gc.isenabled() and gc.get_threshold()[2] == collector.NEVER
            assert sys.getswitchinterval() == gil.LOOP_SWITCH_S
            await asyncio.sleep(0)
            assert not task.done()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert gc.isenabled()  # serving ended: collections come with allocation again
        finally:
            gc.set_threshold(*threshold)
            gc.enable()
            gc.unfreeze()
            sys.setswitchinterval(interval)

    asyncio.run(scenario())


def test_serving_runs_on_uvloop_unless_loopwatch_must_name_callbacks(monkeypatch):
    import uvloop

    from echo import loopwatch

    async def loop_type() -> type:
        return type(asyncio.get_running_loop())

    monkeypatch.delenv(loopwatch.ENV, raising=False)
    assert serving.run(loop_type()) is uvloop.Loop
    monkeypatch.setenv(loopwatch.ENV, "100")  # loopwatch wraps asyncio's Handle: asyncio's own loop
    assert issubclass(serving.run(loop_type()), asyncio.BaseEventLoop)


STOPPABLE = """
import asyncio, sys, time
from echo import serving

async def busy():  # Python bytecode all the time: where a raise from a signal.signal handler lands
    while True:
        t = time.perf_counter()
        while time.perf_counter() - t < 0.05:
            pass
        await asyncio.sleep(0)

async def main():
    spinner = asyncio.create_task(busy())
    print("serving", flush=True)
    try:
        await asyncio.sleep(3600)
    finally:
        await asyncio.sleep(0.05)  # a stop's cleanup awaits (machines released, workers told)
        print("cleaned up", flush=True)

try:
    serving.run(main())
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(130)
"""


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_served_coroutine_through_its_finally_without_a_traceback(loop, sig, monkeypatch):
    """Ctrl-C and SIGTERM cancel what `serving.run` serves, wherever the main thread is: a
    KeyboardInterrupt raised by a `signal.signal` handler landed in an aiohttp request's task
    (a traceback) or inside uvloop (a learner that served on past 30 s)."""
    from echo import loopwatch

    env = {k: v for k, v in os.environ.items() if k != loopwatch.ENV}
    if loop == "asyncio":
        env[loopwatch.ENV] = "100000"
    p = subprocess.Popen([sys.executable, "-c", STOPPABLE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, cwd=ROOT)
    assert p.stdout.readline() == "serving\n"
    time.sleep(0.3)
    p.send_signal(sig)
    out, err = p.communicate(timeout=20)
    assert p.returncode == 130 and out == "cleaned up\ninterrupted\n", (out, err)
    assert "Traceback" not in err, err


def test_a_second_signal_ends_a_stop_that_hangs():
    """The first signal's cleanup may hang (a provider that never answers): a second Ctrl-C ends
    the process anyway."""
    hanging = STOPPABLE.replace("await asyncio.sleep(0.05)  # a stop's", "await asyncio.sleep(3600)  # a stop's")
    p = subprocess.Popen([sys.executable, "-c", hanging], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=ROOT)
    assert p.stdout.readline() == "serving\n"
    time.sleep(0.3)
    p.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert p.poll() is None  # cleaning up, as long as that takes
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=20)
    assert p.returncode == 130 and out.endswith("interrupted\n"), (out, err)
