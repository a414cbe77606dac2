"""Populate: make every page of a new mapping resident now, or fail cleanly now.

`auto` uses MADV_POPULATE_WRITE (Linux 5.14+), split over threads for large regions;
it fails with EFAULT/ENOMEM when tmpfs or the hugetlb pool runs short. Only where the
kernel lacks it (EINVAL) does `auto` fall back: fd-backed regions `fallocate` first (a
clean ENOSPC instead of a later SIGBUS) and map with MAP_POPULATE, then residency is
checked by st_blocks (MAP_POPULATE silently leaves holes); anonymous ones are touched.
"""

from __future__ import annotations

import ctypes
import errno
import os
from concurrent.futures import ThreadPoolExecutor

from hostpool.errors import AllocationError
from hostpool.memory import kernel, syscalls

# Below this a single madvise is cheaper than starting threads.
PARALLEL_THRESHOLD = 256 << 20
MIN_CHUNK = 64 << 20


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
    if threads <= 1 or length < PARALLEL_THRESHOLD:
        syscalls.madvise(address, length, syscalls.MADV_POPULATE_WRITE)
        return
    chunk = max(MIN_CHUNK, -(-length // threads))
    chunk = -(-chunk // page_size) * page_size
    spans = [(off, min(chunk, length - off)) for off in range(0, length, chunk)]
    with ThreadPoolExecutor(max_workers=min(threads, len(spans))) as pool:
        futures = [
            pool.submit(syscalls.madvise, address + off, n, syscalls.MADV_POPULATE_WRITE)
            for off, n in spans
        ]
        errors = [f.exception() for f in futures]
    for exc in errors:
        if exc is not None:
            raise exc


def fallocate_all(fd: int, length: int) -> None:
    """Back a whole fd now; ENOSPC/ENOMEM here are clean, unlike a SIGBUS on first touch."""
    syscalls.fallocate(fd, 0, length)


def touch(address: int, length: int, *, page_size: int) -> None:
    """Write every page (fallback for anonymous memory on kernels without MADV)."""
    # memset releases the GIL and writes zeros the kernel would have given anyway.
    ctypes.memset(address, 0, length)


def check_fd_resident(fd: int, length: int) -> None:
    """MAP_POPULATE is best-effort: a hole left behind would SIGBUS later. Refuse it now."""
    blocks = os.fstat(fd).st_blocks * 512
    if blocks < length:
        raise AllocationError(
            f"populate left {length - blocks} of {length} bytes unbacked (MAP_POPULATE is "
            "best-effort); the backing memory is short",
            reason="no_memory",
        )
