"""Shared-memory file descriptors: memfd, or a file in /dev/shm when memfd is unavailable.

The fallback file is created `O_CREAT|O_EXCL|O_NOFOLLOW`, mode 0600, with a random suffix,
and unlinked at once: a planted symlink or a pre-created file of the same name is never
opened, and nothing is left in the directory if the process dies.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
from dataclasses import dataclass

from hostpool.errors import AllocationError
from hostpool.memory import syscalls

SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
SEALS = SIZE_SEALS | fcntl.F_SEAL_SEAL
F_SEAL_FUTURE_WRITE = 0x10  # Linux 5.1; not in Python 3.11's fcntl
DEVSHM_ATTEMPTS = 16
_sequence = itertools.count()


@dataclass(frozen=True)
class ShmFile:
    fd: int
    name: str
    backend: str  # "memfd" or "devshm"
    hugetlb_page_size: int | None  # set for MFD_HUGETLB memfds


def next_name(prefix: str, pool: str) -> str:
    """`<prefix><pool>.<pid>.<seq>`: an operator reading /proc/PID/fd sees the pool."""
    return f"{prefix}{pool}.{os.getpid()}.{next(_sequence)}"


def _hugetlb_flag(page_size: int) -> int:
    return syscalls.MFD_HUGETLB | ((page_size.bit_length() - 1) << syscalls.MFD_HUGE_SHIFT)


def create_memfd(name: str, *, hugetlb_page_size: int | None = None) -> ShmFile:
    """A sealable memfd (with MFD_NOEXEC_SEAL where the kernel has it), mode 0600.

    memfd inodes are born 0777: fchmod stops another uid that is handed a read-only fd
    from reopening /proc/PID/fd/N read-write.
    """
    flags = syscalls.MFD_CLOEXEC | syscalls.MFD_ALLOW_SEALING
    if hugetlb_page_size is not None:
        flags |= _hugetlb_flag(hugetlb_page_size)
    try:
        fd = syscalls.memfd_create(name, flags | syscalls.MFD_NOEXEC_SEAL)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        fd = syscalls.memfd_create(name, flags)  # kernel < 6.3: no MFD_NOEXEC_SEAL
    try:
        os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return ShmFile(fd=fd, name=name, backend="memfd", hugetlb_page_size=hugetlb_page_size)


def random_suffix() -> str:
    """16 hex digits from os.urandom: secrets.token_hex without importing secrets (its
    hmac/hashlib imports cost ~6 ms of a process's first allocation)."""
    return os.urandom(8).hex()


def create_devshm(name: str, directory: str) -> ShmFile:
    """An unlinked 0600 file in `directory`, never following or reusing a planted name."""
    for _ in range(DEVSHM_ATTEMPTS):
        full = f"{name}.{random_suffix()}"
        path = os.path.join(directory, full)
        try:
            fd = os.open(
                path,
                os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_RDWR | os.O_CLOEXEC,
                0o600,
            )
        except FileExistsError:
            continue  # a file or a symlink is already there: never touch it
        try:
            os.unlink(path)
        except BaseException:
            os.close(fd)
            raise
        return ShmFile(fd=fd, name=full, backend="devshm", hugetlb_page_size=None)
    raise AllocationError(
        f"could not create a unique file in {directory} after {DEVSHM_ATTEMPTS} attempts: "
        "every random name already existed (is something planting files there?)",
        reason="other",
    )


def size_and_seal(shm: ShmFile, nbytes: int, *, seal: bool) -> int:
    """ftruncate to `nbytes`, then seal SHRINK|GROW|SEAL (memfd only). Returns the seals.

    A hugetlb memfd gets SHRINK|GROW only: `seal_mapped` finishes it once the owner's
    mapping exists (F_SEAL_SEAL would refuse the seal that must come after the mapping).
    """
    os.ftruncate(shm.fd, nbytes)
    if not seal or shm.backend != "memfd":
        return 0
    fcntl.fcntl(shm.fd, fcntl.F_ADD_SEALS, SIZE_SEALS if shm.hugetlb_page_size else SEALS)
    return fcntl.fcntl(shm.fd, fcntl.F_GET_SEALS)


def seal_mapped(shm: ShmFile) -> int:
    """Seal a hugetlb memfd the owner has just mapped: F_SEAL_FUTURE_WRITE, then
    F_SEAL_SEAL. Returns the seals.

    SHRINK does not stop `fallocate(PUNCH_HOLE)`, and on hugetlbfs a punched hole is a
    SIGBUS for whoever touches it next (the pages can be taken meanwhile). Measured on
    Linux 6.18: after F_SEAL_FUTURE_WRITE, PUNCH_HOLE and MADV_REMOVE are EPERM for
    everyone, the owner included, while the owner's existing writable mapping stays
    writable (MADV_POPULATE_WRITE, stores, a forked child's stores, mprotect down and
    back up); a new writable MAP_SHARED mapping is EPERM and mprotect of a read-only one
    to writable EACCES, read-only ones map. hostpool never maps a hugetlb memfd twice
    (it is shared read-only; pinning registers the existing mapping), so a peer of
    another uid can map it read-only and trust it not to be punched under it.
    Kernels without the seal (EINVAL): F_SEAL_SEAL alone.
    """
    try:
        fcntl.fcntl(shm.fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
    fcntl.fcntl(shm.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL)
    return fcntl.fcntl(shm.fd, fcntl.F_GET_SEALS)
