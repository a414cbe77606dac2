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
import errno
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from hostpool.errors import AllocationError, Cancelled
from hostpool.memory import kernel, syscalls

# Below this a single madvise is cheaper than starting threads.
PARALLEL_THRESHOLD = 256 << 20
MIN_CHUNK = 64 << 20
# Inside cancel_on(), populate works in spans of this size, checking the stop event and
# reporting progress between them: a stop is seen within one span (tens of ms of faults).
CANCEL_SPAN = 64 << 20


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


def _span_step(page_size: int) -> int:
    return max(page_size, CANCEL_SPAN // page_size * page_size)


def _spans(address: int, length: int, step: int, watch: _Watch, advice: int) -> None:
    for off in range(0, length, step):
        if watch.stop.is_set():
            raise Cancelled("populate stopped on request")
        n = min(step, length - off)
        syscalls.madvise(address + off, n, advice)
        if watch.on_bytes is not None:
            watch.on_bytes(n)


def failure_from_oserror(exc: OSError, what: str, nbytes: int) -> AllocationError:
    """An AllocationError with a reason from the fixed set and a message saying what to do."""
    code = exc.errno
    if code == errno.ENOSPC:
        return AllocationError(
            f"{what}: no space for {nbytes} bytes on the backing tmpfs (ENOSPC); "
            "enlarge it (e.g. docker --shm-size) or use the memfd backend",
            reason="no_space",
        )
    if code in (errno.ENOMEM, errno.EFAULT, errno.EAGAIN):
        free = kernel.meminfo().get("MemAvailable", 0)
        return AllocationError(
            f"{what}: could not back {nbytes} bytes with memory "
            f"({errno.errorcode.get(code or 0, code)}; MemAvailable {free} bytes)",
            reason="no_memory",
        )
    if code in (errno.EMFILE, errno.ENFILE):
        return AllocationError(
            f"{what}: out of file descriptors ({errno.errorcode[code]}); raise RLIMIT_NOFILE "
            "(ulimit -n) or allocate fewer, larger regions",
            reason="fd_limit",
        )
    return AllocationError(f"{what}: {exc}", reason="other")


def madvise_populate(address: int, length: int, *, page_size: int, threads: int) -> None:
    """MADV_POPULATE_WRITE over [address, address+length), in page-aligned chunks on threads.

    Raises OSError: EINVAL means unsupported (the caller falls back), anything else is a
    failure (never a reason to fall back).
    """
    watch = _watch.get()
    step = _span_step(page_size)
    advice = syscalls.MADV_POPULATE_WRITE
    if threads <= 1 or length < PARALLEL_THRESHOLD:
        if watch is None:
            syscalls.madvise(address, length, advice)
        else:
            _spans(address, length, step, watch, advice)
        return
    chunk = max(MIN_CHUNK, -(-length // threads))
    chunk = -(-chunk // page_size) * page_size
    spans = [(off, min(chunk, length - off)) for off in range(0, length, chunk)]
    with ThreadPoolExecutor(max_workers=min(threads, len(spans))) as pool:
        if watch is None:
            futures = [pool.submit(syscalls.madvise, address + off, n, advice) for off, n in spans]
        else:
            futures = [
                pool.submit(_spans, address + off, n, step, watch, advice) for off, n in spans
            ]
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
    step = length if watch is None else _span_step(page_size)
    for off in range(0, length, step):
        if watch is not None and watch.stop.is_set():
            raise Cancelled("populate stopped on request")
        n = min(step, length - off)
        ctypes.memset(address + off, 0, n)
        if watch is not None and watch.on_bytes is not None:
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
