"""The ledger of leases: who holds which part of which pool, and what was adopted there.

The region ledger (`core.ledger`) counts regions; this is its neighbour for the pools a
broker lends. Each `PoolManager` keeps one `LeaseBook` (`manager.leases`, next to its view
of the region ledger) under the same rules: pure bookkeeping under one lock, no I/O and
nothing slow under it, plain frozen records copied out under the lock, and a forked
child starts with an empty book (the leases are its parent's connections). The broker server
(`hostpool.broker.server`) asks it before lending and tells it when a connection ends and
what an index lessee adopted; serve's metrics read it at scrape time (`leases()`,
`counters()`) and /debug/pools reads the same state per pool (`pools()`).

A pool has two parts a process may lease, each exclusively: `memory` (the pool's regions,
writable: the engine's worker) and `index` (the pool's metadata memfd: the engine's
scheduler, which may be another process than its worker). A second lease of a held part
is refused with a `LeaseHeldError` naming the holder's pid.
"""

from __future__ import annotations

import collections
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from hostpool.base import fork
from hostpool.base.locks import ForkSafeLock
from hostpool.base.units import iso_utc
from hostpool.errors import ShareError

PARTS = ("memory", "index")
# why records of an index were not adopted (hostpool_broker_discarded_blocks_total{reason})
DISCARD_REASONS = ("identity", "unfinished", "torn", "random_seed", "resized")


class LeaseHeldError(ShareError):
    """The part of the pool is leased by another connection (`holder`)."""

    def __init__(self, message: str, holder: Holder) -> None:
        super().__init__(message)
        self.holder = holder


@dataclass(frozen=True)
class Holder:
    """One lease: the connection (`peer`, the share loop's id), its process and uid."""

    pool: str
    part: str
    peer: int
    pid: int
    uid: int
    since: float  # time.time() at the lease

    def to_dict(self) -> dict[str, Any]:
        """The lease as plain JSON: part, pid, uid, `since` ISO-8601 UTC (no peer id: it
        means nothing outside the broker's loop)."""
        return {"part": self.part, "pid": self.pid, "uid": self.uid, "since": iso_utc(self.since)}


@dataclass(frozen=True)
class PoolLeases:
    """One pool's lease state, copied under the book's lock: its leases now (by part,
    memory first), blocks adopted so far and blocks discarded by reason."""

    pool: str
    held: tuple[Holder, ...] = ()
    adopted_blocks: int = 0
    discarded_blocks: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """`leases` (a list, empty when none is held), `adopted_blocks`, `discarded_blocks`."""
        return {
            "leases": [h.to_dict() for h in self.held],
            "adopted_blocks": self.adopted_blocks,
            "discarded_blocks": dict(sorted(self.discarded_blocks.items())),
        }


class LeaseBook:
    """Leases by (pool, part), and the adoption counters of each pool."""

    def __init__(self) -> None:
        self._lock = ForkSafeLock()
        self._start_empty()
        _books.add(self)

    def _start_empty(self) -> None:
        """No lease, every counter at zero: a new book, and a forked child's."""
        self._held: dict[tuple[str, str], Holder] = {}
        self._adopted: collections.Counter[str] = collections.Counter()
        self._discarded: collections.Counter[tuple[str, str]] = collections.Counter()

    def take(self, pool: str, part: str, *, peer: int, pid: int, uid: int) -> Holder:
        """Lease `part` of `pool` to `peer`; LeaseHeldError if another connection holds it
        (the same connection asking again is refused too: one lease per part)."""
        if part not in PARTS:
            raise ShareError(f"lease part must be one of {PARTS}, got {part!r}")
        with self._lock:
            held = self._held.get((pool, part))
            if held is not None:
                raise LeaseHeldError(
                    f"pool {pool!r} ({part}) is leased by pid {held.pid} (uid {held.uid}) since "
                    f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(held.since))}; a lease "
                    "is exclusive: it ends when that process closes its connection or dies",
                    held,
                )
            holder = Holder(pool, part, peer, pid, uid, time.time())
            self._held[(pool, part)] = holder
            return holder

    def end(self, peer: int, pool: str | None = None, part: str | None = None) -> list[Holder]:
        """End the leases of connection `peer` (of `pool` and `part` only, if given)."""
        with self._lock:
            ended = [
                h
                for h in self._held.values()
                if h.peer == peer
                and (pool is None or h.pool == pool)
                and (part is None or h.part == part)
            ]
            for h in ended:
                del self._held[(h.pool, h.part)]
        return ended

    def holder(self, pool: str, part: str) -> Holder | None:
        with self._lock:
            return self._held.get((pool, part))

    def leases(self) -> dict[str, int]:
        """Parts leased now, per pool (hostpool_broker_leases{pool})."""
        out: collections.Counter[str] = collections.Counter()
        with self._lock:
            for pool, _ in self._held:
                out[pool] += 1
        return dict(out)

    def count(self, pool: str, adopted: int, discarded: dict[str, int]) -> None:
        """Add an adoption's figures: blocks adopted, and blocks discarded by reason (one
        of DISCARD_REASONS; anything else is a ShareError, counted nowhere)."""
        bad = sorted(set(discarded) - set(DISCARD_REASONS))
        if bad or adopted < 0 or any(n < 0 for n in discarded.values()):
            raise ShareError(
                f"adoption report: adopted {adopted}, discarded {discarded}: counts must be "
                f">= 0 and reasons one of {DISCARD_REASONS}"
            )
        with self._lock:
            self._adopted[pool] += adopted
            for reason, n in discarded.items():
                self._discarded[(pool, reason)] += n

    def counters(self) -> tuple[dict[str, int], dict[tuple[str, str], int]]:
        """(adopted blocks per pool, discarded blocks per (pool, reason)), totals so far."""
        with self._lock:
            return dict(self._adopted), dict(self._discarded)

    def pools(self, names: list[str]) -> dict[str, PoolLeases]:
        """The lease state of each pool in `names` (empty for one never leased)."""
        with self._lock:
            leases = list(self._held.values())
            discarded = dict(self._discarded)
            adopted = dict(self._adopted)
        held = sorted(leases, key=lambda h: PARTS.index(h.part))
        out: dict[str, PoolLeases] = {}
        for name in names:
            by_reason = {r: n for (p, r), n in discarded.items() if p == name}
            mine = tuple(h for h in held if h.pool == name)
            out[name] = PoolLeases(name, mine, adopted.get(name, 0), by_reason)
        return out


# Every book of this process, so that a forked child empties them (as its region ledger).
_books: weakref.WeakSet[LeaseBook] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for book in list(_books):
        book._start_empty()  # its lock, a ForkSafeLock, is a fresh one already


fork.on_fork(__name__, after_in_child=_after_fork_in_child)
