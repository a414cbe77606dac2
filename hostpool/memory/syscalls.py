"""Thin bindings to the Linux calls Python's stdlib lacks, and the seam tests patch.

Every syscall the memory layer makes that can fail in a way the kernel cannot be made
to fail on demand goes through a function of this module, so a test monkeypatches it
here (`memfd_create`, `madvise`, `fallocate`). The libc calls go through ctypes.CDLL,
which releases the GIL: `mmap.madvise()` holds it, so populate threads would serialise.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")

# memfd_create flags (include/uapi/linux/memfd.h). MFD_NOEXEC_SEAL is not in 3.11's os.
MFD_CLOEXEC = 0x0001
MFD_ALLOW_SEALING = 0x0002
MFD_HUGETLB = 0x0004
MFD_NOEXEC_SEAL = 0x0008
MFD_HUGE_SHIFT = 26

# mmap flags (asm-generic/mman-common.h); MAP_HUGE_* as in include/uapi/linux/mman.h.
MAP_SHARED = 0x01
MAP_PRIVATE = 0x02
MAP_ANONYMOUS = 0x20
MAP_POPULATE = 0x8000
MAP_HUGETLB = 0x40000
MAP_HUGE_SHIFT = 26

# madvise advice values.
MADV_HUGEPAGE = 14
MADV_NOHUGEPAGE = 15
MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23

# prctl(PR_SET_VMA, PR_SET_VMA_ANON_NAME, ...): names anonymous mappings (Linux 5.17+,
# CONFIG_ANON_VMA_NAME).
PR_SET_VMA = 0x53564D41
PR_SET_VMA_ANON_NAME = 0

MPOL_BIND = 2
_SYS_MBIND = {"x86_64": 237, "aarch64": 235, "ppc64le": 259, "s390x": 268}

# dlopen(NULL): libc's symbols are already in the process. find_library("c") would run
# ldconfig in a subprocess, on every process's first allocation.
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.mincore.restype = ctypes.c_int
_libc.prctl.argtypes = [
    ctypes.c_int,
    ctypes.c_ulong,
    ctypes.c_ulong,
    ctypes.c_ulong,
    ctypes.c_char_p,
]
_libc.prctl.restype = ctypes.c_int
_libc.syscall.restype = ctypes.c_long


def _raise_errno(what: str) -> None:
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}")


def memfd_create(name: str, flags: int) -> int:
    """`memfd_create(2)`; `os.memfd_create` passes flags through unchanged."""
    return os.memfd_create(name, flags)


def madvise(address: int, length: int, advice: int) -> None:
    """`madvise(2)` without the GIL. Raises OSError with the kernel's errno."""
    if _libc.madvise(address, length, advice) != 0:
        _raise_errno("madvise")


def fallocate(fd: int, offset: int, length: int) -> None:
    """Allocate backing pages now: on tmpfs a clean ENOSPC instead of a later SIGBUS."""
    os.posix_fallocate(fd, offset, length)


def mincore_resident_pages(address: int, length: int) -> int:
    """Pages of [address, address+length) resident in memory, by `mincore(2)`."""
    pages = (length + PAGE_SIZE - 1) // PAGE_SIZE
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(address, length, vec) != 0:
        _raise_errno("mincore")
    # Only bit 0 means "resident" (the others are reserved): keep it, count in C.
    return bytes(vec).translate(_LOW_BIT).count(1)


_LOW_BIT = bytes(b & 1 for b in range(256))


def name_anonymous_mapping(address: int, length: int, name: str) -> bool:
    """Name an anonymous mapping as /proc shows it; False where the kernel cannot."""
    rc = _libc.prctl(PR_SET_VMA, PR_SET_VMA_ANON_NAME, address, length, name.encode())
    if rc != 0:
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOSYS, errno.EPERM):
            return False
        raise OSError(err, f"prctl(PR_SET_VMA_ANON_NAME): {os.strerror(err)}")
    return True


def mbind(address: int, length: int, node: int) -> None:
    """Bind [address, address+length) to one NUMA node (MPOL_BIND) before it is faulted."""
    number = _SYS_MBIND.get(platform.machine())
    if number is None:
        raise OSError(errno.ENOSYS, f"mbind: unknown syscall number on {platform.machine()}")
    bits = ctypes.sizeof(ctypes.c_ulong) * 8
    words = node // bits + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // bits] = 1 << (node % bits)
    rc = _libc.syscall(
        ctypes.c_long(number),
        ctypes.c_void_p(address),
        ctypes.c_ulong(length),
        ctypes.c_int(MPOL_BIND),
        mask,
        ctypes.c_ulong(words * bits + 1),
        ctypes.c_uint(0),
    )
    if rc != 0:
        _raise_errno("mbind")
