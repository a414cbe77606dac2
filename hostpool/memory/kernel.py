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
        if not match:
            continue
        size = int(match.group(1)) * 1024
        try:
            pools[size] = HugepagePool(
                page_size=size,
                total=_read_int(entry / "nr_hugepages"),
                free=_read_int(entry / "free_hugepages"),
                reserved=_read_int(entry / "resv_hugepages"),
                surplus=_read_int(entry / "surplus_hugepages"),
            )
        except (OSError, ValueError):
            continue
    return pools


def hugepage_pool(page_size: int) -> HugepagePool | None:
    """The pool of one size, read afresh (cheaper than all sizes on the hot path)."""
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


def _bracketed(path: Path) -> str | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    match = re.search(r"\[(\w[\w+-]*)\]", text)
    return match.group(1) if match else None


def shmem_thp_mode() -> str | None:
    """`shmem_enabled`: always, within_size, advise, never, deny or force (None if absent)."""
    return _bracketed(SHMEM_THP)


def anon_thp_mode() -> str | None:
    """Anonymous THP: always, madvise or never (None if absent)."""
    return _bracketed(ANON_THP)


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


def probe_memfd() -> bool:
    try:
        fd = syscalls.memfd_create("hostpool.probe", syscalls.MFD_CLOEXEC)
    except OSError:
        return False
    os.close(fd)
    return True


def probe_noexec_seal() -> bool:
    """MFD_NOEXEC_SEAL (Linux 6.3+): EINVAL on older kernels."""
    try:
        fd = syscalls.memfd_create(
            "hostpool.probe", syscalls.MFD_CLOEXEC | syscalls.MFD_NOEXEC_SEAL
        )
    except OSError:
        return False
    os.close(fd)
    return True


def probe_sealing() -> bool:
    import fcntl

    try:
        fd = syscalls.memfd_create(
            "hostpool.probe", syscalls.MFD_CLOEXEC | syscalls.MFD_ALLOW_SEALING
        )
    except OSError:
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
