"""Peers per pool, as every share server of the process counts them, for
`hostpool_attached_clients`. Servers register a bound method, held weakly: a dropped
server drops out."""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable
from typing import Any

from hostpool.base.locks import ForkSafeLock

Counts = Callable[[], dict[str, int]]

# ledger -> the attached_counts methods of the share servers of its pools
_sources: weakref.WeakKeyDictionary[Any, list[weakref.WeakMethod[Counts]]] = (
    weakref.WeakKeyDictionary()
)
_lock = ForkSafeLock()


def add_source(ledger: Any, attached_counts: Counts) -> None:
    """Count the peers `attached_counts()` reports (per pool) among `ledger`'s."""
    with _lock:
        live = [r for r in _sources.get(ledger, []) if r() is not None]
        _sources[ledger] = [*live, weakref.WeakMethod(attached_counts)]


def remove_source(ledger: Any, attached_counts: Counts) -> None:
    """Forget a source added with `add_source`; no error if it was not."""
    with _lock:
        _sources[ledger] = [
            r for r in _sources.get(ledger, []) if r() is not None and r() != attached_counts
        ]


def attached_clients(ledger: Any) -> dict[str, int]:
    """Peers per pool of `ledger`, summed over every live share server."""
    with _lock:
        sources = [m for r in _sources.get(ledger, []) if (m := r()) is not None]
    out: collections.Counter[str] = collections.Counter()
    for source in sources:  # outside the lock: a server takes its own
        out.update(source())
    return dict(out)
