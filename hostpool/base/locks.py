"""Locks that survive fork: a child gets a fresh, unlocked one.

A child forked while another parent thread held a lock inherits it held, with no thread
left to release it: the child's next allocation would hang. Every lock hostpool owns is a
`ForkSafeLock`, replaced in the child by its fork hook (`hostpool.base.fork`), the first to run.
"""

from __future__ import annotations

import threading
import weakref

from hostpool.base import fork

_every: weakref.WeakSet[ForkSafeLock] = weakref.WeakSet()


class ForkSafeLock:
    """A `threading.Lock` (context manager, acquire/release) that a forked child re-creates."""

    __slots__ = ("__weakref__", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        _every.add(self)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self._lock.release()  # whatever the block raised, or nothing


def _after_fork_in_child() -> None:
    # Only the forking thread exists now: nothing can be inside any of these locks.
    for lock in list(_every):
        lock._lock = threading.Lock()


fork.on_fork(__name__, stage=fork.LOCKS, after_in_child=_after_fork_in_child)
