"""Populate: make every page of a new mapping resident now, or fail cleanly now.

`auto` uses MADV_POPULATE_WRITE (Linux 5.14+), split over threads for large regions;
it fails with EFAULT/ENOMEM when tmpfs or the hugetlb pool runs short. Only where the
kernel lacks it (EINVAL) does `auto` fall back: fd-backed regions `fallocate` first (a
clean ENOSPC instead of a later SIGBUS) and map with MAP_POPULATE, then residency is
checked by st_blocks (MAP_POPULATE silently leaves holes); anonymous ones are touched.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from hostpool.base.units import page_spans
from hostpool.errors import AllocationError, Cancelled
from hostpool.memory import syscalls

# Below this a single madvise is cheaper than starting threads.
PARALLEL_THRESHOLD = 256 << 20
# Populate hands its threads spans of this size from one queue, and checks for a stop
# between spans (a stop is seen within tens of ms). Small shared spans keep every thread
# busy to the end: a thread the scheduler parks delays one span, not half the region
# (measured: docs/ARCHITECTURE.md).
SPAN = 64 << 20


@dataclass(frozen=True)
class _Watch:
    stop: threading.Event
    on_bytes: Callable[[int], None] | None


_watch: contextvars.ContextVar[_Watch | None] = contextvars.ContextVar(
    "hostpool_populate_watch", default=None
)


@contextlib.contextmanager
def cancel_on(
    stop: threading.Event, *, on_bytes: Callable[[int], None] | None = None
) -> Iterator[None]:
    """Populates started in this context raise Cancelled soon after `stop` is set (the
    allocation then closes what it made, as on any failure) and call `on_bytes(n)` as
    each span of n bytes is populated (from populate's threads)."""
    token = _watch.set(_Watch(stop, on_bytes))
    try:
        yield
    finally:
        _watch.reset(token)


def _populate_span(
    start: int, n: int, advice: int, watch: _Watch | None, halt: threading.Event
) -> None:
    if halt.is_set():  # another span failed: the region is going away
        return
    if watch is not None and watch.stop.is_set():
        raise Cancelled("populate stopped on request")
    try:
        syscalls.madvise(start, n, advice)
    except BaseException:
        halt.set()
        raise
    if watch is not None and watch.on_bytes is not None:
        watch.on_bytes(n)


def madvise_populate(address: int, length: int, *, page_size: int, threads: int) -> None:
    """MADV_POPULATE_WRITE over [address, address+length); a large region in SPAN pieces
    that up to `threads` threads take from one queue.

    Raises OSError: EINVAL means unsupported (the caller falls back), anything else is a
    failure (never a reason to fall back).
    """
    watch = _watch.get()
    advice = syscalls.MADV_POPULATE_WRITE
    parallel = threads > 1 and length >= PARALLEL_THRESHOLD
    if watch is None and not parallel:
        syscalls.madvise(address, length, advice)
        return
    spans = page_spans(address, length, SPAN, page_size)
    halt = threading.Event()
    if not parallel:
        for start, n in spans:
            _populate_span(start, n, advice, watch, halt)
        return
    with ThreadPoolExecutor(max_workers=min(threads, len(spans))) as pool:
        futures = [pool.submit(_populate_span, start, n, advice, watch, halt) for start, n in spans]
        errors = [f.exception() for f in futures]
    if watch is not None and watch.stop.is_set():
        raise Cancelled("populate stopped on request")
    for exc in errors:
        if exc is not None:
            raise exc


def fallocate_all(fd: int, length: int) -> None:
    """Back a whole fd now; ENOSPC/ENOMEM here are clean, unlike a SIGBUS on first touch."""
    syscalls.fallocate(fd, 0, length)


def touch(address: int, length: int, *, page_size: int) -> None:
    """Write every page (fallback for anonymous memory on kernels without MADV)."""
    # memset releases the GIL and writes zeros the kernel would have given anyway.
    watch = _watch.get()
    if watch is None:
        ctypes.memset(address, 0, length)
        return
    for start, n in page_spans(address, length, SPAN, page_size):
        if watch.stop.is_set():
            raise Cancelled("populate stopped on request")
        ctypes.memset(start, 0, n)
        if watch.on_bytes is not None:
            watch.on_bytes(n)


def check_fd_resident(fd: int, length: int) -> None:
    """MAP_POPULATE is best-effort: a hole left behind would SIGBUS later. Refuse it now."""
    blocks = os.fstat(fd).st_blocks * 512
    if blocks < length:
        raise AllocationError(
            f"populate left {length - blocks} of {length} bytes unbacked (MAP_POPULATE is "
            "best-effort); the backing memory is short",
            reason="no_memory",
        )
