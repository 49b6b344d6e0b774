"""The GIL of a process that serves from one event loop while its other threads compute.

The learner's loop answers a thousand workers; beside it, threads decode uploads and recompute
their rewards (`learner.api`'s offload pool) and the trainer's thread runs between torch calls.
When the loop wakes while such a thread is running Python, it waits for the GIL until the
thread is made to drop it: CPython's switch interval, 5 ms by default. Each wait is added to
every request the loop then answers; more uploads (an attacking share of the fleet sends its
bombs and forged groups as uploads) meant more waits, and a longer tail for everyone. At
`LOOP_SWITCH_S` the loop waits at most that long; a thread gives up the GIL ten times as often,
a few microseconds each time.
"""

from __future__ import annotations

import sys

LOOP_SWITCH_S = 0.0005


def favour_the_loop() -> None:
    """From here on a thread holding the GIL hands it to the waiting loop within `LOOP_SWITCH_S`."""
    sys.setswitchinterval(LOOP_SWITCH_S)
