"""How a process that serves from one event loop runs and starts serving: echo-learner's loop,
and the control-plane bench's stand-in for it, through these calls so the bench measures what
the learner does (a stand-in that drifted from the learner once cost every run a 25-45 ms stall).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Coroutine

from echo import collector, gil, loopwatch


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def run(main: Coroutine):
    """`asyncio.run(main)` on uvloop's event loop where it is installed: its transports are
    compiled, and asyncio's own leave every closed connection in a reference cycle for the
    collector (7 objects each: a loop answering a wrong credential from a fresh address per
    request paid ~14,000 objects per 2,000 requests, none with uvloop) and cost more (such a
    401: 0.64 ms of learner CPU, 0.52 on uvloop). asyncio's own loop where `$ECHO_SLOW_CALLBACK_MS` asks
    `echo.loopwatch` to judge each callback: it names them by wrapping asyncio's `Handle`, which
    uvloop's compiled loop never calls.

    Ctrl-C or SIGTERM stops `main` the same way (`until_stopped`): `run` raises KeyboardInterrupt."""
    if not os.environ.get(loopwatch.ENV):
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return _stoppable(uvloop.run, main)
    return _stoppable(asyncio.run, main)


def _stoppable(run_loop, main: Coroutine):
    stops: list[int] = []
    try:
        return run_loop(until_stopped(main, stops))
    except asyncio.CancelledError:
        if stops:
            raise KeyboardInterrupt from None
        raise


async def until_stopped(main: Coroutine, stops: list[int]):
    """Await `main`; the first Ctrl-C or SIGTERM cancels it, so its `finally` blocks run with
    their awaits (rented machines released, workers told) and the caller sees the signal in
    `stops`. A second raises KeyboardInterrupt on the loop, for a stop that hangs, and gives the
    signals their default actions back. The signals come to the loop as callbacks: raised from a
    `signal.signal` handler, KeyboardInterrupt lands wherever the main thread is, in an aiohttp
    request's task (a traceback, the run going on) or inside uvloop, which logs it and serves on
    (a SIGTERM'd learner served on past 30 s)."""
    if threading.current_thread() is not threading.main_thread():
        return await main
    loop, task = asyncio.get_running_loop(), asyncio.current_task()

    def stop(signum: int) -> None:
        stops.append(signum)
        if len(stops) == 1:
            task.cancel()
            return
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
        raise KeyboardInterrupt

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop, sig)
    try:
        return await main
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)


def start(name: str) -> asyncio.Task:
    """From here on the process serves: start-up's objects frozen and collections on a clock
    (`echo.collector`), the GIL handed to the loop within 0.5 ms (`echo.gil`), every callback
    judged if `$ECHO_SLOW_CALLBACK_MS` asks (`echo.loopwatch`). Returns the collections' task:
    cancel it when serving ends."""
    collector.serve()
    gil.favour_the_loop()
    loopwatch.watch(name)
    return asyncio.create_task(collector.collections())
