"""A loop sharing its process with a thread that computes waits for the GIL: at most CPython's
switch interval, which `favour_the_loop` shortens."""

import asyncio
import statistics
import sys
import threading
import time

from echo import gil


def _loop_lag_beside_a_busy_thread() -> float:
    """Median lateness of a 2 ms sleep while another thread runs pure Python."""
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    async def lags() -> float:
        late = []
        for _ in range(40):
            t = time.perf_counter()
            await asyncio.sleep(0.002)
            late.append(time.perf_counter() - t - 0.002)
        return statistics.median(late)

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        return asyncio.run(lags())
    finally:
        stop.set()
        thread.join()


def test_the_loop_gets_the_gil_back_from_a_computing_thread_ten_times_sooner():
    default = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)  # CPython's default
        before = _loop_lag_beside_a_busy_thread()
        gil.favour_the_loop()
        after = _loop_lag_beside_a_busy_thread()
    finally:
        sys.setswitchinterval(default)
    assert before > 0.003, before  # the wait this is about: most of a 5 ms interval
    assert after < before / 3, (before, after)
