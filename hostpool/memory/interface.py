"""`RegionLike`: what a region is to everything above the memory layer (the ledger, the
collector, the multiprocess publisher, the share server, /debug/pools, snapshots and
leak reports), whoever made its memory.

Two kinds implement it, each on its own (no shared base class, so neither can inherit a
member whose meaning is the other's):
- `memory.region.Region`: hostpool's own mappings (memfd, /dev/shm file, anonymous mmap,
  torch), and memory another allocator owns (`memory.holders.adopt`: sglang's mooncake,
  tensorcast, mori; vLLM's `torch.zeros` fallback), which hostpool holds by a holder;
- `integrations.vllm.recording.VllmRegion`: vLLM's `SharedOffloadRegion`, whose fd and
  mapping stay vLLM's (hostpool only watches them).

A seam of its own (not in `region`): the integrations implement it without importing the
memory layer's concrete class. mypy checks each implementation against it where the
implementation lives (a function under TYPE_CHECKING that returns an instance as
`RegionLike`), so a member that drifts fails `make lint` in that one place.

Every member is read-only here: the facts of its birth are one frozen `RegionFacts` record
(`region.facts`), the rest is live state. Measuring members (`mapped`, `open_fd_count`, `scrape`)
run on any thread and hold no strong reference to the mapping (see `memory.region`).
"""

from __future__ import annotations

import mmap
import time
from dataclasses import dataclass, field
from typing import Protocol

from hostpool.memory.syscalls import PAGE_SIZE
from hostpool.words import AllocatorKind, FallbackReason


@dataclass(frozen=True, kw_only=True)
class RegionFacts:
    """What a region is, fixed when it was made: plain values, one record whoever made it
    (copied whole into records, snapshots and leak reports; nothing sets them later)."""

    id: int
    pool: str
    kind: AllocatorKind
    backend: str  # memfd, devshm, anon, torch, foreign
    requested_bytes: int
    mapped_bytes: int
    address: int
    page_size: int = PAGE_SIZE
    # The memfd's or file's name as /proc shows it; None for anonymous memory.
    name: str | None = None
    populate_mode: str = "none"  # madvise, map_populate, touch, none
    populate_seconds: float = 0.0
    hugepage_fallbacks: tuple[FallbackReason, ...] = ()
    thp_advised: bool = False
    seals: int = 0
    numa_node: int | None = None
    # The inode of its fd; None: no fd (anonymous, torch, foreign memory).
    dev_ino: tuple[int, int] | None = None
    created_at: float = field(default_factory=time.time)


class RegionLike(Protocol):
    """One allocation as the layers above the memory layer see it."""

    @property
    def facts(self) -> RegionFacts:
        """How it was made (`RegionFacts`)."""

    # -- state: read on any thread --------------------------------------------------------
    @property
    def fd(self) -> int | None:
        """An fd number naming the region while there is one: verify `facts.dev_ino` (or use
        `borrow_fd`) before acting on it."""

    @property
    def fd_reused(self) -> int | None:
        """An fd number `close()` left open because it named another file by then."""

    @property
    def pinned_bytes(self) -> int:
        """Bytes registered with CUDA now."""

    @property
    def mapped(self) -> bool:
        """Whether the mapping still exists. Takes no reference to it."""

    def open_fd_count(self) -> int:
        """fds this process holds for it: what /proc/PID/fd shows."""
        ...

    def scrape(self) -> tuple[int, int]:
        """(open fds, resident bytes), as cheaply as the kind allows; holds no reference."""
        ...

    def borrow_fd(self) -> int | None:
        """A dup of its fd, checked to name its inode, or None; the caller closes it.
        Raises OSError when no fd is left (EMFILE, ENFILE)."""
        ...

    def mmap(self) -> mmap.mmap | None:
        """The mmap object, for the holder that owns it (sglang's `mm`); None when the
        mapping is not hostpool's to hand out. Measuring code never calls it."""
        ...

    def close(self) -> bool:
        """The ledger's release: close what is hostpool's; True when the mapping is gone
        now, False while views (or its owner) still map it. Idempotent."""
        ...
