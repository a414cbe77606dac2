"""What the ledger hands out: plain, JSON-serialisable records, and allocation stacks."""

from __future__ import annotations

import os
import traceback
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class AllocationRecord:
    """One region as the ledger knows it: plain values, JSON-serialisable."""

    id: int
    pool: str
    allocator: str
    kind: str
    backend: str
    name: str | None
    state: str  # "live", "released_mapped" (views live) or "released_shared" (peers map it)
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


def record_of(entry: Any, peers: int = 0) -> AllocationRecord:
    """The plain record of a ledger entry (anything with `region`, `allocator`, `stack`,
    `dims`, `dtype` and `state`)."""
    r = entry.region
    return AllocationRecord(
        id=r.id,
        pool=r.pool,
        allocator=entry.allocator,
        kind=r.kind,
        backend=r.backend,
        name=r.name,
        state=entry.state,
        requested_bytes=r.requested_bytes,
        mapped_bytes=r.mapped_bytes,
        page_size=r.page_size,
        address=r.address,
        fd=r.fd,
        open_fds=r.open_fd_count(),
        device=r.dev_ino[0] if r.dev_ino else None,
        inode=r.dev_ino[1] if r.dev_ino else None,
        created_at=r.created_at,
        populate_mode=r.populate_mode,
        populate_seconds=r.populate_seconds,
        hugepage_fallbacks=r.hugepage_fallbacks,
        seals=r.seals,
        numa_node=r.numa_node,
        pinned_bytes=r.pinned_bytes,
        stack=entry.stack,
        dims=entry.dims,
        dtype=entry.dtype,
        peers=peers,
    )


def capture_stack(skip: int = 2) -> str:
    """The caller's stack, innermost last, without hostpool's own frames."""
    frames = traceback.extract_stack()[:-skip]
    keep = [f for f in frames if "/hostpool/" not in f.filename.replace(os.sep, "/")]
    return "".join(traceback.format_list(keep or frames))
