"""Catch blocking work on an event loop: asyncio's slow-callback detection, switched on by
`$ECHO_SLOW_CALLBACK_MS` (the integration tests set 100).

Every callback or task step that holds the loop longer than the limit is reported on stderr as
one line starting with `SLOW CALLBACK`, naming the coroutine and its duration; the tests fail
on any such line. Start-up (imports, loading a model) runs before `watch()` is called, so only
the serving phase is judged.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys

ENV = "ECHO_SLOW_CALLBACK_MS"
MARK = "SLOW CALLBACK"


class _Report(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "took" in text and "seconds" in text:  # asyncio: "Executing <Handle ...> took 0.150 seconds"
            print(f"{MARK}: {text}", file=sys.stderr, flush=True)


def watch(name: str) -> float | None:
    """Judge the running loop from now on, if `$ECHO_SLOW_CALLBACK_MS` asks; returns the limit (s)."""
    ms = os.environ.get(ENV)
    if not ms:
        return None
    loop = asyncio.get_running_loop()
    loop.slow_callback_duration = float(ms) / 1e3
    loop.set_debug(True)
    logger = logging.getLogger("asyncio")
    if not any(isinstance(h, _Report) for h in logger.handlers):
        logger.addHandler(_Report())
        logger.setLevel(logging.WARNING)
    print(f"{name}: event-loop callbacks over {ms} ms are reported ({ENV})", file=sys.stderr, flush=True)
    return loop.slow_callback_duration
