"""What the ledger keeps and hands out: an entry per region, the allocation-time
histogram per pool, plain JSON-serialisable records, and allocation stacks."""

from __future__ import annotations

import bisect
import os
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

from hostpool.memory.interface import RegionLike
from hostpool.words import EndCause, FailureReason, FallbackReason, RegionState, ReleaseHow

# hostpool_allocation_duration_seconds buckets: 1 ms .. 10 min.
DURATION_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip


@dataclass
class LedgerEntry:
    """What the ledger keeps of one region: the Region, who made it, and its state."""

    region: RegionLike
    allocator: str
    owner: int  # id of the allocator object that made it
    stack: str | None
    dims: tuple[int, ...] = ()
    dtype: str = "torch.uint8"
    state: RegionState = "live"
    # Label tuples the collector builds once per region, not once per scrape.
    scrape_keys: tuple[Any, ...] | None = None
    pinned: int = 0  # bytes pinned at birth (the chunks list empties when unpinned)
    seconds: float = 0.0  # allocate + populate time
    # What its collection means: "tensor" when the region was handed to its tensor by
    # contract; "finalizer" (the leak signal) when an owner should have released it.
    collected_as: ReleaseHow = "finalizer"

    def ended_as(self, cause: EndCause) -> ReleaseHow:
        """What an end the memory layer reported counts as: a collection is the owner's
        to judge (`collected_as`)."""
        return "explicit" if cause == "explicit" else self.collected_as


@dataclass(frozen=True)
class LedgerCounters:
    """A consistent copy of the ledger's counters, taken under its lock (for the collector
    and tests): live figures by label tuple, lifetime totals, the duration histograms as
    (bucket counts, sum) per pool, and every pool the ledger has seen."""

    live_bytes: dict[tuple[str, str, int], int]  # (pool, allocator, page size)
    live_count: dict[tuple[str, str], int]  # (pool, allocator)
    live_modes: dict[tuple[str, str], int]  # (pool, populate mode)
    live_pinned: dict[str, int]
    allocations_total: dict[tuple[str, str], int]  # (pool, allocator)
    releases_total: dict[tuple[str, ReleaseHow], int]
    failures_total: dict[tuple[str, FailureReason], int]
    fallbacks_total: dict[tuple[str, FallbackReason], int]
    fd_reuse_skips: dict[str, int]
    durations: dict[str, tuple[list[int], float]]
    known_pools: list[str]


@dataclass
class DurationHistogram:
    """hostpool_allocation_duration_seconds of one pool: counts per bucket, and the sum."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(DURATION_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        """Count one allocation that took `seconds`."""
        self.counts[bisect.bisect_left(DURATION_BUCKETS, seconds)] += 1
        self.total += seconds


@dataclass(frozen=True)
class AllocationRecord:
    """One region as the ledger knows it: plain values, JSON-serialisable."""

    id: int
    pool: str
    allocator: str
    kind: str
    backend: str
    name: str | None
    state: RegionState  # released_mapped: views live; released_shared: peers map it
    requested_bytes: int
    mapped_bytes: int
    page_size: int
    address: int
    fd: int | None
    open_fds: int
    device: int | None
    inode: int | None
    created_at: float
    populate_mode: str
    populate_seconds: float
    hugepage_fallbacks: tuple[str, ...]
    seals: int
    numa_node: int | None
    pinned_bytes: int
    stack: str | None
    dims: tuple[int, ...] = ()
    dtype: str = "torch.uint8"
    peers: int = 0  # processes holding it through `share`

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["hugepage_fallbacks"] = list(self.hugepage_fallbacks)
        d["dims"] = list(self.dims)
        return d


def record_of(entry: LedgerEntry, peers: int = 0) -> AllocationRecord:
    """The plain record of a ledger entry. Each region fact is named (not read by field
    name), so mypy checks it against `RegionFacts`."""
    r = entry.region
    f = r.facts
    dev_ino = f.dev_ino
    return AllocationRecord(
        id=f.id,
        pool=f.pool,
        allocator=entry.allocator,
        kind=f.kind,
        backend=f.backend,
        name=f.name,
        state=entry.state,
        requested_bytes=f.requested_bytes,
        mapped_bytes=f.mapped_bytes,
        page_size=f.page_size,
        address=f.address,
        fd=r.fd,
        open_fds=r.open_fd_count(),
        device=dev_ino[0] if dev_ino else None,
        inode=dev_ino[1] if dev_ino else None,
        created_at=f.created_at,
        populate_mode=f.populate_mode,
        populate_seconds=f.populate_seconds,
        hugepage_fallbacks=f.hugepage_fallbacks,
        seals=f.seals,
        numa_node=f.numa_node,
        pinned_bytes=r.pinned_bytes,
        stack=entry.stack,
        dims=entry.dims,
        dtype=entry.dtype,
        peers=peers,
    )


def tracking_stacks_from_env() -> bool:
    """Whether HOSTPOOL_TRACK_STACKS asks for allocation stacks in every record."""
    return os.environ.get("HOSTPOOL_TRACK_STACKS", "") not in ("", "0", "false", "no")


def capture_stack(skip: int = 2) -> str:
    """The caller's stack, innermost last, without hostpool's own frames."""
    frames = traceback.extract_stack()[:-skip]
    keep = [f for f in frames if "/hostpool/" not in f.filename.replace(os.sep, "/")]
    return "".join(traceback.format_list(keep or frames))
