"""The events of a region's birth and end, emitted in one place for the allocators, the
ledger and the manager: `hostpool.alloc`, `hostpool.populate`, `hostpool.hugepage_fallback`;
`hostpool.release`, `hostpool.leak`, `hostpool.fd_reused`.

Levels: a release its owner asked for (`explicit`) or that came with its tensor
(`tensor`) is the normal, per-allocation case: debug. A `finalizer` release (an owner
collected without releasing: the leak signal), a leak and a reused fd are warnings.
The per-pool summary at info is `hostpool.pool_closed`, from the manager.
"""

from __future__ import annotations

import logging

from hostpool.base import events
from hostpool.core.records import LedgerEntry
from hostpool.memory.region import Region
from hostpool.words import ReleaseHow


def emit_alloc(region: Region, seconds: float, allocator: str, hugepages: str) -> None:
    """A region's birth: its fallbacks (info), populate and alloc (debug). `allocator`: its
    registered name; `hugepages`: the option it was asked with; `seconds`: its making."""
    if not events.stdlib_logger.isEnabledFor(logging.INFO):
        return  # the common case: nothing listens, build nothing
    facts = region.facts
    for reason in facts.hugepage_fallbacks:
        events.info(
            "hostpool.hugepage_fallback",
            pool=facts.pool,
            reason=reason,
            bytes=facts.mapped_bytes,
            hugepages=hugepages,
        )
    events.debug(
        "hostpool.populate",
        pool=facts.pool,
        mode=facts.populate_mode,
        bytes=facts.mapped_bytes,
        seconds=round(facts.populate_seconds, 6),
    )
    events.debug(  # per allocation: debug (`hostpool.pool_closed` sums a pool up)
        "hostpool.alloc",
        pool=facts.pool,
        allocator=allocator,
        bytes=facts.mapped_bytes,
        requested_bytes=facts.requested_bytes,
        fd=region.fd,
        name=facts.name,
        backend=facts.backend,
        page_size=facts.page_size,
        populate=facts.populate_mode,
        seconds=round(seconds, 6),
    )


def emit_fd_reused(pool: str, fd: int, name: str | None) -> None:
    """`hostpool.fd_reused`: a region's fd number was left open, as it names another file."""
    events.warning(
        "hostpool.fd_reused",
        pool=pool,
        fd=fd,
        name=name,
        action="not closed: the number names another file now (a caller closed ours)",
    )


def emit_leak(
    pool: str,
    nbytes: int,
    name: str | None,
    allocator: str,
    stack: str | None,
    why: str | None = None,
) -> None:
    """`hostpool.leak`: a region still mapped when its owner ended (`why`, when the
    owner did not end by close())."""
    fields = {} if why is None else {"why": why}
    events.warning(
        "hostpool.leak",
        pool=pool,
        bytes=nbytes,
        name=name,
        allocator=allocator,
        stack=stack,
        **fields,
    )


def emit_leaks(leaked: list[LedgerEntry]) -> None:
    """`hostpool.leak` for each region of a manager collected without close()."""
    for entry in leaked:
        f = entry.region.facts
        emit_leak(
            f.pool,
            f.mapped_bytes,
            f.name,
            entry.allocator,
            entry.stack,
            why="its HostPoolManager was collected without close()",
        )


def release_level(how: ReleaseHow) -> int:
    """The log level of `hostpool.release` for a release `how`: debug for `explicit` and
    `tensor` (the normal ends), warning for anything else (`finalizer`: the leak signal)."""
    return logging.DEBUG if how in ("explicit", "tensor") else logging.WARNING


def emit_releases(finished: list[tuple[ReleaseHow, LedgerEntry]], gone: bool | None = None) -> None:
    """`hostpool.release` for each (how, entry), at `release_level(how)`; `gone`: whether
    the mapping went now (None: ask each region)."""
    for how, entry in finished:
        level = release_level(how)
        if not events.stdlib_logger.isEnabledFor(level):
            continue
        still_mapped = entry.region.mapped if gone is None else not gone
        events.emit(
            "hostpool.release",
            level,
            how=how,
            pool=entry.region.facts.pool,
            allocator=entry.allocator,
            bytes=entry.region.facts.mapped_bytes,
            name=entry.region.facts.name,
            # When the pages go: "now", or "with_last_view" when the caller still holds
            # views (the normal case for release(tensor)); neither is a problem.
            unmap="with_last_view" if still_mapped else "now",
        )
