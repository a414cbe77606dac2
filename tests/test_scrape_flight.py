"""metrics/flight: concurrent scrapes share one reading (its result or its error), and the
cyclic garbage collector is paused only while a reading runs."""

from __future__ import annotations

import gc
import sys
import threading

import pytest

from hostpool.metrics.flight import SharedFlight, gc_paused
from tests.waiting import wait_for


def _waiting_in_run(thread: threading.Thread) -> bool:
    """Whether `thread` is blocked in a threading wait called from SharedFlight.run."""
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None or frame.f_code.co_filename != threading.__file__:
        return False
    while frame is not None:
        if frame.f_code.co_name == "run" and frame.f_code.co_filename.endswith("flight.py"):
            return True
        frame = frame.f_back
    return False


def test_callers_during_a_reading_share_it_and_the_next_reads_afresh() -> None:
    flight: SharedFlight[list[int]] = SharedFlight()
    entered, release = threading.Event(), threading.Event()
    reads: list[int] = []

    def read() -> list[int]:
        reads.append(len(reads))
        entered.set()
        release.wait(timeout=60)
        return [len(reads)]

    results: list[list[int]] = []
    waiting = threading.Barrier(4)  # three followers and this thread

    def follower() -> None:
        waiting.wait(timeout=60)
        results.append(flight.run(read))

    leader = threading.Thread(target=lambda: results.append(flight.run(read)))
    leader.start()
    assert entered.wait(timeout=60)
    followers = [threading.Thread(target=follower) for _ in range(3)]
    for t in followers:
        t.start()
    waiting.wait(timeout=60)
    # let the reading finish only once every follower waits on it inside run()
    wait_for(lambda: all(_waiting_in_run(t) for t in followers), "followers waiting")
    release.set()
    for t in [leader, *followers]:
        t.join(timeout=60)
    assert len(results) == 4
    assert all(r is results[0] for r in results)  # one reading's very result
    assert reads == [0]
    assert flight.run(lambda: [42]) == [42]  # the next scrape reads afresh


def test_an_error_reaches_every_caller_and_the_next_reading_is_fresh() -> None:
    flight: SharedFlight[int] = SharedFlight()

    def fail() -> int:
        raise OSError("proc went away")

    with pytest.raises(OSError, match="proc went away"):
        flight.run(fail)
    assert flight.run(lambda: 7) == 7


def test_gc_is_paused_during_a_reading_and_restored_after() -> None:
    assert gc.isenabled()
    seen: list[bool] = []
    flight: SharedFlight[int] = SharedFlight()
    assert flight.run(lambda: seen.append(gc.isenabled()) or 1) == 1
    assert seen == [False]
    assert gc.isenabled()
    with gc_paused():
        with gc_paused():  # nested (another collector's reading in another thread)
            pass
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # left as it was found
    finally:
        gc.enable()
