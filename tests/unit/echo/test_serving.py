"""Starting to serve is one call, made by echo-learner's loop and by the control-plane bench's
stand-in alike: collections on a clock, the GIL handed to the loop, until the task ends."""

import asyncio
import gc
import sys

from echo import collector, gil, serving


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
