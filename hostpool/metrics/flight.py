"""What the /proc-reading collectors share: one reading for concurrent scrapes, and the
cyclic garbage collector paused while one runs.

`SharedFlight.run(read)`: scrapes that arrive while a reading is under way wait for it
and share its result (or its exception), so concurrent scrapers (an HA Prometheus pair,
a flood) cost one pass; the next scrape after it ends reads afresh.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")


class _Flight(Generic[T]):
    """One reading that concurrent scrapes share."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None


class SharedFlight(Generic[T]):
    """At most one `read` at a time; callers that arrive meanwhile get its outcome."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flight: _Flight[T] | None = None

    def run(self, read: Callable[[], T]) -> T:
        """`read()`'s result, from this call's reading or from the one under way; the
        reading runs with the cyclic garbage collector paused."""
        with self._lock:
            flight, leader = self._flight, self._flight is None
            if flight is None:
                flight = self._flight = _Flight()
        if not leader:  # a pass is under way: its result is as fresh as ours would be
            flight.done.wait()
        else:
            try:
                with gc_paused():
                    flight.result = read()
            except BaseException as exc:
                flight.error = exc
            finally:
                with self._lock:
                    self._flight = None
                flight.done.set()
        if flight.error is not None:
            raise flight.error
        assert flight.result is not None
        return flight.result


_gc_lock = threading.Lock()
_gc_pausers = 0
_gc_was_enabled = False


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off while the block runs (in any thread), back on when
    the last such block ends if it was on before the first.

    A scrape allocates an object or more per mapping and fd it reads and frees them all
    by reference counting (it makes no cycles): the collector's passes over them, one
    per few hundred allocations, find nothing to free.
    """
    global _gc_pausers, _gc_was_enabled
    with _gc_lock:
        if _gc_pausers == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pausers += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_was_enabled:
                gc.enable()
