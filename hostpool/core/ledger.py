"""The process-wide Ledger: every live region, from birth to release, counted once.

Managers, allocators and `alloc_shm` all record here; managers are views of it.

- A region is released exactly once: `explicit` (allocator/manager close, `release()`,
  its holder's `mm.close()`); `tensor` (handed to its tensor by contract and collected
  with it: the normal end); `finalizer` (an owner that should have released it was
  collected first: the leak signal, and only that). Explicit release while views live
  leaves it "released, still mapped" until the last view dies; its bytes stay visible.
- Finalizers run inside cyclic GC, on any thread, possibly while this thread holds the
  ledger lock. So they take no lock: they append `(generation, region_id)` to a deque,
  and every ledger operation drains that queue under the lock.
- Nothing slow runs under the lock: munmap and fd closes happen after it is let go; the
  lock guards bookkeeping only (a scrape or an admission never waits for an unmap).
- Registries of budgets and share servers hold weak references, so a dropped manager is
  collected; its regions are then released (`finalizer`) and reported as a leak.
- Fork: the child gets a fresh generation; queued or future finalizer notices of the
  parent's regions are ignored, and the child starts with an empty ledger.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import functools
import os
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from hostpool.base import events
from hostpool.base.locks import ForkSafeLock
from hostpool.core.records import AllocationRecord, record_of
from hostpool.memory.region import Region

# Births and deaths queued before the hot path settles them itself.
_SETTLE_EVERY = 256

# hostpool_allocation_duration_seconds buckets: 1 ms .. 10 min.
DURATION_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip


# A memory-layer notice: (generation, region id, how, reused fd, still mapped).
_Gone = tuple[int, int, str, int | None, bool]


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
    # What its collection means: "tensor" when the region was handed to its tensor by
    # contract; "finalizer" (the leak signal) when an owner should have released it.
    collected_as: str = "finalizer"


@dataclass
class _Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(DURATION_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(DURATION_BUCKETS, seconds)] += 1
        self.total += seconds


@dataclass
class _AfterUnlock:
    """Work a drain found that must not run under the lock: unmaps and events."""

    finished: list[tuple[str, _Entry]]
    to_close: list[_Entry]
    leaked: list[_Entry]
    fd_reused: list[tuple[str, int, str | None]]


def tracking_stacks_from_env() -> bool:
    return os.environ.get("HOSTPOOL_TRACK_STACKS", "") not in ("", "0", "false", "no")


class Ledger:
    """Thread-safe record of this process's regions and lifetime counters."""

    def __init__(self) -> None:
        self._lock = ForkSafeLock()
        self._entries: dict[int, _Entry] = {}
        # (generation, region id, how, reused fd, still mapped) from the memory layer.
        self._gone: collections.deque[_Gone] = collections.deque()
        # Owner-id sets of managers collected without close() (queued by their finalizer).
        self._dropped: collections.deque[tuple[int, frozenset[int]]] = collections.deque()
        self._to_close: list[_Entry] = []
        self._leaked: list[_Entry] = []
        self._fd_reused_events: list[tuple[str, int, str | None]] = []
        self._generation = 0
        self.pid = os.getpid()
        self.known_pools: dict[str, None] = {}
        self.allocations_total: collections.Counter[tuple[str, str]] = collections.Counter()
        self.releases_total: collections.Counter[tuple[str, str]] = collections.Counter()
        self.failures_total: collections.Counter[tuple[str, str]] = collections.Counter()
        self.fallbacks_total: collections.Counter[tuple[str, str]] = collections.Counter()
        self.fd_reuse_skips: collections.Counter[str] = collections.Counter()
        self.durations: dict[str, _Histogram] = {}
        # Weak registries: a budget or share server that is dropped drops out of them.
        self._budgets: weakref.WeakSet[Any] = weakref.WeakSet()
        self._share_sources: list[weakref.WeakMethod[Callable[[], dict[str, int]]]] = []
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
        """The ledger lock; what was drained meanwhile is unmapped and logged after it is
        let go."""
        with self._lock:
            if self._gone or self._births or self._dropped:
                self._drain_locked()
            yield
            after = self._take_after_unlock_locked()
        self._after_unlock(after)

    def _take_after_unlock_locked(self) -> _AfterUnlock:
        after = _AfterUnlock(self._finished, self._to_close, self._leaked, self._fd_reused_events)
        self._finished, self._to_close, self._leaked, self._fd_reused_events = [], [], [], []
        return after

    def _after_unlock(self, after: _AfterUnlock) -> None:
        for entry in after.to_close:
            self._finish_release(entry)
        for pool, fd, name in after.fd_reused:
            _emit_fd_reused(pool, fd, name)
        _emit_leaks(after.leaked)
        _emit_releases(after.finished)

    # -- finalizer side: no lock, no region reference -------------------------------
    def unmapped_callback(self) -> Callable[..., None]:
        """A callable for the memory layer's finalizer, bound to this generation."""
        callback = self._callback
        if callback is None:
            callback = self._callback = functools.partial(
                _notify_gone, self._gone, self._generation
            )
        return callback

    def owners_dropped_callback(self) -> Callable[[Iterable[int]], None]:
        """For a manager's finalizer: its allocators' ids, queued (no lock, no reference)."""
        return functools.partial(_notify_dropped, self._dropped, self._generation)

    # -- weak registries ---------------------------------------------------------------
    def add_budget(self, budget: Any) -> None:
        """Register an admission (limit and reservation source), held weakly."""
        with self._locked():
            self._budgets.add(budget)

    def remove_budget(self, budget: Any) -> None:
        with self._locked():
            self._budgets.discard(budget)

    def budgets(self) -> list[Any]:
        with self._locked():
            return list(self._budgets)

    def add_share_source(self, attached_counts: Callable[[], dict[str, int]]) -> None:
        """A share server's per-pool peer counts (a bound method, held weakly)."""
        with self._locked():
            self._share_sources = [r for r in self._share_sources if r() is not None]
            self._share_sources.append(weakref.WeakMethod(attached_counts))

    def remove_share_source(self, attached_counts: Callable[[], dict[str, int]]) -> None:
        with self._locked():
            self._share_sources = [
                r for r in self._share_sources if r() is not None and r() != attached_counts
            ]

    def attached_clients(self) -> dict[str, int]:
        """Peers per pool, summed over every live share server of this process."""
        with self._locked():
            sources = [m for r in self._share_sources if (m := r()) is not None]
        out: collections.Counter[str] = collections.Counter()
        for source in sources:
            out.update(source())
        return dict(out)

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
        owned_by_tensor: bool = False,
    ) -> None:
        """Record a new region. `owned_by_tensor`: it was handed to its tensor by contract
        (`alloc_shm`, `alloc_mmap`, a non-retaining allocator), so its collection is the
        normal end, `tensor`; otherwise an owner (a retaining allocator, a server's pool)
        must release it, and its collection is `finalizer`, the leak signal."""
        # The allocation hot path: insert and queue, nothing more. Counting waits for
        # the next reader (a scrape, a release, a snapshot), which settles births first.
        entry = _Entry(
            region,
            allocator,
            owner,
            stack,
            dims,
            dtype,
            seconds=seconds,
            collected_as="tensor" if owned_by_tensor else "finalizer",
        )
        with self._lock:
            self._entries[region.id] = entry
            births = self._births
            births.append(entry)
            if len(births) < _SETTLE_EVERY and len(self._gone) < _SETTLE_EVERY:
                return
            self._drain_locked()  # keep the queues short when nobody reads
            after = self._take_after_unlock_locked()
        self._after_unlock(after)

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
                return None
            self._begin_release_locked(entry, "explicit", announce=False)
        gone = self._finish_release(entry)
        _emit_releases([("explicit", entry)], gone)
        return gone

    def _begin_release_locked(self, entry: _Entry, how: str, *, announce: bool = True) -> None:
        # Counted now, unmapped after the lock: until then the bytes show as still mapped.
        self._count_live(entry, -1)
        self.releases_total[(entry.region.pool, how)] += 1
        entry.state = "released_mapped"
        if announce:
            self._finished.append((how, entry))

    def _finish_release(self, entry: _Entry) -> bool:
        """Close the region's fd and unmap (outside the lock), then record the outcome."""
        region = entry.region
        gone = region.close()
        with self._lock:
            if region.fd_reused is not None:
                self.fd_reuse_skips[region.pool] += 1
            if gone and self._entries.get(region.id) is entry:
                if self._peers.get(region.id):
                    entry.state = "released_shared"
                else:
                    self._forget(region.id)
        if region.fd_reused is not None:
            _emit_fd_reused(region.pool, region.fd_reused, region.name)
        return gone

    def drain(self) -> None:
        """Process finalizer notices now (leak checks and snapshots call this first)."""
        with self._locked():
            pass

    def _drain_locked(self) -> None:
        if self._births:
            self._settle_births_locked()  # a region is counted born before it dies
        while self._dropped:
            generation, owners = self._dropped.popleft()
            if generation != self._generation:
                continue
            for orphan in self._entries.values():
                if orphan.owner in owners and orphan.state == "live":
                    # Its manager was collected without close(): release, report a leak.
                    self._begin_release_locked(orphan, "finalizer")
                    self._to_close.append(orphan)
                    self._leaked.append(orphan)
        while True:
            try:
                generation, region_id, how, reused_fd, still_mapped = self._gone.popleft()
            except IndexError:
                return
            if generation != self._generation:
                continue  # a parent's region, seen from a forked child
            if still_mapped:
                # Its holder released it (`mm.close()`) while views live: counted now; the
                # mapping's own notice comes when the last view dies.
                entry = self._entries.get(region_id)
                if entry is None:
                    continue
                if reused_fd is not None:
                    self.fd_reuse_skips[entry.region.pool] += 1
                    self._fd_reused_events.append((entry.region.pool, reused_fd, entry.region.name))
                if entry.state == "live":
                    self._begin_release_locked(entry, how)
                continue
            entry = self._entries.pop(region_id, None)
            if reused_fd is not None and entry is not None:
                self.fd_reuse_skips[entry.region.pool] += 1
                self._fd_reused_events.append((entry.region.pool, reused_fd, entry.region.name))
            if entry is None:
                continue
            if entry.state == "live":
                if how == "finalizer":
                    how = entry.collected_as  # collected: what that means is the owner's
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

    def held_bytes(self, owners: Iterable[int] | None = None) -> int:
        """Bytes the regions of these allocators (or of all) map: a budget's "held"."""
        with self._locked():
            if owners is None:
                return sum(self._owner_bytes.values())
            return sum(self._owner_bytes.get(o, 0) for o in owners)

    # -- reading ---------------------------------------------------------------------
    def entries(self, *, owner: int | None = None) -> list[_Entry]:
        """The records of live, released-still-mapped and released-shared regions (of one
        owner, or all), oldest first."""
        with self._locked():
            if owner is None:
                return list(self._entries.values())
            return [e for e in self._entries.values() if e.owner == owner]

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
                "fd_reuse_skips": dict(self.fd_reuse_skips),
                "durations": {p: (list(h.counts), h.total) for p, h in self.durations.items()},
                "known_pools": list(self.known_pools),
            }

    # -- fork ------------------------------------------------------------------------
    def _after_fork_in_child(self) -> None:
        # The child owns none of the parent's regions: it must not release or count
        # them. (Its lock, a ForkSafeLock, is already a fresh one.)
        self._generation += 1
        self._entries = {}
        self._gone = collections.deque()
        self._dropped = collections.deque()
        self._to_close = []
        self._leaked = []
        self._fd_reused_events = []
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
            self.fd_reuse_skips,
        ):
            counter.clear()
        self.durations = {}


def _notify_gone(
    queue: collections.deque[_Gone],
    generation: int,
    rid: int,
    how: str = "finalizer",
    reused_fd: int | None = None,
    still_mapped: bool = False,
) -> None:
    queue.append((generation, rid, how, reused_fd, still_mapped))


def _notify_dropped(
    queue: collections.deque[tuple[int, frozenset[int]]],
    generation: int,
    owners: Iterable[int],
) -> None:
    queue.append((generation, frozenset(owners)))


def _emit_fd_reused(pool: str, fd: int, name: str | None) -> None:
    events.warning(
        "hostpool.fd_reused",
        pool=pool,
        fd=fd,
        name=name,
        action="not closed: the number names another file now (a caller closed ours)",
    )


def _emit_leaks(leaked: list[_Entry]) -> None:
    for entry in leaked:
        r = entry.region
        events.warning(
            "hostpool.leak",
            pool=r.pool,
            bytes=r.mapped_bytes,
            name=r.name,
            allocator=entry.allocator,
            stack=entry.stack,
            why="its HostPoolManager was collected without close()",
        )


def _emit_releases(finished: list[tuple[str, _Entry]], gone: bool | None = None) -> None:
    for how, entry in finished:
        r = entry.region
        still_mapped = r.mapped if gone is None else not gone
        events.info(
            "hostpool.release",
            how=how,
            pool=r.pool,
            allocator=entry.allocator,
            bytes=r.mapped_bytes,
            name=r.name,
            # When the pages go: "now", or "with_last_view" when the caller still holds
            # views (the normal case for release(tensor)); neither is a problem.
            unmap="with_last_view" if still_mapped else "now",
        )


_ledger = Ledger()
os.register_at_fork(after_in_child=_ledger._after_fork_in_child)


def get_ledger() -> Ledger:
    """The one ledger of this process."""
    return _ledger
