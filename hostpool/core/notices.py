"""What finalizers tell the ledger. They run inside cyclic GC, on any thread, possibly
while that thread holds the ledger lock: so they take no lock and hold no reference to a
region, they append a notice to a deque that the ledger drains under its lock. Each
notice carries the ledger's fork generation; a forked child ignores its parent's."""

from __future__ import annotations

import collections
from collections.abc import Iterable

from hostpool.words import EndCause

# (generation, region id, how, reused fd, still mapped)
Gone = tuple[int, int, EndCause, int | None, bool]


def notify_gone(
    queue: collections.deque[Gone],
    generation: int,
    rid: int,
    how: EndCause = "collected",
    reused_fd: int | None = None,
    still_mapped: bool = False,
) -> None:
    """The memory layer's `on_unmapped` (bound to a queue and a generation): region `rid`
    ended (`how`), the fd number it left open because it names another file now
    (`reused_fd`), and whether views still map it (`still_mapped`)."""
    queue.append((generation, rid, how, reused_fd, still_mapped))


def notify_dropped(
    queue: collections.deque[tuple[int, frozenset[int]]],
    generation: int,
    owners: Iterable[int],
) -> None:
    """A manager's finalizer: its allocators' owner ids, collected without close()."""
    queue.append((generation, frozenset(owners)))
