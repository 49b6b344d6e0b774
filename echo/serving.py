"""How a process that serves from one event loop starts serving: echo-learner's loop, and the
control-plane bench's stand-in for it, through this one call so the bench measures what the
learner does (a stand-in that drifted from the learner once cost every run a 25-45 ms stall).
"""

from __future__ import annotations

import asyncio

from echo import collector, gil, loopwatch


def start(name: str) -> asyncio.Task:
    """From here on the process serves: start-up's objects frozen and collections on a clock
    (`echo.collector`), the GIL handed to the loop within 0.5 ms (`echo.gil`), every callback
    judged if `$ECHO_SLOW_CALLBACK_MS` asks (`echo.loopwatch`). Returns the collections' task:
    cancel it when serving ends."""
    collector.serve()
    gil.favour_the_loop()
    loopwatch.watch(name)
    return asyncio.create_task(collector.collections())
