"""The process-wide Ledger: every live region, from birth to release, counted once.

Managers, allocators and `alloc_shm` all record here; managers are views of it.

- A region is released exactly once, `explicit` (allocator/manager close) or `finalizer`
  (its mapping was collected). Explicit release while views live leaves it "released,
  still mapped" until the last view dies; its bytes stay visible.
- Finalizers run inside cyclic GC, on any thread, possibly while this thread holds the
  ledger lock. So they take no lock: they append `(generation, region_id)` to a deque,
  and every ledger operation drains that queue under the lock.
- Fork: the child gets a fresh generation; queued or future finalizer notices of the
  parent's regions are ignored, and the child starts with an empty ledger.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from hostpool import events
from hostpool.memory.region import Region
from hostpool.records import AllocationRecord, record_of

# Births and deaths queued before the hot path settles them itself.
_SETTLE_EVERY = 256

# hostpool_allocation_duration_seconds buckets: 1 ms .. 10 min.
DURATION_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip


@dataclass
class _Entry:
    region: Region
    allocator: str
    owner: int  # id of the allocator object that made it
    stack: str | None
    dims: tuple[int, ...] = ()
    dtype: str = "torch.uint8"
    state: str = "live"
    # Label tuples the collector builds once per region, not once per scrape.
    scrape_keys: tuple[Any, ...] | None = None
    pinned: int = 0  # bytes pinned at birth (the chunks list empties when unpinned)
    seconds: float = 0.0  # allocate + populate time


@dataclass
class _Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(DURATION_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(DURATION_BUCKETS, seconds)] += 1
        self.total += seconds


def tracking_stacks_from_env() -> bool:
    return os.environ.get("HOSTPOOL_TRACK_STACKS", "") not in ("", "0", "false", "no")


class Ledger:
    """Thread-safe record of this process's regions and lifetime counters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[int, _Entry] = {}
        self._gone: collections.deque[tuple[int, int, str]] = collections.deque()
        self._generation = 0
        self.pid = os.getpid()
        self.known_pools: dict[str, None] = {}
        self.allocations_total: collections.Counter[tuple[str, str]] = collections.Counter()
        self.releases_total: collections.Counter[tuple[str, str]] = collections.Counter()
        self.failures_total: collections.Counter[tuple[str, str]] = collections.Counter()
        self.fallbacks_total: collections.Counter[tuple[str, str]] = collections.Counter()
        self.durations: dict[str, _Histogram] = {}
        self.budgets: list[Any] = []  # objects with limit_bytes() / reserved_bytes()
        self.share_clients: Callable[[], dict[str, int]] | None = None
        self.track_stacks = tracking_stacks_from_env()
        self._finished: list[tuple[str, _Entry]] = []
        self._births: list[_Entry] = []
        self._callback: Callable[..., None] | None = None
        # region id -> peers holding it through `share` (set by the share server).
        self._peers: dict[int, int] = {}
        # Facts of live regions kept up to date at each transition, so a scrape measures
        # only what changes by itself (residency, fds), not what the ledger already knows.
        self.live_bytes: collections.Counter[tuple[str, str, int]] = collections.Counter()
        self.live_count: collections.Counter[tuple[str, str]] = collections.Counter()
        self.live_modes: collections.Counter[tuple[str, str]] = collections.Counter()
        self.live_pinned: collections.Counter[str] = collections.Counter()
        # Bytes each allocator's regions map (live or not yet gone): the budget's "held".
        self._owner_bytes: collections.Counter[int] = collections.Counter()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The ledger lock; releases drained meanwhile are logged after it is let go."""
        with self._lock:
            if self._gone or self._births:
                self._drain_locked()
            yield
            finished, self._finished = self._finished, []
        _emit_releases(finished)

    # -- finalizer side: no lock, no region reference -------------------------------
    def unmapped_callback(self) -> Callable[..., None]:
        """A callable for the memory layer's finalizer, bound to this generation."""
        callback = self._callback
        if callback is None:
            callback = self._callback = functools.partial(
                _notify_gone, self._gone, self._generation
            )
        return callback

    # -- recording -------------------------------------------------------------------
    def add_pool(self, pool: str) -> None:
        with self._locked():
            self.known_pools.setdefault(pool, None)

    def record(
        self,
        region: Region,
        *,
        allocator: str,
        owner: int,
        stack: str | None,
        seconds: float,
        dims: tuple[int, ...] = (),
        dtype: str = "torch.uint8",
    ) -> None:
        # The allocation hot path: insert and queue, nothing more. Counting waits for
        # the next reader (a scrape, a release, a snapshot), which settles births first.
        entry = _Entry(region, allocator, owner, stack, dims, dtype, seconds=seconds)
        with self._lock:
            self._entries[region.id] = entry
            births = self._births
            births.append(entry)
            if len(births) < _SETTLE_EVERY and len(self._gone) < _SETTLE_EVERY:
                return
            self._drain_locked()  # keep the queues short when nobody reads
            finished, self._finished = self._finished, []
        if finished:
            _emit_releases(finished)

    def _settle_births_locked(self) -> None:
        births, self._births = self._births, []
        for entry in births:
            region = entry.region
            pool = region.pool
            entry.pinned = region.pinned_bytes
            self._count_live(entry, 1)
            self._owner_bytes[entry.owner] += region.mapped_bytes
            if pool not in self.known_pools:
                self.known_pools[pool] = None
            self.allocations_total[(pool, entry.allocator)] += 1
            for reason in region.hugepage_fallbacks:
                self.fallbacks_total[(pool, reason)] += 1
            histogram = self.durations.get(pool)
            if histogram is None:
                histogram = self.durations[pool] = _Histogram()
            histogram.observe(entry.seconds)

    def _count_live(self, entry: _Entry, sign: int) -> None:
        r = entry.region
        self.live_bytes[(r.pool, entry.allocator, r.page_size)] += sign * r.mapped_bytes
        self.live_count[(r.pool, entry.allocator)] += sign
        self.live_modes[(r.pool, r.populate_mode)] += sign
        if entry.pinned:
            self.live_pinned[r.pool] += sign * entry.pinned

    def record_failure(self, pool: str, reason: str) -> None:
        with self._locked():
            self.known_pools.setdefault(pool, None)
            self.failures_total[(pool, reason)] += 1

    def release(self, region_id: int) -> bool | None:
        """Explicit release. True: unmapped now; False: still mapped by views;
        None: not live (already released, or collected)."""
        with self._locked():
            entry = self._entries.get(region_id)
            if entry is None or entry.state != "live":
                result = None
            else:
                gone = entry.region.close()
                self._count_live(entry, -1)
                self.releases_total[(entry.region.pool, "explicit")] += 1
                if not gone:
                    entry.state = "released_mapped"
                elif self._peers.get(region_id):
                    entry.state = "released_shared"
                else:
                    self._forget(region_id)
                self._finished.append(("explicit", entry))
                result = gone
        return result

    def drain(self) -> None:
        """Process finalizer notices now (leak checks and snapshots call this first)."""
        with self._locked():
            pass

    def _drain_locked(self) -> None:
        if self._births:
            self._settle_births_locked()  # a region is counted born before it dies
        while True:
            try:
                generation, region_id, how = self._gone.popleft()
            except IndexError:
                return
            if generation != self._generation:
                continue  # a parent's region, seen from a forked child
            entry = self._entries.pop(region_id, None)
            if entry is None:
                continue
            if entry.state == "live":
                self._count_live(entry, -1)
                self.releases_total[(entry.region.pool, how)] += 1
                self._finished.append((how, entry))
            if self._peers.get(region_id):
                # Peers still map it: keep it visible until the last one detaches.
                entry.state = "released_shared"
                self._entries[region_id] = entry
            else:
                self._owner_bytes[entry.owner] -= entry.region.mapped_bytes

    def set_peers(self, region_id: int, peers: int) -> None:
        """The share server's count of peers holding a region (0 forgets it)."""
        with self._locked():
            if peers > 0:
                self._peers[region_id] = peers
                return
            self._peers.pop(region_id, None)
            entry = self._entries.get(region_id)
            if entry is not None and entry.state == "released_shared":
                self._forget(region_id)

    def _forget(self, region_id: int) -> None:
        entry = self._entries.pop(region_id)
        self._owner_bytes[entry.owner] -= entry.region.mapped_bytes

    def held_bytes(self, owners: Iterable[int]) -> int:
        """Bytes the regions of these allocators map (what a budget counts as held)."""
        with self._locked():
            return sum(self._owner_bytes.get(o, 0) for o in owners)

    def peers(self, region_id: int) -> int:
        return self._peers.get(region_id, 0)

    # -- reading ---------------------------------------------------------------------
    def entries(self, *, owner: int | None = None, pool: str | None = None) -> list[_Entry]:
        if owner is None and pool is None:
            with self._locked():
                return list(self._entries.values())
        with self._locked():
            return [
                e
                for e in self._entries.values()
                if (owner is None or e.owner == owner) and (pool is None or e.region.pool == pool)
            ]

    def regions(self, *, owner: int | None = None, state: str | None = "live") -> list[Region]:
        return [e.region for e in self.entries(owner=owner) if state is None or e.state == state]

    def snapshot(
        self, pools: Iterable[str] | None = None, *, owners: set[int] | None = None
    ) -> list[AllocationRecord]:
        """Plain records of live and released-still-mapped regions, oldest first."""
        wanted = set(pools) if pools is not None else None
        return [
            record_of(e, self._peers.get(e.region.id, 0))
            for e in self.entries()
            if (wanted is None or e.region.pool in wanted) and (owners is None or e.owner in owners)
        ]

    def counters(self) -> dict[str, Any]:
        """A consistent copy of the lifetime counters (for the collector)."""
        with self._locked():
            return {
                "live_bytes": dict(self.live_bytes),
                "live_count": dict(self.live_count),
                "live_modes": dict(self.live_modes),
                "live_pinned": dict(self.live_pinned),
                "allocations_total": dict(self.allocations_total),
                "releases_total": dict(self.releases_total),
                "failures_total": dict(self.failures_total),
                "fallbacks_total": dict(self.fallbacks_total),
                "durations": {p: (list(h.counts), h.total) for p, h in self.durations.items()},
                "known_pools": list(self.known_pools),
            }

    # -- fork ------------------------------------------------------------------------
    def _after_fork_in_child(self) -> None:
        # The child owns none of the parent's regions: it must not release or count
        # them. The lock may have been held by another parent thread: replace it.
        self._lock = threading.Lock()
        self._generation += 1
        self._entries = {}
        self._gone = collections.deque()
        self._finished = []
        self._births = []
        self._callback = None
        self._peers = {}
        self._owner_bytes.clear()
        for live in (self.live_bytes, self.live_count, self.live_modes, self.live_pinned):
            live.clear()
        self.pid = os.getpid()
        for counter in (
            self.allocations_total,
            self.releases_total,
            self.failures_total,
            self.fallbacks_total,
        ):
            counter.clear()
        self.durations = {}


def _notify_gone(
    queue: collections.deque[tuple[int, int, str]],
    generation: int,
    rid: int,
    how: str = "finalizer",
) -> None:
    queue.append((generation, rid, how))


def _emit_releases(finished: list[tuple[str, _Entry]]) -> None:
    for how, entry in finished:
        r = entry.region
        events.info(
            "hostpool.release",
            how=how,
            pool=r.pool,
            allocator=entry.allocator,
            bytes=r.mapped_bytes,
            name=r.name,
            still_mapped=entry.state == "released_mapped",
        )


_ledger = Ledger()
os.register_at_fork(after_in_child=_ledger._after_fork_in_child)


def get_ledger() -> Ledger:
    """The one ledger of this process."""
    return _ledger
