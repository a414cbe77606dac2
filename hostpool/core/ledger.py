"""The process-wide Ledger: every live region, from birth to release, counted once.

Managers, allocators and `alloc_shm` all record here; managers are views of it.

- A region is released exactly once, counted by `hostpool.words.ReleaseHow`. Explicit
  release while views live leaves it "released, still mapped" until the last view dies.
- Finalizers take no lock (core/notices): every ledger operation drains their queue.
- Nothing slow runs under the lock: munmap and fd closes happen after it is let go.
- A manager collected without close() queues its allocators' ids the same way; its
  regions are then released (`finalizer`) and reported as a leak.
- Fork: the child gets a fresh generation; queued or future finalizer notices of the
  parent's regions are ignored, and the child starts with an empty ledger.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from hostpool.base import fork
from hostpool.base.locks import ForkSafeLock
from hostpool.core.ledger_events import emit_fd_reused, emit_leaks, emit_releases
from hostpool.core.notices import Gone, notify_dropped, notify_gone
from hostpool.core.records import (
    AllocationRecord,
    DurationHistogram,
    LedgerCounters,
    LedgerEntry,
    record_of,
    tracking_stacks_from_env,
)
from hostpool.memory.interface import RegionLike
from hostpool.words import FailureReason, FallbackReason, RegionState, ReleaseHow

# Births and deaths queued before the hot path settles them itself.
_SETTLE_EVERY = 256


@dataclass
class _AfterUnlock:
    """Work a drain found that must not run under the lock: unmaps and events."""

    finished: list[tuple[ReleaseHow, LedgerEntry]]
    to_close: list[LedgerEntry]
    leaked: list[LedgerEntry]
    fd_reused: list[tuple[str, int, str | None]]


class Ledger:
    """Thread-safe record of this process's regions and lifetime counters."""

    def __init__(self) -> None:
        self._lock = ForkSafeLock()
        self._generation = 0
        self.track_stacks = tracking_stacks_from_env()
        # Pools stay known in a forked child: its managers and allocators came with it.
        self.known_pools: dict[str, None] = {}
        self._start_empty()

    def _start_empty(self) -> None:
        """No region, nothing queued, every counter at zero: a new ledger, and a forked
        child's (which owns none of its parent's regions; the pools it knows are kept)."""
        self.pid = os.getpid()
        self._entries: dict[int, LedgerEntry] = {}
        # (generation, region id, how, reused fd, still mapped) from the memory layer.
        self._gone: collections.deque[Gone] = collections.deque()
        # Owner-id sets of managers collected without close() (queued by their finalizer).
        self._dropped: collections.deque[tuple[int, frozenset[int]]] = collections.deque()
        self._to_close: list[LedgerEntry] = []
        self._leaked: list[LedgerEntry] = []
        self._fd_reused_events: list[tuple[str, int, str | None]] = []
        self.allocations_total: collections.Counter[tuple[str, str]] = collections.Counter()
        self.releases_total: collections.Counter[tuple[str, ReleaseHow]] = collections.Counter()
        self.failures_total: collections.Counter[tuple[str, FailureReason]] = collections.Counter()
        self.fallbacks_total: collections.Counter[tuple[str, FallbackReason]]
        self.fallbacks_total = collections.Counter()
        self.fd_reuse_skips: collections.Counter[str] = collections.Counter()
        self.durations: dict[str, DurationHistogram] = {}
        self._finished: list[tuple[ReleaseHow, LedgerEntry]] = []
        self._births: list[LedgerEntry] = []
        # The finalizers' callable, bound to this generation's queue.
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
        # (owner, "allocated" or how released) -> [regions, bytes]: an owner's summary.
        self._owner_ends: dict[tuple[int, str], list[int]] = {}

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
            emit_fd_reused(pool, fd, name)
        emit_leaks(after.leaked)
        emit_releases(after.finished)

    # -- finalizer side: no lock, no region reference -------------------------------
    def unmapped_callback(self) -> Callable[..., None]:
        """A callable for the memory layer's finalizer, bound to this generation."""
        callback = self._callback
        if callback is None:
            callback = self._callback = functools.partial(notify_gone, self._gone, self._generation)
        return callback

    def owners_dropped_callback(self) -> Callable[[Iterable[int]], None]:
        """For a manager's finalizer: its allocators' ids, queued (no lock, no reference)."""
        return functools.partial(notify_dropped, self._dropped, self._generation)

    # -- recording -------------------------------------------------------------------
    def add_pool(self, pool: str) -> None:
        with self._locked():
            self.known_pools.setdefault(pool, None)

    def record(
        self,
        region: RegionLike,
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
        entry = LedgerEntry(
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
            self._entries[region.facts.id] = entry
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
            pool = region.facts.pool
            entry.pinned = region.pinned_bytes
            self._count_live(entry, 1)
            self._owner_bytes[entry.owner] += region.facts.mapped_bytes
            if pool not in self.known_pools:
                self.known_pools[pool] = None
            self.allocations_total[(pool, entry.allocator)] += 1
            self._tally_owner(entry, "allocated")
            for reason in region.facts.hugepage_fallbacks:
                self.fallbacks_total[(pool, reason)] += 1
            histogram = self.durations.get(pool)
            if histogram is None:
                histogram = self.durations[pool] = DurationHistogram()
            histogram.observe(entry.seconds)

    def _count_live(self, entry: LedgerEntry, sign: int) -> None:
        f = entry.region.facts
        self.live_bytes[(f.pool, entry.allocator, f.page_size)] += sign * f.mapped_bytes
        self.live_count[(f.pool, entry.allocator)] += sign
        self.live_modes[(f.pool, f.populate_mode)] += sign
        if entry.pinned:
            self.live_pinned[f.pool] += sign * entry.pinned

    def record_failure(self, pool: str, reason: FailureReason) -> None:
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
        emit_releases([("explicit", entry)], gone)
        return gone

    def _begin_release_locked(
        self, entry: LedgerEntry, how: ReleaseHow, *, announce: bool = True
    ) -> None:
        # Counted now, unmapped after the lock: until then the bytes show as still mapped.
        self._count_end(entry, how)
        entry.state = "released_mapped"
        if announce:
            self._finished.append((how, entry))

    def _count_end(self, entry: LedgerEntry, how: ReleaseHow) -> None:
        self._count_live(entry, -1)
        self.releases_total[(entry.region.facts.pool, how)] += 1
        self._tally_owner(entry, how)

    def _tally_owner(self, entry: LedgerEntry, what: str) -> None:
        tally = self._owner_ends.setdefault((entry.owner, what), [0, 0])
        tally[0] += 1
        tally[1] += entry.region.facts.mapped_bytes

    def take_owner_summary(self, owner: int) -> dict[str, tuple[int, int]]:
        """What `owner`'s regions did so far, {"allocated" or how released: (regions,
        bytes)}, then forgotten (for a closing allocator's summary)."""
        with self._locked():
            keys = [k for k in self._owner_ends if k[0] == owner]
            return {what: tuple(self._owner_ends.pop((o, what))) for o, what in keys}  # type: ignore[misc]

    def _finish_release(self, entry: LedgerEntry) -> bool:
        """Close the region's fd and unmap (outside the lock), then record the outcome."""
        region = entry.region
        gone = region.close()
        with self._lock:
            if region.fd_reused is not None:
                self.fd_reuse_skips[region.facts.pool] += 1
            if gone and self._entries.get(region.facts.id) is entry:
                if self._peers.get(region.facts.id):
                    entry.state = "released_shared"
                else:
                    self._forget(region.facts.id)
        if region.fd_reused is not None:
            emit_fd_reused(region.facts.pool, region.fd_reused, region.facts.name)
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
                generation, region_id, cause, reused_fd, still_mapped = self._gone.popleft()
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
                self._note_fd_reused_locked(entry, reused_fd)
                if entry.state == "live":
                    self._begin_release_locked(entry, entry.ended_as(cause))
                continue
            entry = self._entries.pop(region_id, None)
            if entry is None:
                continue
            self._note_fd_reused_locked(entry, reused_fd)
            if entry.state == "live":
                how = entry.ended_as(cause)
                self._count_end(entry, how)
                self._finished.append((how, entry))
            if self._peers.get(region_id):
                # Peers still map it: keep it visible until the last one detaches.
                entry.state = "released_shared"
                self._entries[region_id] = entry
            else:
                self._owner_bytes[entry.owner] -= entry.region.facts.mapped_bytes

    def _note_fd_reused_locked(self, entry: LedgerEntry, reused_fd: int | None) -> None:
        """Count (and queue the event of) an fd number left open: it named another file."""
        if reused_fd is not None:
            facts = entry.region.facts
            self.fd_reuse_skips[facts.pool] += 1
            self._fd_reused_events.append((facts.pool, reused_fd, facts.name))

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
        self._owner_bytes[entry.owner] -= entry.region.facts.mapped_bytes

    def held_bytes(self, owners: Iterable[int] | None = None) -> int:
        """Bytes the regions of these allocators (or of all) map: a budget's "held"."""
        with self._locked():
            if owners is None:
                return sum(self._owner_bytes.values())
            return sum(self._owner_bytes.get(o, 0) for o in owners)

    def entries(self, *, owner: int | None = None) -> list[LedgerEntry]:
        """The records of live, released-still-mapped and released-shared regions (of one
        owner, or all), oldest first."""
        with self._locked():
            if owner is None:
                return list(self._entries.values())
            return [e for e in self._entries.values() if e.owner == owner]

    def regions(
        self, *, owner: int | None = None, state: RegionState | None = "live"
    ) -> list[RegionLike]:
        return [e.region for e in self.entries(owner=owner) if state is None or e.state == state]

    def snapshot(
        self, pools: Iterable[str] | None = None, *, owners: set[int] | None = None
    ) -> list[AllocationRecord]:
        """Plain records of live and released-still-mapped regions, oldest first."""
        wanted = set(pools) if pools is not None else None
        return [
            record_of(e, self._peers.get(e.region.facts.id, 0))
            for e in self.entries()
            if (wanted is None or e.region.facts.pool in wanted)
            and (owners is None or e.owner in owners)
        ]

    def counters(self) -> LedgerCounters:
        """A consistent copy of the counters (for the collector)."""
        with self._locked():
            return LedgerCounters(
                live_bytes=dict(self.live_bytes),
                live_count=dict(self.live_count),
                live_modes=dict(self.live_modes),
                live_pinned=dict(self.live_pinned),
                allocations_total=dict(self.allocations_total),
                releases_total=dict(self.releases_total),
                failures_total=dict(self.failures_total),
                fallbacks_total=dict(self.fallbacks_total),
                fd_reuse_skips=dict(self.fd_reuse_skips),
                durations={p: (list(h.counts), h.total) for p, h in self.durations.items()},
                known_pools=list(self.known_pools),
            )

    def _after_fork_in_child(self) -> None:
        # The child owns none of the parent's regions: it must not release or count them;
        # the parent's finalizer notices carry the old generation. (Its lock, a
        # ForkSafeLock, is already a fresh one.)
        self._generation += 1
        self._start_empty()


_ledger = Ledger()
fork.on_fork(__name__, after_in_child=_ledger._after_fork_in_child)


def get_ledger() -> Ledger:
    """The one ledger of this process."""
    return _ledger
