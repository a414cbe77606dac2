"""The words that carry meaning, defined once: every layer imports them from here, so a
misspelled value is a type error, and each fixed set a metric label takes is one tuple.

The memory layer says how a region *ended* (`EndCause`: released on request, or its
buffer collected); the core decides what a collection *means* (`ReleaseHow`): `tensor`
when the region was handed to its tensor by contract, `finalizer` (the leak signal) when
an owner should have released it first.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

# How the memory layer reports a region's end.
EndCause = Literal["explicit", "collected"]

# Label `how` of hostpool_releases_total: `explicit` (allocator/manager close,
# `release()`, the holder's `mm.close()`, a server's teardown); `tensor` (handed to its
# tensor by contract and collected with it: the normal end); `finalizer` (an owner that
# should have released it was collected first: the leak signal, and only that).
ReleaseHow = Literal["explicit", "tensor", "finalizer"]
RELEASE_HOWS: Final[tuple[ReleaseHow, ...]] = get_args(ReleaseHow)

# A ledger record's state: live; released while views still map it; released while
# share peers still map it.
RegionState = Literal["live", "released_mapped", "released_shared"]
REGION_STATES: Final[tuple[RegionState, ...]] = get_args(RegionState)

# Label `reason` of hostpool_allocation_failures_total (AllocationError.reason).
FailureReason = Literal[
    "budget", "hugepages", "no_memory", "no_space", "fd_limit", "invalid", "other"
]
FAILURE_REASONS: Final[tuple[FailureReason, ...]] = get_args(FailureReason)

# Label `reason` of hostpool_hugepage_fallbacks_total.
FallbackReason = Literal[
    "hugetlb_pool_short",  # not enough free hugetlb pages of that size (or mmap ENOMEM)
    "hugetlb_unsupported",  # no pool of that size on this host, or the allocator cannot
    "thp_disabled",  # transparent hugepages are off for this kind of memory
    "thp_costly",  # THP is on, but a THP fault costs more than 4 KiB faults on this host
    "devshm_no_hugepages",  # the /dev/shm fallback file cannot use hugetlb
]
FALLBACK_REASONS: Final[tuple[FallbackReason, ...]] = get_args(FallbackReason)

# What a region is made of: a memfd or /dev/shm file, anonymous memory, or torch's.
AllocatorKind = Literal["shm", "mmap", "torch"]
ALLOCATOR_KINDS: Final[tuple[AllocatorKind, ...]] = get_args(AllocatorKind)

HugepageMode = Literal["off", "prefer", "required"]
HUGEPAGE_MODES: Final[tuple[HugepageMode, ...]] = get_args(HugepageMode)

# How a region was populated (label `mode` of hostpool_populate_mode); `auto` picks one.
PopulateMode = Literal["madvise", "map_populate", "touch", "none"]
POPULATE_MODES: Final[tuple[PopulateMode, ...]] = get_args(PopulateMode)
PopulateChoice = Literal["auto", "madvise", "map_populate", "touch", "none"]
POPULATE_CHOICES: Final[tuple[PopulateChoice, ...]] = get_args(PopulateChoice)

ShmBackend = Literal["auto", "memfd", "devshm"]
SHM_BACKENDS: Final[tuple[ShmBackend, ...]] = get_args(ShmBackend)
