"""The loop's collections, timed: those of its own thread only."""

import gc
import threading

from echo.collector import Pauses


def test_pauses_count_the_collections_of_their_own_thread_and_no_other():
    pauses = Pauses()
    try:
        gc.collect(0)
        gc.collect(1)
        other = threading.Thread(target=gc.collect)
        other.start()
        other.join()
        s = pauses.summary()
    finally:
        pauses.stop()
    assert s["collections"] == 2, s  # the other thread's full pass is not the loop's
    assert 0 < pauses.longest_s <= pauses.total_s
    gc.collect()
    assert pauses.summary()["collections"] == 2  # stopped: no longer counting
