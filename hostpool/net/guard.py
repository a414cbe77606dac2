"""The connection guard of hostpool's listeners (HTTP and the share socket).

One policy, whichever protocol: connections are capped below RLIMIT_NOFILE; at the cap,
or when accept() finds no fd, the oldest connection that holds nothing is closed to make
room (a flood of idle connections churns itself, never locks out a legitimate client);
when nothing can be closed, accepting pauses with back-off instead of spinning; every
connection has a deadline; and events about floods are throttled, their number folded in.
"""

from __future__ import annotations

import errno
import resource
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from hostpool.base import events

# accept() or a reply failing for want of fds or kernel memory: make room, or back off
FD_SHORTAGE = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

Connection = TypeVar("Connection")


def connection_cap(most: int, least: int) -> int:
    """A quarter of RLIMIT_NOFILE (the rest stays for the host's own fds, the pools'
    memfds among them), within [least, most]; `most` when the limit is infinite."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return most
    return max(least, min(most, soft // 4))


def oldest_idle(
    connections: Iterable[Connection], idle: Callable[[Connection], bool]
) -> Connection | None:
    """The first of `connections` (given oldest first) for which `idle` holds, else None:
    the one to close to make room."""
    return next((c for c in connections if idle(c)), None)


def past_deadline(
    connections: Iterable[Connection], deadline: Callable[[Connection], float | None], now: float
) -> list[Connection]:
    """The connections whose deadline (None: none) is at or before `now`, as a list that
    survives closing them."""
    return [c for c in connections if (at := deadline(c)) is not None and at <= now]


class Backoff:
    """How long accepting pauses when nothing can be closed: `least` seconds, doubling
    up to `most` while it keeps failing; `reset()` after an accept succeeds."""

    def __init__(self, least: float, most: float) -> None:
        self.least = least
        self.most = most
        self.seconds = 0.0

    def next(self) -> float:
        """The next pause, in seconds."""
        self.seconds = min(self.most, max(self.least, self.seconds * 2))
        return self.seconds

    def reset(self) -> None:
        self.seconds = 0.0


class Throttle:
    """At most one warning event per (event, key) per `interval` seconds; the ones held
    back are counted into the next (its `count` field), or logged with their count once
    the interval has passed: by `flush()`, or by a timer when no one calls it (a flood's
    tail is told even if nothing follows). Safe to call from any thread."""

    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        self._last: dict[tuple[str, object], float] = {}
        self._held: dict[tuple[str, object], tuple[int, dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def warning(self, event: str, key: object, **fields: Any) -> None:
        now = time.monotonic()
        slot = (event, key)
        with self._lock:
            last = self._last.get(slot)
            if last is None or now - last >= self.interval:
                self._last[slot] = now
                folded, _ = self._held.pop(slot, (0, {}))
                count = folded + 1
            else:
                n, _ = self._held.get(slot, (0, {}))
                self._held[slot] = (n + 1, fields)
                self._arm(last + self.interval - now)
                return
        events.warning(event, count=count, **fields)

    def flush(self) -> None:
        """Emit what was held back once its interval has passed (a flood's tail)."""
        now = time.monotonic()
        due = []
        with self._lock:
            for slot, (n, fields) in list(self._held.items()):
                last = self._last.get(slot, 0.0)
                if now - last >= self.interval:
                    del self._held[slot]
                    self._last[slot] = now
                    due.append((slot[0], n, fields))
                else:
                    self._arm(last + self.interval - now)
        for event, n, fields in due:
            events.warning(event, count=n, **fields)

    def _arm(self, delay: float) -> None:
        """A timer that flushes in `delay` seconds, unless one is set (under the lock). A
        timer inherited over fork() is not alive in the child: a new one is set there."""
        if self._timer is not None and self._timer.is_alive():
            return
        self._timer = threading.Timer(max(0.0, delay), self._on_timer)
        self._timer.daemon = True  # never holds the process at exit
        self._timer.start()

    def _on_timer(self) -> None:
        with self._lock:
            self._timer = None
        self.flush()
