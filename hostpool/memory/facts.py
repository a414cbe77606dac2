"""How a region was made, recorded the same way by every maker (hostpool's mappings, torch's
memory, memory another allocator owns): the facts the maker knows, and a region whose
address and mapped bytes are its holder's, never stated twice."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from hostpool.memory import syscalls
from hostpool.memory.holders import holder_type
from hostpool.memory.region import Region, new_region
from hostpool.words import AllocatorKind, FallbackReason


@dataclass(frozen=True)
class RegionFacts:
    """What the maker of a region knows besides its holder (see `Region` for each field)."""

    pool: str
    kind: AllocatorKind
    backend: str
    requested_bytes: int
    populate_mode: str = "none"
    populate_seconds: float = 0.0
    hugepage_fallbacks: tuple[FallbackReason, ...] = ()
    name: str | None = None  # the memfd's or the mapping's name, as /proc shows it
    page_size: int = syscalls.PAGE_SIZE


def region_over(
    holder: Any, on_unmapped: Callable[..., None] | None, facts: RegionFacts, **more: Any
) -> Region:
    """`new_region(holder, on_unmapped, ...)` with `facts`, the holder's address and size as
    the region's address and mapped bytes, and `more` (mapping, fd, pinned_chunks, seals...:
    the other keywords of `new_region`). Raises TypeError for a keyword Region lacks."""
    known = {f.name: getattr(facts, f.name) for f in fields(facts)}
    return new_region(
        holder,
        on_unmapped,
        address=ctypes.addressof(holder),
        mapped_bytes=ctypes.sizeof(holder),
        **known,
        **more,
    )


def holder_over_tensor(tensor: Any, nbytes: int) -> Any:
    """A holder of `nbytes` over a CPU tensor's memory that keeps the tensor (the memory's
    owner: torch, or another allocator) alive as long as any view of the holder."""
    holder = holder_type(nbytes).from_address(int(tensor.data_ptr()))
    holder.keeps_alive = tensor  # type: ignore[attr-defined]  # holder_type gives it a __dict__
    return holder
