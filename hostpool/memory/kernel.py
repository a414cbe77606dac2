"""Kernel facts the allocators decide by, read from /proc and /sys or probed, never guessed.

Used by the allocators and by `hostpool doctor`, so both see the same answers.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path

from hostpool.errors import AllocationError
from hostpool.memory import syscalls

SYS_HUGEPAGES = Path("/sys/kernel/mm/hugepages")
SHMEM_THP = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
ANON_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
NUMA_NODES = Path("/sys/devices/system/node")


@dataclass(frozen=True)
class HugepagePool:
    """One hugetlb page size as /sys reports it."""

    page_size: int
    total: int
    free: int
    reserved: int
    surplus: int

    @property
    def available(self) -> int:
        """Pages a new mapping can reserve: free minus those already promised."""
        return max(0, self.free - self.reserved)


def _read_int(path: Path) -> int:
    return int(path.read_text().strip())


def hugepage_pools() -> dict[int, HugepagePool]:
    """Hugetlb pools by page size in bytes (empty where the kernel has none)."""
    pools: dict[int, HugepagePool] = {}
    if not SYS_HUGEPAGES.is_dir():
        return pools
    for entry in SYS_HUGEPAGES.iterdir():
        match = re.fullmatch(r"hugepages-(\d+)kB", entry.name)
        pool = hugepage_pool(int(match.group(1)) * 1024) if match else None
        if pool is not None:
            pools[pool.page_size] = pool
    return pools


def hugepage_pool(page_size: int) -> HugepagePool | None:
    """The pool of one size, read afresh (cheaper than all sizes on the hot path); None
    where the kernel has no such size or its files cannot be read."""
    entry = SYS_HUGEPAGES / f"hugepages-{page_size // 1024}kB"
    try:
        return HugepagePool(
            page_size=page_size,
            total=_read_int(entry / "nr_hugepages"),
            free=_read_int(entry / "free_hugepages"),
            reserved=_read_int(entry / "resv_hugepages"),
            surplus=_read_int(entry / "surplus_hugepages"),
        )
    except (OSError, ValueError):
        return None


def bracketed(path: Path) -> str | None:
    """The selected value of a sysfs choice file ("always [madvise] never" -> "madvise");
    None when the file is absent or unreadable or selects nothing."""
    try:
        text = path.read_text()
    except OSError:
        return None
    match = re.search(r"\[([\w+-]+)\]", text)
    return match.group(1) if match else None


def shmem_thp_mode() -> str | None:
    """`shmem_enabled`: always, within_size, advise, never, deny or force (None if absent)."""
    return bracketed(SHMEM_THP)


def anon_thp_mode() -> str | None:
    """Anonymous THP: always, madvise or never (None if absent)."""
    return bracketed(ANON_THP)


def shmem_thp_allowed() -> bool:
    """Whether MADV_HUGEPAGE on a shmem mapping can give huge pages."""
    return shmem_thp_mode() in ("always", "within_size", "advise", "force")


def anon_thp_allowed() -> bool:
    return anon_thp_mode() in ("always", "madvise")


def numa_nodes() -> list[int]:
    """Online NUMA node ids (a machine without NUMA support reports [0])."""
    try:
        text = (NUMA_NODES / "online").read_text().strip()
    except OSError:
        return [0]
    nodes: list[int] = []
    for part in text.split(","):
        if "-" in part:
            lo, hi = part.split("-")
            nodes.extend(range(int(lo), int(hi) + 1))
        elif part:
            nodes.append(int(part))
    return nodes


def _probe_fd(flags: int) -> int | None:
    """A close-on-exec probe memfd made with `flags` (the caller closes it), or None where
    memfd_create refuses them (no memfd, or a flag this kernel lacks: EINVAL)."""
    try:
        return syscalls.memfd_create("hostpool.probe", syscalls.MFD_CLOEXEC | flags)
    except OSError:
        return None


def _probe_flags(flags: int) -> bool:
    fd = _probe_fd(flags)
    if fd is None:
        return False
    os.close(fd)
    return True


def probe_memfd() -> bool:
    """Whether memfd_create works here."""
    return _probe_flags(0)


def probe_noexec_seal() -> bool:
    """MFD_NOEXEC_SEAL (Linux 6.3+): EINVAL on older kernels."""
    return _probe_flags(syscalls.MFD_NOEXEC_SEAL)


def probe_sealing() -> bool:
    """Whether a memfd can be sealed against shrinking and growing."""
    import fcntl

    fd = _probe_fd(syscalls.MFD_ALLOW_SEALING)
    if fd is None:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        return bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_GROW)
    except OSError:
        return False
    finally:
        os.close(fd)


_madv_probe: tuple[object, bool] | None = None


def probe_madv_populate_write() -> bool:
    """MADV_POPULATE_WRITE (Linux 5.14+) on one anonymous page, through the seam.

    Only EINVAL means unsupported; any other error is a real failure the caller sees
    when it populates. The answer is cached per `syscalls.madvise` function, so a test
    that patches the seam is probed afresh.
    """
    global _madv_probe
    seam = syscalls.madvise
    if _madv_probe is not None and _madv_probe[0] is seam:
        return _madv_probe[1]
    supported = _probe_madv_populate_write()
    _madv_probe = (seam, supported)
    return supported


def _probe_madv_populate_write() -> bool:
    mm = mmap.mmap(-1, syscalls.PAGE_SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        import ctypes

        holder = (ctypes.c_ubyte * syscalls.PAGE_SIZE).from_buffer(mm)
        try:
            syscalls.madvise(
                ctypes.addressof(holder), syscalls.PAGE_SIZE, syscalls.MADV_POPULATE_WRITE
            )
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return False
            raise
        finally:
            del holder
        return True
    finally:
        mm.close()


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (HugePages_* counts stay counts)."""
    out: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if not parts:
                continue
            value = int(parts[0])
            out[key] = value * 1024 if len(parts) > 1 and parts[1] == "kB" else value
    return out


# -- OSErrors of the allocation path as typed AllocationErrors: the errno mapped to a reason
# from the fixed set, with a message that says what to do (populate, region creation,
# admission, handing out an fd).
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
        free = meminfo().get("MemAvailable", 0)
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
