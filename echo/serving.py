"""How a process that serves from one event loop runs and starts serving: echo-learner's loop,
and the control-plane bench's stand-in for it, through these calls so the bench measures what
the learner does (a stand-in that drifted from the learner once cost every run a 25-45 ms stall).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine

from echo import collector, gil, loopwatch


def run(main: Coroutine):
    """`asyncio.run(main)` on uvloop's event loop where it is installed: its transports are
    compiled, and asyncio's own leave every closed connection in a reference cycle for the
    collector (7 objects each: a loop answering a wrong credential from a fresh address per
    request paid ~14,000 objects per 2,000 requests, none with uvloop) and cost more (such a
    401: 0.64 ms of learner CPU, 0.52 on uvloop). asyncio's own loop where `$ECHO_SLOW_CALLBACK_MS` asks
    `echo.loopwatch` to judge each callback: it names them by wrapping asyncio's `Handle`, which
    uvloop's compiled loop never calls."""
    if not os.environ.get(loopwatch.ENV):
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(main)
    return asyncio.run(main)


def start(name: str) -> asyncio.Task:
    """From here on the process serves: start-up's objects frozen and collections on a clock
    (`echo.collector`), the GIL handed to the loop within 0.5 ms (`echo.gil`), every callback
    judged if `$ECHO_SLOW_CALLBACK_MS` asks (`echo.loopwatch`). Returns the collections' task:
    cancel it when serving ends."""
    collector.serve()
    gil.favour_the_loop()
    loopwatch.watch(name)
    return asyncio.create_task(collector.collections())
