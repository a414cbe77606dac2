"""OSErrors of the allocation path as typed AllocationErrors: the errno mapped to a reason
from the fixed set, with a message that says what to do. Used wherever an allocation
meets the kernel: populate, region creation, admission, handing out an fd."""

from __future__ import annotations

import errno

from hostpool.errors import AllocationError
from hostpool.memory import kernel


def failure_from_oserror(exc: OSError, what: str, nbytes: int) -> AllocationError:
    """The AllocationError for an OSError met while allocating `nbytes` (`what` names the
    step): ENOSPC -> reason "no_space", ENOMEM/EFAULT/EAGAIN -> "no_memory" (with
    `available_bytes` = MemAvailable), EMFILE/ENFILE -> "fd_limit", else "other"; the
    message says what to do. `need_bytes` is `nbytes`."""
    code = exc.errno
    if code == errno.ENOSPC:
        return AllocationError(
            f"{what}: no space for {nbytes} bytes on the backing tmpfs (ENOSPC); "
            "enlarge it (e.g. docker --shm-size) or use the memfd backend",
            reason="no_space",
            need_bytes=nbytes,
        )
    if code in (errno.ENOMEM, errno.EFAULT, errno.EAGAIN):
        free = kernel.meminfo().get("MemAvailable", 0)
        return AllocationError(
            f"{what}: could not back {nbytes} bytes with memory "
            f"({errno.errorcode.get(code or 0, code)}; MemAvailable {free} bytes)",
            reason="no_memory",
            need_bytes=nbytes,
            available_bytes=free,
        )
    if code in (errno.EMFILE, errno.ENFILE):
        return AllocationError(
            f"{what}: out of file descriptors ({errno.errorcode[code]}); raise RLIMIT_NOFILE "
            "(ulimit -n) or allocate fewer, larger regions",
            reason="fd_limit",
            need_bytes=nbytes,
        )
    return AllocationError(f"{what}: {exc}", reason="other", need_bytes=nbytes)
